"""Worker processes themselves: forked, signalled and reaped (docs/operations.md).

:class:`ProcessPool` starts a slot's worker (multiprocessing's ``forkserver``), ends one (at
once, or asking first), and reaps the workers on their way out without the loop waiting for
them: SIGTERM, then SIGKILL after :data:`KILL_AFTER_S`. What the workers are given and what
they report is :mod:`.supervisor`'s.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from typing import Any

from edge_queue.config.settings import Settings

from . import worker as worker_module

log = logging.getLogger(__name__)

#: Seconds between SIGTERM and SIGKILL when a worker must end.
KILL_AFTER_S = 2.0
#: Longest wait before another try to start a worker whose start failed.
RESPAWN_MAX_S = 5.0
#: What a terminal sends its whole foreground process group (Ctrl-C, Ctrl-\). They are the
#: service's to handle (a graceful stop); its children never take them as their own.
TERMINAL_SIGNALS = frozenset({signal.SIGINT, signal.SIGQUIT})


@contextmanager
def terminal_signals_blocked() -> Iterator[None]:
    """Block :data:`TERMINAL_SIGNALS` in the calling thread for the ``with`` block.

    A process started meanwhile inherits the block through ``fork`` and ``exec`` (POSIX keeps
    the signal mask): multiprocessing's forkserver and resource tracker, started with the
    first worker, hold it for life, from the first instruction (a Ctrl-C while the forkserver
    was still importing used to kill it, and with it the workers), and so does every worker
    the forkserver forks. A signal that arrives meanwhile stays pending for the service and is
    handled when the block ends."""
    # multiprocessing starts its resource tracker first, and unblocks SIGINT and SIGTERM once
    # that is done (resource_tracker.ensure_running): started here beforehand, it is left alone
    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, TERMINAL_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@dataclass(slots=True)
class JobEntry:
    """A job given to a worker: ``msg`` as sent; times are monotonic seconds."""

    msg: dict[str, Any]
    timeout_s: float | None
    started: float | None = None  # when it became the worker's current job
    cancel_at: float | None = None  # when a cancel was asked for
    cancel_grace_s: float = 0.0

    @property
    def cancel_deadline(self) -> float | None:
        """End of the cancel grace period: it counts from the cancel, or from the start of a
        job cancelled before its worker got to it."""
        if self.cancel_at is None:
            return None
        return max(self.cancel_at, self.started if self.started is not None else self.cancel_at) + self.cancel_grace_s


@dataclass(slots=True)
class WorkerSlot:
    """One place in the pool: its worker process (``None`` while none runs), the pipe to it,
    and the jobs given to it."""

    index: int
    #: the short lane's slot (:meth:`Supervisor.lane_idle`): transcriptions of short inputs only
    lane: bool = False
    #: the short lane's worker was asked to load its model before its first job (:func:`.lane.warm`)
    warmed: bool = False
    process: Any = None
    conn: Connection | None = None
    #: Jobs given to this worker, in the order it runs them; the first is the one it runs now.
    jobs: deque[JobEntry] = field(default_factory=deque)
    #: Jobs assigned this turn, sent by :meth:`Supervisor.dispatch` after the commit.
    unsent: list[JobEntry] = field(default_factory=list)
    end_reason: tuple[str, str] | None = None  # (code, message) when we ended it on purpose
    recycle: str | None = None  # why to replace the worker once its jobs are done
    #: a ``release`` of all its waiting jobs was asked for and not yet answered
    releasing: bool = False
    jobs_done: int = 0
    rss_mb: float | None = None
    pid: int | None = None
    #: when to try again to start this worker (monotonic), after a start failed
    respawn_at: float | None = None
    start_failures: int = 0

    @property
    def job(self) -> dict[str, Any] | None:
        """The job the worker runs now, or ``None``."""
        return self.jobs[0].msg if self.jobs else None

    @property
    def deadline(self) -> float | None:
        head = self.jobs[0] if self.jobs else None
        if head is None or head.timeout_s is None or head.started is None:
            return None
        return head.started + head.timeout_s


@dataclass(slots=True)
class Dying:
    """A worker process on its way out, no longer in a slot: the loop does not wait for it.
    Times are monotonic seconds."""

    process: Any
    pid: int | None
    #: when to send SIGTERM (a worker asked to stop gets :data:`KILL_AFTER_S` to exit by
    #: itself); None once it was sent
    term_at: float | None
    #: when to send SIGKILL (:data:`KILL_AFTER_S` after SIGTERM)
    kill_at: float
    killed: bool = False


class ProcessPool:
    """Starts, ends and reaps worker processes.

    Workers are forked by multiprocessing's ``forkserver``: one clean process, started with
    the first worker, that has imported the worker's modules (no model, no store, no broker
    connection) and forks each new worker from itself.

    Args:
        settings: passed to each child.
        clock: monotonic seconds.
    """

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload([worker_module.__name__, f"{__package__}.kinds"])
        #: workers on their way out, no longer in a slot
        self.dying: list[Dying] = []

    def spawn(self, slot: WorkerSlot) -> None:
        """Start the slot's worker. A start that fails (the forkserver died with the workers and
        has not been reaped yet, so multiprocessing still connects to its closed socket; no
        process or file left) leaves the slot empty and tries again on a later turn, after
        0.1 s, doubling up to :data:`RESPAWN_MAX_S`: the service goes on, its jobs wait."""
        slot.jobs.clear()
        slot.unsent.clear()
        slot.end_reason = slot.recycle = None
        slot.releasing = False
        slot.jobs_done, slot.rss_mb = 0, None
        slot.warmed = False
        parent, child = self.ctx.Pipe(duplex=True)
        proc = self.ctx.Process(
            target=worker_module.main, args=(child, self.settings), name=f"edge-queue-worker-{slot.index}", daemon=True
        )
        try:
            with terminal_signals_blocked():
                proc.start()
        except (OSError, EOFError) as e:
            parent.close()
            child.close()
            delay = min(RESPAWN_MAX_S, 0.1 * 2**slot.start_failures)
            slot.start_failures += 1
            slot.respawn_at = self.clock() + delay
            slot.process = slot.conn = slot.pid = None
            log.warning("worker %d could not be started (%s); trying again in %.1f s", slot.index, e, delay)
            return
        child.close()
        slot.respawn_at, slot.start_failures = None, 0
        slot.process, slot.conn, slot.pid = proc, parent, proc.pid
        log.debug("worker %d started, pid %d", slot.index, proc.pid)

    def end(self, slot: WorkerSlot, *, polite: bool = False, wait: bool = False) -> None:
        """Take the slot's worker out of the slot and end it: at once with SIGTERM, or with
        ``polite`` by asking it to stop (SIGTERM after :data:`KILL_AFTER_S` if it has not),
        then SIGKILL :data:`KILL_AFTER_S` after SIGTERM.

        Without ``wait`` the loop does not wait for it: a process whose signals stay pending
        (stopped, or in uninterruptible sleep on a hung network share) would otherwise hold
        up every other job and request for seconds. It is no longer in the slot, has no pipe
        to us, and a pending SIGTERM ends it before it runs any more of its own code; it is
        signalled and reaped by :meth:`reap`, which the supervisor's poll calls."""
        proc = slot.process
        if proc is None:
            return
        if polite and slot.conn is not None:
            try:
                slot.conn.send({"op": "stop"})
            except OSError:
                polite = False
        if slot.conn is not None:
            slot.conn.close()
        slot.process = slot.conn = None
        if wait:
            if polite:
                proc.join(KILL_AFTER_S)
            self.finish(proc)
            return
        if not proc.is_alive():
            proc.join(0)
            return
        now = self.clock()
        if not polite:
            proc.terminate()
        self.dying.append(
            Dying(
                proc,
                slot.pid,
                term_at=now + KILL_AFTER_S if polite else None,
                kill_at=now + (2 if polite else 1) * KILL_AFTER_S,
            )
        )

    @staticmethod
    def finish(proc: Any) -> None:
        """SIGTERM, then SIGKILL after :data:`KILL_AFTER_S`, waiting for each (shutdown only)."""
        if proc.is_alive():
            proc.terminate()
            proc.join(KILL_AFTER_S)
        if proc.is_alive():
            proc.kill()
            proc.join(KILL_AFTER_S)

    def reap(self) -> None:
        """Signal and reap the workers on their way out (see :meth:`end`), without waiting."""
        if not self.dying:
            return
        now = self.clock()
        left = []
        for d in self.dying:
            if not d.process.is_alive():  # reaped by is_alive
                continue
            if d.term_at is not None:
                if now >= d.term_at:
                    d.process.terminate()
                    d.term_at = None
            elif not d.killed and now >= d.kill_at:
                log.warning("worker pid %s did not end %.0f s after SIGTERM: SIGKILL", d.pid, KILL_AFTER_S)
                d.process.kill()
                d.killed = True
            left.append(d)
        self.dying = left

    def finish_dying(self) -> None:
        """End and wait for every worker on its way out (shutdown only)."""
        for dying in self.dying:
            self.finish(dying.process)
        self.dying.clear()
