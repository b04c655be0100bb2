"""Chunks of one recording decoded at once (``transcribe.chunks_at_once``), their segments
handed back in chunk order.

Each chunk is decoded on a thread of a small pool, by a replica of the worker's model of its
own (faster-whisper's ``num_workers``; CTranslate2 runs the replicas side by side and releases
the GIL while it computes). The job's own thread reads the segments of the oldest chunk as they
come, and between them calls ``tick`` (the job's checkpoint: a cancel ends the job there, and
the chunks still decoding stop at their next segment).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

#: Seconds the job's thread waits for a chunk's next segment before it calls ``tick`` again.
TICK_S = 0.25


class Pending:
    """One chunk being decoded: its ``TranscriptionInfo`` (:meth:`info`), then its segments
    (:meth:`segments`), read once, in order, from the job's thread."""

    def __init__(self) -> None:
        self.items: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._info: Any = None
        self._has_info = False

    def _next(self, tick: Callable[[], None]) -> tuple[str, Any]:
        while True:
            try:
                kind, value = self.items.get(timeout=TICK_S)
            except queue.Empty:
                tick()
                continue
            if kind == "error":
                raise value
            return kind, value

    def info(self, tick: Callable[[], None]) -> Any:
        """The chunk's ``TranscriptionInfo`` once decoding has started; raises what the decoder
        raised."""
        if not self._has_info:
            kind, self._info = self._next(tick)
            assert kind == "info", kind
            self._has_info = True
        return self._info

    def segments(self, tick: Callable[[], None]) -> Iterator[dict[str, Any]]:
        """The chunk's segments as they are decoded; raises what the decoder raised."""
        self.info(tick)
        while True:
            kind, value = self._next(tick)
            if kind == "end":
                return
            yield value


class DecodeAhead:
    """A pool of ``width`` threads decoding chunks; :meth:`close` stops it (the chunks being
    decoded end at their next segment)."""

    def __init__(self, width: int) -> None:
        self.pool = ThreadPoolExecutor(width, thread_name_prefix="decode")
        self.stop = threading.Event()

    def start(self, work: Callable[[], tuple[Iterator[dict[str, Any]], Any]]) -> Pending:
        """Start ``work`` (returning a chunk's segment iterator and its ``TranscriptionInfo``,
        as :func:`~edge_queue.kinds.whisper.decode` does) on a thread of the pool."""
        pending = Pending()

        def run() -> None:
            try:
                segments, info = work()
                pending.items.put(("info", info))
                for seg in segments:
                    if self.stop.is_set():
                        return
                    pending.items.put(("seg", seg))
                pending.items.put(("end", None))
            except BaseException as e:  # handed to the job's thread, which raises it
                pending.items.put(("error", e))

        self.pool.submit(run)
        return pending

    def close(self) -> None:
        self.stop.set()
        self.pool.shutdown(wait=False, cancel_futures=True)
