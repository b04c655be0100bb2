"""Worker processes: start, hand out jobs, watch deadlines, end them with TERM then KILL.

The supervisor turns what happens in and to its children into :class:`Outcome` records for
the service: progress, success, failure, and loss of the worker (its exit is seen through
the process sentinel). Timeouts and cancels of running jobs end the child process from
outside, because native code (CTranslate2, FFmpeg) cannot be interrupted from inside
(docs/topics.md, "States").
"""

from __future__ import annotations

import logging
import select
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from edge_queue.component import Component
from edge_queue.config.settings import Settings
from edge_queue.errors import ErrorCode

from .lane import ShortLane, warm
from .prefetch import OVERRUN_S, Prefetch
from .processes import JobEntry, ProcessPool, WorkerSlot

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Outcome:
    """One thing the service must act on.

    ``op`` is ``progress`` (``data``: progress, stage, eta_s), ``chunk`` (``data``: index, data),
    ``outputs`` (``data``: files, path -> identity; the service sets ``recorded``, and
    :meth:`Supervisor.dispatch` answers the worker after the commit), ``done`` (``data``: result),
    ``failed`` (``data``: code, message, retryable), ``lost`` (the worker died during the
    attempt; ``data``: code ``worker_lost``, ``timeout`` or ``cancelled``, message),
    ``unstarted`` (a job the worker had not started: it died, or gave the job back when asked;
    ``data``: reason) or ``started`` (a job waiting in a worker's queue became the one it runs).
    """

    op: str
    job_id: str
    attempt: int
    data: dict[str, Any] = field(default_factory=dict)


def answer_claims(slots: list[WorkerSlot], claims: list[Outcome]) -> list[Outcome]:
    """Answer each worker's ``outputs`` the service has decided on (``data["recorded"]`` set,
    after the commit that recorded them) with ``outputs_ok``; returns those not decided yet (a
    turn whose commit failed applies them again)."""
    waiting = []
    for claim in claims:
        if "recorded" not in claim.data:
            waiting.append(claim)
            continue
        for slot in slots:
            if slot.job is not None and slot.job["job_id"] == claim.job_id and slot.conn is not None:
                answer = {"op": "outputs_ok", "job_id": claim.job_id, "attempt": claim.attempt}
                try:
                    slot.conn.send({**answer, "ok": claim.data["recorded"] is True})
                except OSError:
                    pass  # the worker is gone: poll() reports its job as lost
    return waiting


def fresh_size_said(limit: int, rss_mb: Any) -> bool:
    """A worker just started takes ``rss_mb``: a ``max_worker_rss_mb`` (``limit``) below it would
    replace the worker after every job (each job paying a worker start). Says so, and returns
    True, when it is so."""
    if not (limit and isinstance(rss_mb, (int, float)) and rss_mb >= limit):
        return False
    log.warning(
        "max_worker_rss_mb is %d MiB, but a worker just started takes %.0f MiB: every job would be "
        "followed by a new worker; raise it well above that (and above a loaded model's size)",
        limit,
        rss_mb,
    )
    return True


def recycle_reason(s: Settings, slot: WorkerSlot, *, cancelled: bool) -> str | None:
    """Why a worker that just finished a job should be replaced (``max_jobs_per_worker`` and
    ``max_worker_rss_mb`` of docs/configuration.md), or None."""
    if cancelled:
        return "its job was cancelled mid-way (a fresh process runs the next job)"
    if s.max_jobs_per_worker and slot.jobs_done >= s.max_jobs_per_worker:
        return f"{slot.jobs_done} jobs done (max_jobs_per_worker {s.max_jobs_per_worker})"
    if s.max_worker_rss_mb and slot.rss_mb and slot.rss_mb > s.max_worker_rss_mb:
        return f"resident memory {slot.rss_mb:.0f} MiB > max_worker_rss_mb {s.max_worker_rss_mb}"
    return None


#: Seconds to wait, after an end of file on a worker's pipe, for the worker's exit: a dead
#: worker is reported with its exit code, a live one as having closed its pipe.
EOF_EXIT_WAIT_S = 0.1


class Supervisor(Component):
    """A fixed pool of ``settings.workers`` worker processes.

    Workers are forked by multiprocessing's ``forkserver``: one clean process, started with
    the first worker, that has imported the worker's modules (no model, no store, no broker
    connection) and forks each new worker from itself. A fresh worker then costs a fork (a few
    milliseconds of CPU) instead of a new interpreter importing everything (about 0.6 s of CPU
    with ``spawn``), which matters for ``max_jobs_per_worker`` recycling under many short jobs
    and for the replacement of a lost worker. The forkserver ends when the service does.

    Jobs of a kind whose attempts take less than :data:`~.prefetch.FAST_S` on average (measured
    here) may be given to a busy worker, up to :meth:`.Prefetch.per_worker` at once
    (:data:`~.prefetch.PREFETCH` jobs, and about :data:`~.prefetch.PREFETCH_S` seconds of their
    work), so that many short jobs cost one message and one loop turn instead of one each; any
    other job goes only to an idle worker.
    A job's ``timeout_s`` counts from when its worker starts it.

    Args:
        settings: passed to each child.
        clock: monotonic seconds; injectable so deadlines can be tested without sleeping.
    """

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.monotonic, *, lane: bool = False) -> None:
        self.settings = settings
        self.said_fresh_size = False  # max_worker_rss_mb below a fresh worker's size was said
        self.clock = clock
        self.processes = ProcessPool(settings, clock)
        self.slots = [WorkerSlot(i) for i in range(settings.workers)]
        if lane and settings.workers and settings.short_lane_s:  # the short lane: one slot more
            self.slots.append(WorkerSlot(settings.workers, lane=True))
        self.lane = ShortLane()
        self.prefetch = Prefetch(settings, clock)  # short jobs handed to busy workers
        self._claims: list[Outcome] = []  # workers' ``outputs``, answered by dispatch() after the commit

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        for slot in self.slots:
            self.processes.spawn(slot)

    def stop(self, timeout_s: float = 5.0) -> None:
        """End every worker: one still running a job (past the grace period, whose end the
        caller waited for) is ended at once, SIGTERM then SIGKILL after ``KILL_AFTER_S``;
        an idle one is asked to stop and given up to ``timeout_s`` seconds. Waits for them,
        and for the workers already on their way out."""
        self.lane.resume()  # a stopped worker ends only once continued
        for slot in self.slots:
            if slot.jobs and slot.process is not None:
                self.processes.end(slot, wait=True)
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
                self.processes.end(slot, wait=True)
        self.processes.finish_dying()

    # -- scheduling ---------------------------------------------------------------------

    def idle(self) -> list[WorkerSlot]:
        """Workers with no job (and not waiting to be replaced); not the short lane's."""
        return [s for s in self.slots if not s.lane and not s.jobs and s.process is not None and s.recycle is None]

    def lane_idle(self) -> list[WorkerSlot]:
        """The short lane's worker, when it has no job (docs/configuration.md, ``short_lane_s``)."""
        return [s for s in self.slots if s.lane and not s.jobs and s.process is not None and s.recycle is None]

    def busy_by_kind(self) -> Counter[str]:
        return Counter(e.msg["kind"] for s in self.slots for e in s.jobs)

    def worker_pids(self) -> dict[str, int | None]:
        """job id -> pid of the worker running it (or holding it next)."""
        return {e.msg["job_id"]: s.pid for s in self.slots for e in s.jobs}

    def running_job_ids(self) -> set[str]:
        return {e.msg["job_id"] for s in self.slots for e in s.jobs}

    def alive(self) -> int:
        """Workers up (of ``workers``; the short lane's is not counted)."""
        return sum(1 for s in self.slots if not s.lane and s.process is not None and s.process.is_alive())

    def assign(self, slot: WorkerSlot, job: dict[str, Any], output_dir: str, timeout_s: float | None) -> None:
        """Give a claimed job to a worker. It is sent by :meth:`dispatch`, after the claim is
        committed; :meth:`unassign` takes back what was not sent (the commit failed)."""
        msg = {k: job[k] for k in ("job_id", "attempt", "kind", "input", "options")}
        msg["output_dir"] = output_dir
        if slot.lane:  # the worker gives it back when its input is longer
            msg["within_s"] = self.settings.short_lane_s
        else:
            self.lane.handed_to_worker(job["job_id"])
        # the chunks earlier attempts finished (Store.kept_chunks), the files they wrote (output_files)
        msg.update({k: job[k] for k in ("kept", "written") if job.get(k)})
        entry = JobEntry(msg, timeout_s)
        if not slot.jobs:
            entry.started = self.clock()
        slot.jobs.append(entry)
        slot.unsent.append(entry)

    def dispatch(self) -> None:
        """Send every job assigned since the last call, one message per worker, and the
        answers to ``outputs`` the service decided (:func:`answer_claims`)."""
        self._claims = answer_claims(self.slots, self._claims)
        for slot in self.slots:
            if not slot.unsent:
                continue
            jobs = [e.msg for e in slot.unsent]
            slot.unsent.clear()
            try:
                assert slot.conn is not None
                slot.conn.send({"op": "run", "jobs": jobs})
            except (OSError, AssertionError):
                pass  # the worker is gone: poll() reports its jobs as lost
        warm(self.slots, self.settings.voice_dir)

    def committed(self) -> None:
        self.dispatch()

    def turn_failed(self, *, disk_full: bool) -> None:
        self.unassign()

    def wait_s(self, now: float) -> float | None:
        return self.next_deadline()

    def unassign(self) -> None:
        """Forget jobs assigned but not sent (their claims were rolled back)."""
        for slot in self.slots:
            for entry in slot.unsent:
                slot.jobs.remove(entry)
            slot.unsent.clear()

    def cancel(self, job_id: str, grace_s: float) -> bool:
        """Ask the worker holding ``job_id`` to stop it; a worker still running it ``grace_s``
        seconds after it started it (or after now, if it runs it already) is ended.

        Returns False when no worker holds that job.
        """
        for slot in self.slots:
            for entry in slot.jobs:
                if entry.msg["job_id"] == job_id:
                    if entry.cancel_at is None:
                        entry.cancel_at, entry.cancel_grace_s = self.clock(), grace_s
                        try:
                            assert slot.conn is not None
                            slot.conn.send({"op": "cancel", "job_id": job_id})
                        except (OSError, AssertionError):
                            pass
                        if entry is not slot.jobs[0]:
                            # waiting in the worker's queue: given back at once, it ends
                            # cancelled without waiting for the jobs before it
                            self.prefetch.release(slot, [job_id])
                    return True
        return False

    # -- events -------------------------------------------------------------------------

    def wait_handles(self) -> list[Any]:
        """The workers' pipes and process sentinels: what the service's loop waits on."""
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
            if slot.process is None and slot.respawn_at is not None and self.clock() >= slot.respawn_at:
                self.processes.spawn(slot)
        ready = self._ready()
        for slot in self.slots:
            conn = slot.conn
            try:
                # select() with no wait: Connection.poll builds a selector on every call
                if conn is not None and (ready is None or conn in ready):
                    while select.select([conn], [], [], 0)[0]:
                        msg = conn.recv()
                        for one in msg if isinstance(msg, list) else (msg,):
                            self._handle(slot, one, out)
                        if slot.conn is not conn:
                            break  # the worker was replaced: its successor is read next turn
            except (EOFError, OSError) as e:
                if slot.conn is conn and slot.process is not None:
                    slot.process.join(EOF_EXIT_WAIT_S)  # a worker that died closed its pipe too
                    if slot.process.is_alive():
                        self._pipe_closed(slot, e, out)
                    else:
                        self._lost(slot, out)
                continue
            proc = slot.process
            if proc is not None and (ready is None or proc.sentinel in ready) and not proc.is_alive():
                self._lost(slot, out)
        self._deadlines(out)
        self.processes.reap()
        return out

    def _ready(self) -> set[Any] | None:
        """The workers' pipes with messages and the process sentinels of workers that ended,
        with one ``select`` (no wait) for all; None when that ``select`` fails (a handle
        closed meanwhile): then every pipe is read and every process checked."""
        try:
            return set(select.select(self.wait_handles(), [], [], 0)[0])
        except (OSError, ValueError):
            return None

    def _handle(self, slot: WorkerSlot, msg: dict[str, Any], out: list[Outcome]) -> None:
        op = msg.get("op")
        if op == "log":
            logging.getLogger(msg["name"]).log(msg["level"], "[worker %d] %s", slot.index, msg["message"])
            return
        if op == "ready":
            if not self.said_fresh_size:
                self.said_fresh_size = fresh_size_said(self.settings.max_worker_rss_mb, msg.get("rss_mb"))
            if self.settings.wyoming.enabled and not slot.lane and slot.conn is not None:
                try:  # a voice command's model loaded now, not when the first command waits for it
                    slot.conn.send({"op": "warm_voice"})
                except OSError:
                    pass  # the worker is gone: its replacement is asked
            return
        if op == "released":  # jobs it gave back from its queue: each is ``unstarted``
            for job_id, attempt in self.prefetch.released(slot, msg):
                out.append(
                    Outcome("unstarted", job_id, attempt, {"reason": "its worker gave it back before starting it"})
                )
            return
        head = slot.jobs[0] if slot.jobs else None
        if head is None or msg.get("job_id") != head.msg["job_id"] or msg.get("attempt") != head.msg["attempt"]:
            log.warning("worker %d: message for a job it does not run: %s", slot.index, op)
            return
        job = head.msg
        data = {k: v for k, v in msg.items() if k not in ("op", "job_id", "attempt", "rss_mb", "took_s")}
        out.append(outcome := Outcome(str(op), job["job_id"], job["attempt"], data))
        if op == "outputs":
            self._claims.append(outcome)
        if op == "unstarted":  # the short lane gave back a job whose input is longer than it takes
            self.lane.gave_back(job["job_id"])
        if op in ("done", "failed", "unstarted"):
            now = self.clock()
            took = msg.get("took_s")
            if isinstance(took, float) and op != "unstarted":
                self.prefetch.took(job["kind"], took)
            slot.jobs.popleft()
            if slot.jobs:
                nxt = slot.jobs[0]
                nxt.started = now
                out.append(Outcome("started", nxt.msg["job_id"], nxt.msg["attempt"], {}))
            slot.jobs_done += 1
            slot.rss_mb = msg.get("rss_mb")
            reason = recycle_reason(self.settings, slot, cancelled=data.get("code") == ErrorCode.CANCELLED)
            if reason and slot.recycle is None:
                slot.recycle = reason
            if slot.recycle is not None and not slot.jobs:
                log.info("worker %d (pid %s) recycled: %s", slot.index, slot.pid, slot.recycle)
                self.processes.end(slot, polite=True)
                self.processes.spawn(slot)

    def _lost(self, slot: WorkerSlot, out: list[Outcome]) -> None:
        """The worker is gone: its current job is ``lost``, the jobs it had not started are
        ``unstarted`` (they go back to the queue without losing an attempt)."""
        proc = slot.process
        code = proc.exitcode if proc is not None else None
        if slot.jobs:
            head = slot.jobs.popleft()
            reason = slot.end_reason or (str(ErrorCode.WORKER_LOST), f"the worker process died (exit code {code})")
            data = {"code": reason[0], "message": reason[1]}
            out.append(Outcome("lost", head.msg["job_id"], head.msg["attempt"], data))
            log.warning(
                "worker %d (pid %s) ended during job %s: %s", slot.index, slot.pid, head.msg["job_id"], reason[1]
            )
            for entry in slot.jobs:
                out.append(
                    Outcome(
                        "unstarted",
                        entry.msg["job_id"],
                        entry.msg["attempt"],
                        {"reason": "its worker ended before it started"},
                    )
                )
        else:
            log.warning("worker %d (pid %s) exited with code %s while idle", slot.index, slot.pid, code)
        self.processes.end(slot)
        self.processes.spawn(slot)

    def _pipe_closed(self, slot: WorkerSlot, error: BaseException, out: list[Outcome]) -> None:
        """The worker's pipe gave an end of file (or an error) while the process may still
        live: a plug-in kind can close or shut down the worker's file descriptors. The worker
        can no longer report, so this is one worker death (its job ``lost``, once): the
        process is ended, its slot refilled, and the pipe is never read again."""
        if slot.end_reason is None:
            what = "an end of file" if isinstance(error, EOFError) else f"an error ({error})"
            slot.end_reason = (str(ErrorCode.WORKER_LOST), f"the worker closed its pipe to the service ({what})")
        self.processes.end(slot)
        self._lost(slot, out)

    def _deadlines(self, out: list[Outcome]) -> None:
        now = self.clock()
        self.lane.turn(self.slots, now, OVERRUN_S)
        for slot in self.slots:
            if not slot.jobs or slot.process is None:
                continue
            head = slot.jobs[0]
            if head.started is None:
                head.started = now
            if len(slot.jobs) > 1 and not slot.releasing and now - head.started >= OVERRUN_S:
                self.prefetch.release(slot)
            cancel_at = head.cancel_deadline
            if cancel_at is not None and now >= cancel_at:
                slot.end_reason = (str(ErrorCode.CANCELLED), "cancelled: the worker was ended after the grace period")
            elif slot.deadline is not None and now >= slot.deadline:
                slot.end_reason = (str(ErrorCode.TIMEOUT), "the attempt passed its timeout_s")
            else:
                continue
            self.processes.end(slot)
            self._lost(slot, out)

    def next_deadline(self) -> float | None:
        """Seconds until the nearest timeout or cancel deadline, or ``None``."""
        times: list[float] = [s.respawn_at for s in self.slots if s.respawn_at is not None]
        times += [d.kill_at if d.term_at is None else d.term_at for d in self.processes.dying if not d.killed]
        if (resume_at := self.lane.next_time()) is not None:
            times.append(resume_at)
        for s in self.slots:
            if s.jobs:
                head = s.jobs[0]
                if s.deadline is not None:
                    times.append(s.deadline)
                if head.cancel_deadline is not None:
                    times.append(head.cancel_deadline)
        return max(0.0, min(times) - self.clock()) if times else None
