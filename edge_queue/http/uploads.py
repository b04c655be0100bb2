"""An upload of the HTTP API, streamed from the request's multipart body to a file of
``<data_dir>/uploads`` (docs/http-api.md, "Uploads"): never held in memory, bounded in size and
by the disk's free space, hashed as it is written, and committed (fsync, then renamed to its
content's name) before any job names it.

- The one file part (``audio_file`` for ``/asr``, ``file`` for OpenAI's routes) is written as
  it arrives; ``raw_pcm`` (``/asr?encode=false``: 16-bit mono PCM at 16 kHz, no header, as
  Bazarr's ffmpeg makes it) is wrapped in a WAV header by the standard library's :mod:`wave`
  so that PyAV opens it like any recording.
- Every other part is a form field of at most :data:`MAX_FIELD_BYTES` (all of them together
  at most :data:`MAX_FIELDS_BYTES`).
- The file is named ``<sha256 of what was sent>.<wav|suffix>``: the same audio sent again has
  the same name (and the same job: docs/http-api.md, "Sent again").

A refused upload raises :class:`~edge_queue.errors.RequestError` with the error code to answer
with (its status: :mod:`.statuses`).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import threading
import uuid
import wave
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

from python_multipart import MultipartParser
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import parse_options_header

from edge_queue.errors import ErrorCode, RequestError

#: A form field's value, bytes at most; and all fields of one request together.
MAX_FIELD_BYTES = 16 * 1024
MAX_FIELDS_BYTES = 64 * 1024
#: Free space is checked again after every this many bytes written.
DISK_CHECK_BYTES = 8 * 2**20
#: Parts of one request, at most.
MAX_PARTS = 32
#: Raw PCM as Bazarr sends it: 16-bit samples, one channel, 16 kHz.
PCM_RATE, PCM_WIDTH, PCM_CHANNELS = 16_000, 2, 1
#: Held while an upload takes its content's name, so that :attr:`Upload.created` is exact.
_NAMING = threading.Lock()


def boundary_of(content_type: str | None) -> bytes:
    """The multipart boundary of a ``Content-Type``; raises
    :class:`~edge_queue.errors.RequestError` 400 when the body is not ``multipart/form-data``."""
    kind, params = parse_options_header(content_type or "")
    if kind != b"multipart/form-data" or not params.get(b"boundary"):
        raise RequestError(
            "the body must be multipart/form-data with the audio as a file part", code=ErrorCode.INVALID_REQUEST
        )
    return params[b"boundary"]


def suffix_of(filename: str | None) -> str:
    """The name's suffix when it is 1-8 letters or digits (``.m4a`` -> ``m4a``), else ``bin``:
    nothing else of a caller's file name reaches the disk."""
    suffix = Path(filename or "").suffix.lstrip(".").lower()
    return suffix if re.fullmatch(r"[a-z0-9]{1,8}", suffix) else "bin"


class Upload:
    """One request's body, fed with :meth:`feed` as it arrives, then :meth:`finish` ed.

    ``folder``: ``<data_dir>/uploads``; ``file_field``: the name of the file part;
    ``raw_pcm``: wrap the file in a WAV header; ``max_bytes``: the largest file;
    ``min_free_bytes``: the free space the disk keeps (``limits.min_free_disk_mb``);
    ``keep_bytes``: keep only the file's first bytes (the rest is read and dropped);
    ``refused_fields``: form fields refused as their part begins, before their value is read
    (name -> the message of the ``invalid_request`` raised, its ``field`` the name without
    ``[]``)."""

    def __init__(
        self,
        folder: Path,
        boundary: bytes,
        *,
        file_field: str,
        raw_pcm: bool,
        max_bytes: int,
        min_free_bytes: int,
        keep_bytes: int | None = None,
        refused_fields: Mapping[str, str] | None = None,
    ) -> None:
        self.folder, self.file_field, self.raw_pcm = folder, file_field, raw_pcm
        self.refused_fields = refused_fields or {}
        self.max_bytes, self.min_free_bytes, self.keep_bytes = max_bytes, min_free_bytes, keep_bytes
        #: form fields: name -> values (a name may repeat: ``timestamp_granularities[]``)
        self.fields: dict[str, list[str]] = {}
        self.size = 0
        self.path: Path | None = None
        #: True when :meth:`finish` made the file (no upload of the same content was there)
        self.created = False
        #: True once a job names the file (set by the API when the submit is answered)
        self.used = False
        # what the file holds: the same bytes sent the same way, and kept the same, are one file
        self._digest = hashlib.sha256(f"{'pcm' if raw_pcm else 'file'}:{keep_bytes}\0".encode())
        self._part_path: Path | None = None
        self._fh: BinaryIO | None = None
        self._wav: wave.Wave_write | None = None
        self._filename: str | None = None
        self._header_name, self._header_value = bytearray(), bytearray()
        self._headers: dict[bytes, bytes] = {}
        self._field: str | None = None
        self._value = bytearray()
        self._in_file = False
        self._parts = 0
        self._fields_bytes = 0
        self._since_check = 0
        try:
            self._parser = self._parser_of(boundary)
        except FormParserError as e:  # a boundary python-multipart refuses (over 256 bytes)
            raise RequestError(f"the multipart boundary cannot be used: {e}", code=ErrorCode.INVALID_REQUEST) from None

    def _parser_of(self, boundary: bytes) -> MultipartParser:
        return MultipartParser(
            boundary,
            {
                "on_part_begin": self._part_begin,
                "on_header_field": lambda d, s, e: self._header_name.extend(d[s:e]),
                "on_header_value": lambda d, s, e: self._header_value.extend(d[s:e]),
                "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished,
                "on_part_data": self._part_data,
                "on_part_end": self._part_end,
            },
        )

    def feed(self, chunk: bytes) -> None:
        """Parse and write the next piece of the body. Raises :class:`~edge_queue.errors.RequestError`."""
        try:
            self._parser.write(chunk)
        except FormParserError as e:
            raise RequestError(f"the multipart body cannot be read: {e}", code=ErrorCode.INVALID_REQUEST) from None

    def finish(self) -> Path:
        """The body ended: make the file durable and give it its content's name
        (``<sha256>.<suffix>``, in ``folder``). Returns its path. Raises :class:`~edge_queue.errors.RequestError`
        when no file part came, and ``OSError`` when the disk fails."""
        self._parser.finalize()
        if self._part_path is None or self._fh is None or self._in_file:
            raise RequestError(f"no file part named {self.file_field!r} in the body", code=ErrorCode.INVALID_REQUEST)
        if self._wav is not None:
            self._wav.close()  # writes the header's sizes
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self._fh = None
        name = f"{self._digest.hexdigest()}.{'wav' if self.raw_pcm else suffix_of(self._filename)}"
        final = self.folder / name
        with _NAMING:
            self.created = not final.exists()
            os.replace(self._part_path, final)  # the same content under the same name: either is it
        self._part_path = None
        dir_fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self.path = final
        return final

    def discard(self) -> None:
        """Drop what was written of an upload that will not be finished."""
        if self._wav is not None:  # closed first: its finalizer would write to the closed file
            try:
                self._wav.close()
            except (OSError, ValueError, wave.Error):
                pass
            self._wav = None
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError:
                pass
            self._fh = None
        if self._part_path is not None:
            delete(self._part_path)
            self._part_path = None

    # -- the parser's callbacks -----------------------------------------------------------

    def _part_begin(self) -> None:
        self._parts += 1
        if self._parts > MAX_PARTS:
            raise RequestError(f"more than {MAX_PARTS} parts in the body", code=ErrorCode.INVALID_REQUEST)
        self._headers.clear()

    def _header_end(self) -> None:
        if len(self._header_name) + len(self._header_value) > 4096:
            raise RequestError("a part's header is over 4,096 bytes", code=ErrorCode.INVALID_REQUEST)
        self._headers[bytes(self._header_name).lower()] = bytes(self._header_value)
        self._header_name.clear()
        self._header_value.clear()

    def _headers_finished(self) -> None:
        _, params = parse_options_header(self._headers.get(b"content-disposition", b""))
        name = params.get(b"name", b"").decode("utf-8", "replace")
        if name != self.file_field and b"filename" in params:
            raise RequestError(
                f"the file part must be named {self.file_field!r}, not {name[:40]!r}", code=ErrorCode.INVALID_REQUEST
            )
        if name == self.file_field:
            if self._part_path is not None:
                raise RequestError(f"more than one {self.file_field!r} part", code=ErrorCode.INVALID_REQUEST)
            self._filename = params.get(b"filename", b"").decode("utf-8", "replace") or None
            self._open()
            self._in_file = True
        elif name in self.refused_fields:
            raise RequestError(self.refused_fields[name], code=ErrorCode.INVALID_REQUEST, field=name.removesuffix("[]"))
        else:
            self._field, self._value = name, bytearray()

    def _open(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._check_disk()
        self._part_path = self.folder / f".part-{uuid.uuid4().hex}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        try:
            fd = os.open(self._part_path, flags, 0o640)
        except FileNotFoundError:  # the user's folder, empty, was just removed (:func:`delete`)
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._part_path, flags, 0o640)
        self._fh = os.fdopen(fd, "wb")
        if self.raw_pcm:
            self._wav = wave.open(self._fh, "wb")
            self._wav.setnchannels(PCM_CHANNELS)
            self._wav.setsampwidth(PCM_WIDTH)
            self._wav.setframerate(PCM_RATE)

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        piece = data[start:end]
        if not self._in_file:
            self._fields_bytes += len(piece)
            if len(self._value) + len(piece) > MAX_FIELD_BYTES or self._fields_bytes > MAX_FIELDS_BYTES:
                raise RequestError(f"a form field is over {MAX_FIELD_BYTES} bytes", code=ErrorCode.PAYLOAD_TOO_LARGE)
            self._value.extend(piece)
            return
        self.size += len(piece)
        if self.size > self.max_bytes:
            raise RequestError(
                f"the upload is over {self.max_bytes // 2**20} MiB ([api] max_upload_mb)",
                code=ErrorCode.PAYLOAD_TOO_LARGE,
            )
        if self.keep_bytes is not None:
            piece = piece[: max(0, self.keep_bytes - (self.size - len(piece)))]
            if not piece:
                return
        self._digest.update(piece)
        if self._wav is not None:
            self._wav.writeframesraw(piece)
        else:
            assert self._fh is not None
            self._fh.write(piece)
        self._since_check += len(piece)
        if self._since_check >= DISK_CHECK_BYTES:
            self._since_check = 0
            self._check_disk()

    def _part_end(self) -> None:
        if self._in_file:
            self._in_file = False
            return
        if self._field is not None:
            self.fields.setdefault(self._field, []).append(self._value.decode("utf-8", "replace"))
        self._field = None

    def _check_disk(self) -> None:
        free = shutil.disk_usage(self.folder).free
        if free - DISK_CHECK_BYTES < self.min_free_bytes:
            raise RequestError(
                f"{free // 2**20} MiB free where edge-queue keeps {self.min_free_bytes // 2**20} "
                "(limits.min_free_disk_mb): the upload is refused",
                code=ErrorCode.DISK_FULL,
            )


def field(upload: Upload, name: str, default: Any = None) -> Any:
    """The last value of form field ``name``, or ``default``."""
    values = upload.fields.get(name)
    return values[-1] if values else default


def user_folder(uploads: Path, user: str) -> Path:
    """``<uploads>/<the first 16 hex digits of the user name's SHA-256>``: a user's uploads,
    apart so that what each user keeps on disk is known, whatever characters its name has
    (docs/http-api.md, "Uploads")."""
    return uploads / hashlib.sha256(user.encode()).hexdigest()[:16]


def delete(path: Path) -> None:
    """Delete the upload (or unfinished upload) ``path``, and its user's folder when that is
    left empty: a refused upload leaves nothing in ``uploads``. Raises ``OSError``."""
    path.unlink(missing_ok=True)
    if re.fullmatch(r"[0-9a-f]{16}", path.parent.name):
        try:
            path.parent.rmdir()
        except OSError:
            pass  # not empty: another upload of the user's is there


def disk_of(folder: Path) -> tuple[int, int]:
    """``(bytes of the finished uploads in folder, bytes free on its disk)``; the folder is
    made when missing. Uploads being received (``.part-*``) are not counted: their callers
    count them as they arrive. Raises ``OSError``."""
    folder.mkdir(parents=True, exist_ok=True)
    held = 0
    for entry in os.scandir(folder):
        if entry.name.startswith(".part-"):
            continue
        try:
            held += entry.stat(follow_symlinks=False).st_size
        except OSError:
            continue
    return held, shutil.disk_usage(folder).free


def sweep(folder: Path, keep_s: float, now: float, *, unfinished_s: float | None = 3600.0) -> int:
    """Delete the uploads of ``folder`` and of its users' folders last written over ``keep_s``
    seconds before ``now`` (unix seconds; their jobs are gone by then, docs/http-api.md,
    "Uploads"), and unfinished ones (``.part-*``) over ``unfinished_s`` seconds old (None:
    every one, at the service's start, when no upload is being received). Returns how many
    were deleted."""
    deleted = 0
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                deleted += sweep(Path(entry.path), keep_s, now, unfinished_s=unfinished_s)
                if re.fullmatch(r"[0-9a-f]{16}", entry.name):
                    os.rmdir(entry.path)  # OSError when not empty: kept
                continue
            age = now - entry.stat(follow_symlinks=False).st_mtime
            if entry.name.startswith(".part-"):
                old = unfinished_s is None or age > unfinished_s
            else:
                old = age > keep_s
            if old:
                os.unlink(entry.path)
                deleted += 1
        except OSError:
            continue
    return deleted
