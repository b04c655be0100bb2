"""Worker processes: spawn, hand out jobs, watch deadlines, end them with TERM then KILL.

The supervisor turns what happens in and to its children into :class:`Outcome` records for
the service: progress, success, failure, and loss of the worker (its exit is seen through
the process sentinel). Timeouts and cancels of running jobs end the child process from
outside, because native code (CTranslate2, FFmpeg) cannot be interrupted from inside
(PRODUCT 4.5).
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from . import worker as worker_module
from .config import Settings
from .errors import ErrorCode

log = logging.getLogger(__name__)

#: Seconds between SIGTERM and SIGKILL when a worker must end.
KILL_AFTER_S = 2.0


@dataclass(slots=True)
class Outcome:
    """One thing the service must act on.

    ``op`` is ``progress`` (``data``: progress, stage, eta_s), ``done`` (``data``: result),
    ``failed`` (``data``: code, message, retryable) or ``lost`` (the worker died during the
    attempt; ``data``: code ``worker_lost``, ``timeout`` or ``cancelled``, message).
    """

    op: str
    job_id: str
    attempt: int
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class _Slot:
    index: int
    process: Any = None
    conn: Connection | None = None
    job: dict[str, Any] | None = None
    deadline: float | None = None  # monotonic: the attempt's timeout
    cancel_deadline: float | None = None  # monotonic: end of the cancel grace period
    end_reason: tuple[str, str] | None = None  # (code, message) when we ended it on purpose
    jobs_done: int = 0
    rss_mb: float | None = None
    pid: int | None = None


class Supervisor:
    """A fixed pool of ``settings.workers`` worker processes started with ``spawn``.

    Args:
        settings: passed to each child.
        clock: monotonic seconds; injectable so deadlines can be tested without sleeping.
    """

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self._ctx = multiprocessing.get_context("spawn")
        self.slots = [_Slot(i) for i in range(settings.workers)]

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        for slot in self.slots:
            self._spawn(slot)

    def _spawn(self, slot: _Slot) -> None:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=worker_module.main, args=(child, self.settings), name=f"edge-queue-worker-{slot.index}", daemon=True
        )
        proc.start()
        child.close()
        slot.process, slot.conn, slot.pid = proc, parent, proc.pid
        slot.job = slot.deadline = slot.cancel_deadline = slot.end_reason = None
        slot.jobs_done, slot.rss_mb = 0, None
        log.debug("worker %d started, pid %d", slot.index, proc.pid)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask every worker to stop, wait up to ``timeout_s``, then TERM and KILL the rest."""
        for slot in self.slots:
            if slot.conn is not None:
                try:
                    slot.conn.send({"op": "stop"})
                except OSError:
                    pass
        end = time.monotonic() + timeout_s
        for slot in self.slots:
            if slot.process is not None:
                slot.process.join(max(0.0, end - time.monotonic()))
                self._end(slot)

    def _end(self, slot: _Slot, *, polite: bool = False) -> None:
        proc = slot.process
        if proc is None:
            return
        if polite and slot.conn is not None:
            try:
                slot.conn.send({"op": "stop"})
                proc.join(KILL_AFTER_S)
            except OSError:
                pass
        if proc.is_alive():
            proc.terminate()
            proc.join(KILL_AFTER_S)
        if proc.is_alive():
            proc.kill()
            proc.join(KILL_AFTER_S)
        if slot.conn is not None:
            slot.conn.close()
        slot.process = slot.conn = None

    # -- scheduling ---------------------------------------------------------------------

    def idle(self) -> list[_Slot]:
        return [s for s in self.slots if s.job is None and s.process is not None]

    def busy_by_kind(self) -> Counter[str]:
        return Counter(s.job["kind"] for s in self.slots if s.job is not None)

    def worker_pids(self) -> dict[str, int | None]:
        """job id -> pid of the worker running it."""
        return {s.job["job_id"]: s.pid for s in self.slots if s.job is not None}

    def running_job_ids(self) -> set[str]:
        return {s.job["job_id"] for s in self.slots if s.job is not None}

    def alive(self) -> int:
        return sum(1 for s in self.slots if s.process is not None and s.process.is_alive())

    def assign(self, slot: _Slot, job: dict[str, Any], output_dir: str, timeout_s: float | None) -> None:
        """Send a claimed job to an idle worker; its timeout clock starts now."""
        msg = {k: job[k] for k in ("job_id", "attempt", "kind", "input", "options")}
        msg["output_dir"] = output_dir
        slot.job = msg
        slot.deadline = self.clock() + timeout_s if timeout_s else None
        slot.cancel_deadline = None
        slot.end_reason = None
        assert slot.conn is not None
        slot.conn.send({"op": "run", "job": msg})

    def cancel(self, job_id: str, grace_s: float) -> bool:
        """Ask the worker running ``job_id`` to stop; it is ended after ``grace_s`` seconds.

        Returns False when no worker runs that job.
        """
        for slot in self.slots:
            if slot.job is not None and slot.job["job_id"] == job_id:
                if slot.cancel_deadline is None:
                    slot.cancel_deadline = self.clock() + grace_s
                    try:
                        assert slot.conn is not None
                        slot.conn.send({"op": "cancel", "job_id": job_id})
                    except OSError:
                        pass
                return True
        return False

    # -- events -------------------------------------------------------------------------

    def wait_handles(self) -> list[Any]:
        handles: list[Any] = []
        for s in self.slots:
            if s.conn is not None:
                handles.append(s.conn)
            if s.process is not None:
                handles.append(s.process.sentinel)
        return handles

    def wait(self, extra: Sequence[Any], timeout: float | None) -> list[Any]:
        """Block until a worker message, a worker exit, one of ``extra`` or ``timeout``."""
        return wait([*self.wait_handles(), *extra], timeout)

    def poll(self) -> list[Outcome]:
        """Read every pending worker message, reap dead workers, enforce deadlines."""
        out: list[Outcome] = []
        for slot in self.slots:
            conn = slot.conn
            try:
                while conn is not None and conn.poll():
                    self._handle(slot, conn.recv(), out)
            except (EOFError, OSError):
                pass
            if slot.process is not None and not slot.process.is_alive():
                self._lost(slot, out)
        self._deadlines(out)
        return out

    def _handle(self, slot: _Slot, msg: dict[str, Any], out: list[Outcome]) -> None:
        op = msg.get("op")
        if op == "log":
            logging.getLogger(msg["name"]).log(msg["level"], "[worker %d] %s", slot.index, msg["message"])
            return
        if op == "ready":
            return
        job = slot.job
        if job is None or msg.get("job_id") != job["job_id"] or msg.get("attempt") != job["attempt"]:
            log.warning("worker %d: message for a job it does not run: %s", slot.index, op)
            return
        data = {k: v for k, v in msg.items() if k not in ("op", "job_id", "attempt", "rss_mb")}
        out.append(Outcome(str(op), job["job_id"], job["attempt"], data))
        if op in ("done", "failed"):
            slot.job = slot.deadline = slot.cancel_deadline = None
            slot.jobs_done += 1
            slot.rss_mb = msg.get("rss_mb")
            reason = self._recycle_reason(slot, cancelled=data.get("code") == ErrorCode.CANCELLED)
            if reason:
                log.info("worker %d (pid %s) recycled: %s", slot.index, slot.pid, reason)
                self._end(slot, polite=True)
                self._spawn(slot)

    def _recycle_reason(self, slot: _Slot, *, cancelled: bool) -> str | None:
        """Why a worker that just finished a job should be replaced (PRODUCT 4.8), or None."""
        s = self.settings
        if cancelled:
            return "its job was cancelled mid-way (a fresh process runs the next job)"
        if s.max_jobs_per_worker and slot.jobs_done >= s.max_jobs_per_worker:
            return f"{slot.jobs_done} jobs done (max_jobs_per_worker {s.max_jobs_per_worker})"
        if s.max_worker_rss_mb and slot.rss_mb and slot.rss_mb > s.max_worker_rss_mb:
            return f"resident memory {slot.rss_mb:.0f} MiB > max_worker_rss_mb {s.max_worker_rss_mb}"
        return None

    def _lost(self, slot: _Slot, out: list[Outcome]) -> None:
        proc = slot.process
        code = proc.exitcode if proc is not None else None
        if slot.job is not None:
            reason = slot.end_reason or (str(ErrorCode.WORKER_LOST), f"the worker process died (exit code {code})")
            out.append(
                Outcome("lost", slot.job["job_id"], slot.job["attempt"], {"code": reason[0], "message": reason[1]})
            )
            log.warning(
                "worker %d (pid %s) ended during job %s: %s", slot.index, slot.pid, slot.job["job_id"], reason[1]
            )
        else:
            log.warning("worker %d (pid %s) exited with code %s while idle", slot.index, slot.pid, code)
        self._end(slot)
        self._spawn(slot)

    def _deadlines(self, out: list[Outcome]) -> None:
        now = self.clock()
        for slot in self.slots:
            if slot.job is None or slot.process is None:
                continue
            if slot.cancel_deadline is not None and now >= slot.cancel_deadline:
                slot.end_reason = (str(ErrorCode.CANCELLED), "cancelled: the worker was ended after the grace period")
            elif slot.deadline is not None and now >= slot.deadline:
                slot.end_reason = (str(ErrorCode.TIMEOUT), "the attempt passed its timeout_s")
            else:
                continue
            self._end(slot)
            self._lost(slot, out)

    def next_deadline(self) -> float | None:
        """Seconds until the nearest timeout or cancel deadline, or ``None``."""
        times = [t for s in self.slots if s.job is not None for t in (s.deadline, s.cancel_deadline) if t is not None]
        return max(0.0, min(times) - self.clock()) if times else None
