"""What one caller may hold of the HTTP API at once (docs/http-api.md, "Bounds"): upload
slots, a user's bytes on disk, calls waiting for their jobs.

- **Upload slots:** ``api.uploads_at_once``, of which one caller holds at most
  :data:`CALLER_SHARE`; when every slot is taken, a new call takes the slot of the slowest
  upload that has run :data:`SLOW_AFTER_S` at under :data:`SLOW_BYTES_S` (that upload is
  dropped, 408), and is refused (503 ``busy``) only when none is that slow.
- **Bytes on disk:** a user's uploads kept and being received, at most
  ``api.max_user_uploads_mb`` and at most half of what uploads can have
  (:func:`user_bytes_allowed`).
- **Waiting calls:** at most :data:`WAITS_PER_CALLER` per caller and :data:`WAITS_PER_JOB` per
  job (resends of one audio wait for one job), whatever their uploads.
- **An upload's time:** each piece of its body within ``api.idle_timeout_s``, the whole within
  ``api.max_upload_s``, and its slot given up when a new call takes it (:func:`next_piece`).

Plain data, used on the API's event loop only (one thread): no locks.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edge_queue.config.api import ApiSettings
from edge_queue.errors import ErrorCode, RequestError

from .callers import Caller
from .statuses import stopping

#: One caller receives at most this share of ``api.uploads_at_once`` uploads at a time.
CALLER_SHARE = 0.75
#: An upload whose average since its start is under this many bytes a second, once it has run
#: :data:`SLOW_AFTER_S`, gives its slot to a new call when every slot is taken.
SLOW_BYTES_S = 1024 * 1024
SLOW_AFTER_S = 10.0
#: Seconds between two looks, while an upload's next piece is awaited, at whether a stop began.
STOP_LOOK_S = 0.25
#: Calls of one caller waiting for their jobs at once, at most (an eighth of the 256
#: connections, so that four callers waiting and every upload slot leave room for others).
WAITS_PER_CALLER = 32
#: Calls waiting for one job at once, at most (Bazarr resends after its read timeout; the
#: earlier call has gone by then).
WAITS_PER_JOB = 4


@dataclass(eq=False, slots=True)
class Slot:
    """One upload being received: by ``caller``, since ``started`` (monotonic seconds),
    ``received`` bytes of its file so far, of which ``kept`` written to disk; ``dropped`` is set
    when a new call took the slot."""

    caller: Caller
    started: float
    received: int = 0
    kept: int = 0
    dropped: asyncio.Event = field(default_factory=asyncio.Event)


def slowest(slots: list[Slot], now: float) -> Slot | None:
    """The slot a new call takes when every slot is taken: the one with the lowest average
    rate among those that have run :data:`SLOW_AFTER_S` under :data:`SLOW_BYTES_S`; None when
    no upload is that slow."""
    slow = [
        (s.received / (now - s.started), i)
        for i, s in enumerate(slots)
        if now - s.started >= SLOW_AFTER_S and s.received < SLOW_BYTES_S * (now - s.started)
    ]
    return slots[min(slow)[1]] if slow else None


def user_bytes_allowed(held: int, free: int, min_free: int, cap: int) -> int:
    """Bytes a user's uploads may have on disk: at most ``cap`` (``api.max_user_uploads_mb``)
    and at most half of what uploads can have, the user's own (``held``) plus the disk's
    ``free`` space above ``min_free`` (``limits.min_free_disk_mb``), so that one user leaves
    the other half to everyone else whatever the disk's size."""
    return max(0, min(cap, (held + max(0, free - min_free)) // 2))


class Shares:
    """The API's upload slots and waiting calls, with their bounds per caller and per job."""

    def __init__(self, uploads_at_once: int) -> None:
        self.uploads_at_once = uploads_at_once
        self.slots: list[Slot] = []
        self.waits_by_caller: Counter[str] = Counter()
        self.waits_by_job: Counter[str] = Counter()

    def take(self, caller: Caller, now: float) -> Slot:
        """An upload slot for ``caller``. Raises :class:`~edge_queue.errors.RequestError` 503 ``busy`` when the
        caller holds its share, or every slot is taken and none by a slow upload (which is
        otherwise dropped: its ``dropped`` is set and its slot given to this call)."""
        share = max(1, int(self.uploads_at_once * CALLER_SHARE))
        if sum(s.caller.key == caller.key for s in self.slots) >= share:
            raise RequestError(
                f"{share} uploads of this caller at once (of [api] uploads_at_once)",
                code=ErrorCode.BUSY,
                retry_after_s=10,
            )
        if len(self.slots) >= self.uploads_at_once:
            slow = slowest(self.slots, now)
            if slow is None:
                raise RequestError(
                    f"{len(self.slots)} uploads at once ([api] uploads_at_once)", code=ErrorCode.BUSY, retry_after_s=10
                )
            self.release(slow)
            slow.dropped.set()
        slot = Slot(caller, now)
        self.slots.append(slot)
        return slot

    def release(self, slot: Slot) -> None:
        """The upload of ``slot`` ended (or was dropped)."""
        if slot in self.slots:
            self.slots.remove(slot)

    def receiving(self, user: str) -> int:
        """Bytes of ``user``'s uploads being received now, written so far."""
        return sum(s.kept for s in self.slots if s.caller.user == user)

    def may_wait(self, caller: Caller) -> None:
        """Raises :class:`~edge_queue.errors.RequestError` 503 ``busy`` when ``caller`` has :data:`WAITS_PER_CALLER`
        calls waiting already (checked before an upload is taken, so none is wasted)."""
        if self.waits_by_caller[caller.key] >= WAITS_PER_CALLER:
            raise RequestError(
                f"{WAITS_PER_CALLER} calls of this caller wait for their jobs already",
                code=ErrorCode.BUSY,
                retry_after_s=30,
            )

    def wait(self, caller: Caller, job_id: str) -> None:
        """Count a call of ``caller`` waiting for ``job_id``; :meth:`done` ends it. Raises
        :class:`~edge_queue.errors.RequestError` 503 ``busy`` past :data:`WAITS_PER_CALLER` or :data:`WAITS_PER_JOB`
        (the job goes on: the same audio sent later is answered from it)."""
        self.may_wait(caller)
        if self.waits_by_job[job_id] >= WAITS_PER_JOB:
            raise RequestError(
                f"{WAITS_PER_JOB} calls wait for job {job_id} already; it goes on",
                code=ErrorCode.BUSY,
                retry_after_s=30,
            )
        self.waits_by_caller[caller.key] += 1
        self.waits_by_job[job_id] += 1

    def done(self, caller: Caller, job_id: str) -> None:
        """A call counted by :meth:`wait` stopped waiting."""
        for counter, key in ((self.waits_by_caller, caller.key), (self.waits_by_job, job_id)):
            counter[key] -= 1
            if counter[key] <= 0:
                del counter[key]


async def next_piece(
    stream: Any,
    slot: Slot,
    dropped: asyncio.Future[Any],
    deadline: float,
    api: ApiSettings,
    stop_at: Callable[[], float | None] = lambda: None,
) -> bytes | None:
    """The body's next piece, None at its end. Raises :class:`~edge_queue.errors.RequestError`
    408 after ``api.idle_timeout_s`` without data, past ``deadline`` (``api.max_upload_s``), or when a new
    call took the slot of this slow upload (``dropped``); 503 ``stopping``
    once the service stops (``stop_at()``: when, in monotonic seconds, or None), looked at every
    :data:`STOP_LOOK_S` seconds."""
    piece: asyncio.Future[bytes] = asyncio.ensure_future(stream.__anext__())
    idle_end = min(time.monotonic() + api.idle_timeout_s, deadline)
    while not piece.done() and not dropped.done():
        stop = stop_at()
        if stop is not None and time.monotonic() >= stop:
            piece.cancel()
            raise stopping()
        wait = min(idle_end, stop if stop is not None else idle_end) - time.monotonic()
        if wait <= 0 and time.monotonic() >= idle_end:
            break
        await asyncio.wait(
            {piece, dropped}, timeout=min(max(wait, 0.0), STOP_LOOK_S), return_when=asyncio.FIRST_COMPLETED
        )
    if piece.done():
        try:
            return piece.result()
        except StopAsyncIteration:
            return None
    piece.cancel()
    if slot.dropped.is_set():
        raise RequestError("every upload slot was taken and this upload was the slowest", code=ErrorCode.UPLOAD_TIMEOUT)
    if time.monotonic() >= deadline:
        raise RequestError(
            f"the upload took over {api.max_upload_s:g} s ([api] max_upload_s)", code=ErrorCode.UPLOAD_TIMEOUT
        )
    raise RequestError(
        f"nothing sent for {api.idle_timeout_s:g} s ([api] idle_timeout_s)", code=ErrorCode.UPLOAD_TIMEOUT
    )
