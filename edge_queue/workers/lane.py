"""The short lane (docs/configuration.md, ``short_lane_s``): one worker process more, for
transcriptions of short inputs (``/detect-language``, voice messages, clips), which it takes
only while every other worker is busy, so that they never wait behind a film's chunks.

- The lane's worker is handed a job with ``within_s``; it gives back, unstarted, a job whose
  input declares more seconds than that (:func:`~.worker.fits_lane`), and the lane passes over that job
  from then on (:attr:`ShortLane.long_jobs`): it waits for a worker, its attempt not counted.
- While the lane runs a job, the workers whose job has run :data:`~.prefetch.OVERRUN_S` or
  more (a film) are stopped (``SIGSTOP``) and continued (``SIGCONT``) when the lane's job ends,
  at most :data:`PAUSE_S` later, and not stopped again for as long as they were: the short
  job has the box's cores, the film loses only that time (at most half of its time under a
  stream of short jobs), and memory stays that of the processes there are.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

from .processes import WorkerSlot

log = logging.getLogger(__name__)

#: Jobs the lane gave back remembered at most (the oldest forgotten first): each one is passed
#: over by the lane's claims, one SQL parameter each.
LONG_JOBS_KEPT = 500
#: Seconds a long job's worker is stopped for the lane, at most, whatever the lane's job takes.
PAUSE_S = 30.0


def to_pause(
    slots: Iterable[WorkerSlot], now: float, overrun_s: float, locking: Collection[int] = ()
) -> list[WorkerSlot]:
    """The workers to stop while the lane runs a job: not the lane's, alive, running a job that
    started ``overrun_s`` seconds or more before ``now`` (monotonic seconds), and not holding a
    file lock (their pids not in ``locking``, :func:`holding_locks`): a worker making a model's
    int8 copy or joining the bundled base holds the models folder's lock, which the lane's job
    may wait for (``kinds/int8_models.py``, ``kinds/bundled.py``)."""
    return [
        s
        for s in slots
        if not s.lane
        and s.process is not None
        and s.pid is not None
        and s.pid not in locking
        and s.jobs
        and s.jobs[0].started is not None
        and now - s.jobs[0].started >= overrun_s
    ]


def holding_locks(table: str = "/proc/locks") -> set[int]:
    """The pids of the processes that hold a file lock (``flock`` or POSIX), from Linux's
    ``/proc/locks`` (lines ``1: FLOCK  ADVISORY  WRITE <pid> <dev:inode> 0 EOF``; a waiter's
    line has ``->`` and holds nothing). Empty where the table cannot be read."""
    try:
        with open(table) as fh:
            lines = fh.read().splitlines()
    except OSError:
        return set()
    pids = set()
    for line in lines:
        fields = line.split()
        if len(fields) >= 5 and fields[1] != "->" and fields[4].isdigit():
            pids.add(int(fields[4]))
    return pids


def warm(slots: Iterable[WorkerSlot], voice_dir: Path | None = None) -> None:
    """Once a transcription runs on a worker (the lane may be needed from then on), ask the
    lane's worker, once per process, to load the model a transcription loads first (``warm``),
    so that a short job beside a film does not wait for it (docs/configuration.md,
    ``short_lane_s``).

    A voice command's transcription (its input in ``voice_dir``, ``Settings.voice_dir``) does
    not count: it ends in seconds, and the lane's loading beside it took the cores the
    commands after it decode on (2-3 s of CPU, base and tiny.en; more the first time, when
    base's int8 copy is made), for a film that may never come."""
    slots = list(slots)
    if not any(not s.lane and any(may_need_lane(e.msg, voice_dir) for e in s.jobs) for s in slots):
        return
    for s in slots:
        if s.lane and not s.warmed and s.conn is not None:
            try:
                s.conn.send({"op": "warm"})
            except OSError:
                continue  # the worker is gone: its replacement is asked
            s.warmed = True


def may_need_lane(msg: dict[str, Any], voice_dir: Path | None) -> bool:
    """True for a job message (``kind``, ``input``) of a transcription that may hold its worker
    long: any but a voice command's (its input in ``voice_dir``)."""
    if msg.get("kind") != "transcribe":
        return False
    text = msg.get("input")
    return voice_dir is None or not (isinstance(text, str) and text.startswith(f"{voice_dir}/"))


class ShortLane:
    """The short lane's state in the supervisor: the jobs it gave back, the workers it stopped."""

    def __init__(self) -> None:
        #: job ids the lane's worker gave back as too long, oldest first
        self.long_jobs: dict[str, None] = {}
        #: pid -> worker index of the workers stopped for the lane's current job
        self.stopped: dict[int, int] = {}
        self.paused_for: str | None = None  # the lane's job they were stopped for
        self.paused_at = 0.0
        self.stopped_at = 0.0  # when the first of them was stopped
        #: no worker is stopped again before this (monotonic): as long as they were stopped
        #: last, so that a stream of short jobs takes at most half of a film's time
        self.quiet_until = 0.0

    def gave_back(self, job_id: str) -> None:
        self.long_jobs[job_id] = None
        while len(self.long_jobs) > LONG_JOBS_KEPT:
            del self.long_jobs[next(iter(self.long_jobs))]

    def handed_to_worker(self, job_id: str) -> None:
        self.long_jobs.pop(job_id, None)

    def turn(self, slots: list[WorkerSlot], now: float, overrun_s: float) -> None:
        """While the lane's worker runs a job, stop the workers :func:`to_pause` names (at
        each turn: a job may pass ``overrun_s`` meanwhile); continue them when it has none
        (ended, given back, lost), or :data:`PAUSE_S` after its job started."""
        lane = next((s for s in slots if s.lane), None)
        job = lane.job if lane is not None and lane.process is not None else None
        if job is None:
            self.resume(now)
            self.paused_for = None
            return
        if job["job_id"] != self.paused_for:
            self.resume(now)
            self.paused_for, self.paused_at = job["job_id"], now
        if now - self.paused_at >= PAUSE_S:
            self.resume(now)
            return
        if now < self.quiet_until:
            return
        candidates = to_pause(slots, now, overrun_s)
        for slot in to_pause(candidates, now, overrun_s, holding_locks()) if candidates else ():
            assert slot.pid is not None
            if slot.pid not in self.stopped and _signal(slot.pid, signal.SIGSTOP):
                self.stopped_at = self.stopped_at if self.stopped else now
                self.stopped[slot.pid] = slot.index
                log.debug("worker %d stopped while the short lane runs job %s", slot.index, job["job_id"])

    def resume(self, now: float | None = None) -> None:
        """Continue every worker stopped for the lane (also before the pool stops); none is
        stopped again until as long after ``now`` as they were stopped."""
        if self.stopped and now is not None:
            self.quiet_until = now + (now - self.stopped_at)
        for pid in self.stopped:
            _signal(pid, signal.SIGCONT)
        self.stopped.clear()

    def next_time(self) -> float | None:
        """When :meth:`turn` must run at the latest (monotonic), while workers are stopped."""
        return self.paused_at + PAUSE_S if self.stopped else None


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True
