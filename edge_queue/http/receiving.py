"""A call's upload received (docs/http-api.md, "Bounds"): its body streamed to an upload file
of the caller's user's folder (:mod:`.uploads`) in one of the upload slots (:mod:`.shares`), at
a least rate, within ``api.max_upload_s`` and the user's bytes on disk; the file held while its
call runs, and deleted at the call's end when no job names it.

Used on the API's event loop only (one thread): no locks.
"""

from __future__ import annotations

import asyncio
import errno
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path

import anyio
from starlette.requests import Request

from edge_queue.config.settings import Settings
from edge_queue.errors import ErrorCode, RequestError

from .callers import Caller
from .shares import Shares, next_piece, user_bytes_allowed
from .uploads import Upload, boundary_of, delete, disk_of, user_folder

#: An upload slower than this many bytes a second over :data:`RATE_WINDOW_S` is dropped (408).
MIN_UPLOAD_BYTES_S = 16 * 1024
RATE_WINDOW_S = 10.0


class UploadReceiver:
    """The uploads of the API's calls, over ``settings``, the API's ``shares`` (upload slots and
    waits) and ``stop_receiving_at`` (when a stop began, monotonic seconds, or None: the calls
    still being received are answered 503 ``stopping`` by then)."""

    def __init__(self, settings: Settings, shares: Shares, stop_receiving_at: Callable[[], float | None]) -> None:
        self.settings, self.api, self.shares = settings, settings.api, shares
        self.uploads = settings.uploads_dir
        self.stop_receiving_at = stop_receiving_at
        self.holding: Counter[Path] = Counter()  # upload files of calls not yet answered

    def release(self, upload: Upload | None) -> None:
        """The call of ``upload`` has ended: its file is deleted when no job names it, this
        call made it and no other call holds it (a refused call leaves nothing on disk)."""
        if upload is None or upload.path is None:
            return
        self.holding[upload.path] -= 1
        if self.holding[upload.path] <= 0:
            del self.holding[upload.path]
            if upload.created and not upload.used:
                delete(upload.path)

    async def receive(
        self,
        request: Request,
        caller: Caller,
        file_field: str,
        *,
        raw_pcm: bool,
        keep_bytes: int | None = None,
        refused_fields: Mapping[str, str] | None = None,
    ) -> Upload:
        """Stream the body to an upload file of the caller's user's folder, in one of the
        upload slots (:class:`~.shares.Shares`); each upload at least :data:`MIN_UPLOAD_BYTES_S`
        over every :data:`RATE_WINDOW_S`, done within ``api.max_upload_s``, and the user's
        uploads on disk within :func:`~.shares.user_bytes_allowed`; a form field named in
        ``refused_fields`` (name -> message) refused as its part begins."""
        self.shares.may_wait(caller)
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.api.max_upload_mb * 2**20 + 2**20:
            raise RequestError(
                f"the upload is over {self.api.max_upload_mb} MiB ([api] max_upload_mb)",
                code=ErrorCode.PAYLOAD_TOO_LARGE,
            )
        upload = Upload(
            user_folder(self.uploads, caller.user),
            boundary_of(request.headers.get("content-type")),
            file_field=file_field,
            raw_pcm=raw_pcm,
            max_bytes=self.api.max_upload_mb * 2**20,
            min_free_bytes=self.settings.limits.min_free_disk_mb * 2**20,
            keep_bytes=keep_bytes,
            refused_fields=refused_fields,
        )
        slot = self.shares.take(caller, time.monotonic())
        dropped = asyncio.ensure_future(slot.dropped.wait())
        try:
            held, free = await anyio.to_thread.run_sync(disk_of, upload.folder)
            allowed = user_bytes_allowed(held, free, upload.min_free_bytes, self.api.max_user_uploads_mb * 2**20)
            stream = request.stream().__aiter__()
            window, window_bytes = time.monotonic(), 0
            deadline = window + self.api.max_upload_s
            while True:
                chunk = await next_piece(stream, slot, dropped, deadline, self.api, self.stop_receiving_at)
                if chunk is None:
                    break
                upload.feed(chunk)
                slot.received = upload.size
                slot.kept = min(upload.size, upload.keep_bytes if upload.keep_bytes is not None else upload.size)
                if held + self.shares.receiving(caller.user) > allowed:
                    raise RequestError(
                        f"the uploads of user {caller.user!r} would pass {allowed // 2**20} MiB on disk "
                        "([api] max_user_uploads_mb, or half of the space left); they go as their jobs end",
                        code=ErrorCode.UPLOADS_FULL,
                    )
                window_bytes += len(chunk)
                if (elapsed := time.monotonic() - window) >= RATE_WINDOW_S:
                    if window_bytes < MIN_UPLOAD_BYTES_S * elapsed:
                        raise RequestError(
                            f"the upload is slower than {MIN_UPLOAD_BYTES_S // 1024} KiB/s",
                            code=ErrorCode.UPLOAD_TIMEOUT,
                        )
                    window, window_bytes = time.monotonic(), 0
            await anyio.to_thread.run_sync(upload.finish)
            self.holding[upload.path] += 1  # type: ignore[index]
            request.state.upload = upload
            return upload
        except OSError as e:
            upload.discard()
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise RequestError("the disk is full: the upload is refused", code=ErrorCode.DISK_FULL) from None
            raise
        except BaseException:
            upload.discard()
            raise
        finally:
            dropped.cancel()
            self.shares.release(slot)
