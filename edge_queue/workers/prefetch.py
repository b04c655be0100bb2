"""Prefetch of short jobs: which kinds are short (their mean attempt time, measured here), how
many jobs a busy worker may hold at once, which workers may take more, and the jobs a worker
gives back from its queue, not started (:meth:`Prefetch.release`), when the one it runs
overruns, on a pause, a stop or a cancel.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from edge_queue.config.settings import Settings

from .processes import JobEntry, WorkerSlot

log = logging.getLogger(__name__)

#: Most jobs one worker may hold at once (the one it runs and those it runs next), for short
#: kinds. Each loop turn has a fixed cost (about 1.5 ms of CPU under load), so the more jobs a
#: turn's hand-out and outcomes carry, the less each job costs: P1 (bench/p1_throughput.py) ran
#: 5,000 no-op jobs in batches at 0.36 ms of service CPU per job with 16, 0.29 with 64 and 0.26
#: with 256 (docs/benchmarks.md).
PREFETCH = 256
#: ... and at most this many seconds of expected work (jobs held times the slowest short kind's
#: mean attempt time), so that a job of higher priority submitted meanwhile waits for at most
#: about this long behind jobs already handed out: 256 no-op jobs, 20 jobs of 5 ms, 2 of 49 ms.
PREFETCH_S = 0.1
#: A kind whose attempts take less than this many seconds on average is "short".
FAST_S = 0.05
#: A worker whose current job has run this many seconds while short jobs wait in its queue
#: gives those back (:meth:`Prefetch.release`): a kind's mean does not foresee a job whose
#: options make it long (a no-op with ``sleep_s``), and the jobs behind it, or one of higher
#: priority submitted meanwhile, go to the next free worker instead of waiting for it.
OVERRUN_S = 1.0


class Prefetch:
    """Short jobs handed to busy workers, for the worker pool (:class:`~.supervisor.Supervisor`).

    Args:
        settings: ``max_jobs_per_worker`` (a worker is given no more jobs than it has left).
        clock: monotonic seconds, the pool's own.
    """

    def __init__(self, settings: Settings, clock: Callable[[], float]) -> None:
        self.settings, self.clock = settings, clock
        self.avg_s: dict[str, tuple[float, int]] = {}  # kind -> (mean run time in s, attempts seen)

    def took(self, kind: str, took_s: float) -> None:
        """An attempt of ``kind`` ran ``took_s`` seconds in its worker."""
        mean, n = self.avg_s.get(kind, (0.0, 0))
        # An exponentially weighted mean over about the last 10 attempts.
        self.avg_s[kind] = (took_s if n == 0 else mean + (took_s - mean) / min(n + 1, 10), n + 1)

    def fast(self, kind: str) -> bool:
        """True when attempts of ``kind`` have taken less than :data:`FAST_S` on average."""
        avg = self.avg_s.get(kind)
        return avg is not None and avg[1] >= 3 and avg[0] < FAST_S

    def per_worker(self) -> int:
        """How many jobs of short kinds a worker may hold at once: :data:`PREFETCH_S` over the
        slowest short kind's mean attempt time, at least 1 and at most :data:`PREFETCH`."""
        slowest = max((mean for mean, n in self.avg_s.values() if n >= 3 and mean < FAST_S), default=FAST_S)
        return max(1, min(PREFETCH, int(PREFETCH_S / max(slowest, 1e-6))))

    def room(self, slot: WorkerSlot) -> int:
        """How many more jobs the worker may be given: up to :meth:`per_worker` held at once,
        and no more than it has left before ``max_jobs_per_worker`` replaces it."""
        room = self.per_worker() - len(slot.jobs)
        if self.settings.max_jobs_per_worker:
            room = min(room, self.settings.max_jobs_per_worker - slot.jobs_done - len(slot.jobs))
        return room

    def prefetching(self, slots: Iterable[WorkerSlot]) -> list[WorkerSlot]:
        """Of ``slots``, the workers that hold only short jobs and have :meth:`room`: they may
        take more."""
        return [
            s
            for s in slots
            if s.process is not None
            and not s.lane
            and s.recycle is None
            and s.jobs
            and self.room(s) > 0
            and not s.releasing
            and not self.overran(s)
            and all(self.fast(e.msg["kind"]) for e in s.jobs)
        ]

    def overran(self, slot: WorkerSlot) -> bool:
        """True when the worker's current job has run :data:`OVERRUN_S` seconds or more."""
        head = slot.jobs[0] if slot.jobs else None
        return head is not None and head.started is not None and self.clock() - head.started >= OVERRUN_S

    @staticmethod
    def release(slot: WorkerSlot, job_ids: list[str] | None = None) -> None:
        """Ask the worker to give back jobs of ``job_ids`` (all, for ``None``) waiting in its
        queue, not started. Its answer (:meth:`released`, from the pool's ``poll``) reports
        each one as ``unstarted``: the service puts it back in the queue, its attempt not
        counted, or ends it cancelled."""
        if job_ids is None:
            if slot.releasing:
                return
            slot.releasing = True
        try:
            assert slot.conn is not None
            slot.conn.send({"op": "release", "job_ids": job_ids})
        except (OSError, AssertionError):
            pass  # the worker is gone: poll() reports its jobs

    @staticmethod
    def released(slot: WorkerSlot, msg: dict[str, Any]) -> list[tuple[str, int]]:
        """The worker's ``released`` answer: the (job id, attempt) it gave back from its queue,
        taken off the slot's jobs."""
        if msg.get("all"):
            slot.releasing = False
        given = {(job_id, attempt) for job_id, attempt in msg["jobs"]}
        if not given:
            return []
        kept: deque[JobEntry] = deque()
        out = []
        for entry in slot.jobs:
            key = (entry.msg["job_id"], entry.msg["attempt"])
            if key in given:
                out.append(key)
            else:
                kept.append(entry)
        slot.jobs = kept
        log.debug("worker %d gave back %d job(s) it had not started", slot.index, len(given))
        return out
