"""Where what a worker reported (or its death) becomes a job's state: the one place
(STYLE.md, principle 5). The rules are :mod:`.lifecycle`'s; this module reads the job,
applies the step with ``Store.transition`` (fenced by attempt), logs it and publishes it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from edge_queue.component import Component
from edge_queue.errors import ErrorCode, NotFoundError
from edge_queue.publish.publisher import Publisher
from edge_queue.rules import lifecycle
from edge_queue.rules.limits import DiskGuard
from edge_queue.rules.rates import RejectionLog
from edge_queue.store import Store
from edge_queue.workers.supervisor import Outcome
from edge_queue.written import valid_identity

log = logging.getLogger(__name__)


class Outcomes(Component):
    """Applies a turn's worker outcomes to the store, in order: a part of the loop's turn
    that polls its ``sources`` (the local workers, the worker nodes) and applies what they
    reported; the outcomes of a turn whose commit failed are applied again in the next
    (progress reports excepted).

    Args:
        store: returns the open store.
        publisher: publishes each changed job; throttles progress.
        crash_loop_limit: worker deaths in a row that end a job ``failed: crash_loop``.
        backoff: seconds before the retry of a failed attempt number (full jitter).
        sources: called each turn, each returns the outcomes reported since the last call.
    """

    def __init__(
        self,
        store: Callable[[], Store],
        publisher: Publisher,
        disk: DiskGuard | None = None,
        *,
        crash_loop_limit: int,
        backoff: Callable[[int], float],
        sources: tuple[Callable[[], list[Outcome]], ...] = (),
    ) -> None:
        self.sources = sources
        self.pending: list[Outcome] = []  # this turn's, until it commits or fails
        self.carried: list[Outcome] = []  # a failed turn's, applied in the next
        self.store, self.publisher, self.disk = store, publisher, disk
        self.crash_loop_limit, self.backoff = crash_loop_limit, backoff
        #: set by the service once it stops: a worker lost from then on was ended by the stop
        #: (its job is treated as :meth:`graceful_stop` treats it; no attempt counts)
        self.stopping = False
        self.unkept = RejectionLog("chunk(s) not kept", logging.WARNING, log)

    def wait_s(self, now: float) -> float | None:
        """Soon after a failed commit: its outcomes are applied again."""
        return 0.05 if self.carried else None

    def turn(self, now: float) -> None:
        """Apply the outcomes carried from a failed turn and those the sources report now."""
        self.pending = self.carried + [outcome for source in self.sources for outcome in source()]
        self.carried = []
        self.apply_all(self.pending, now)

    def committed(self) -> None:
        self.pending = []

    def turn_failed(self, *, disk_full: bool) -> None:
        # (when the turn failed before this part's turn, nothing was polled: carried stays)
        self.carried, self.pending = self.carried + [o for o in self.pending if o.op != "progress"], []

    def apply_all(self, outcomes: list[Outcome], now: float) -> None:
        """:meth:`apply` for each of a turn's outcomes, in order; each run of successes and
        starts (many short jobs) is stored at once (``Store.succeed_many``). A start whose
        job succeeded in the same run is stored with the success. ``now``: Unix seconds."""
        run: list[Outcome] = []
        for outcome in outcomes:
            if outcome.op in ("done", "started"):
                run.append(outcome)
                continue
            self.successes(run, now)
            run = []
            self.apply(outcome, now)
        self.successes(run, now)

    def successes(self, run: list[Outcome], now: float) -> None:
        if not run:
            return
        store = self.store()
        reports = [(o.job_id, o.attempt, o.data.get("result")) for o in run if o.op == "done"]
        finished = {(job_id, attempt) for job_id, attempt, _ in reports}
        store.mark_started_many(
            [(o.job_id, o.attempt) for o in run if o.op == "started" and (o.job_id, o.attempt) not in finished], now
        )
        started = [(o.job_id, o.attempt) for o in run if o.op == "started" and (o.job_id, o.attempt) in finished]
        done = store.succeed_many(reports, now, started=[job_id for job_id, _ in started]) if reports else {}
        store.mark_started_many([(job_id, attempt) for job_id, attempt in started if job_id not in done], now)
        others: list[Outcome] = []
        for outcome in run:
            if outcome.op != "done":
                continue
            job = done.get(outcome.job_id)
            if job is None:  # not running on that attempt: the general path decides, below
                others.append(outcome)
                continue
            self.publisher.forget_progress(outcome.job_id)
            log.info("job %s succeeded (attempt %d)", outcome.job_id, outcome.attempt)
            self.publisher.publish_job(job)
        # After the run's successes: their events have the lower ids (succeed_many numbered
        # them), and <base>/events goes out in event_id order (docs/topics.md, "Events").
        for outcome in others:
            self.apply(outcome, now)

    def apply(self, outcome: Outcome, now: float) -> None:
        """Turn what a worker reported (or its death) into the job's next state: the general
        path, which checks the job's state and attempt and explains what it refuses (the usual
        successes are stored by :meth:`apply_all` at once)."""
        store = self.store()
        job_id, attempt, data = outcome.job_id, outcome.attempt, outcome.data
        if outcome.op == "started":  # a job from a worker's queue became its current one
            store.mark_started_many([(job_id, attempt)], now)
            return
        if outcome.op == "progress":
            self.publisher.on_progress(job_id, attempt, data, now)
            return
        if outcome.op == "chunk":
            self.keep_chunk(outcome)
            return
        if outcome.op == "outputs":
            self.record_outputs(outcome)
            return
        self.publisher.forget_progress(job_id)
        try:
            job = store.get(job_id)
        except NotFoundError:
            log.warning("outcome for unknown job %s ignored", job_id)
            return
        if lifecycle.is_stale(job, attempt):
            log.warning(
                "job %s: stale outcome of attempt %d ignored (now attempt %d, %s)",
                job_id,
                attempt,
                job["attempt"],
                job["state"],
            )
            return
        if self.stopping and outcome.op == "lost" and data.get("code") == ErrorCode.WORKER_LOST:
            stop_step = lifecycle.after_graceful_stop(job)
            if stop_step is not None:
                job = store.transition(job_id, stop_step.state, now, detail=stop_step.detail, **stop_step.changes)
                log.log(stop_step.level, "%s (its worker ended during the stop)", stop_step.note)
                self.publisher.publish_job(job)
            return
        step = lifecycle.after_report(
            job, outcome.op, data, now, crash_loop_limit=self.crash_loop_limit, backoff=self.backoff
        )
        job = store.transition(
            job_id, step.state, now, expect_attempt=attempt, current=job, detail=step.detail, **step.changes
        )
        if step.level:
            log.log(step.level, "%s", step.note)
        self.publisher.publish_job(job)

    def keep_chunk(self, outcome: Outcome) -> None:
        """Keep a finished chunk of a running attempt (``data``: ``index``, an int from 0, and
        ``data``, the kind's JSON object), committed with the turn, before the progress that
        follows it is published. A chunk of an attempt that is no longer the job's is dropped."""
        store, index, data = self.store(), outcome.data.get("index"), outcome.data.get("data")
        if type(index) is not int or index < 0 or not isinstance(data, dict):
            log.warning("job %s: a kept chunk without an index or data ignored", outcome.job_id)
            return
        try:
            job = store.get(outcome.job_id)
        except NotFoundError:
            return
        if lifecycle.is_stale(job, outcome.attempt):
            log.info(
                "job %s: chunk %d of attempt %d not kept (now attempt %d, %s)",
                outcome.job_id,
                index,
                outcome.attempt,
                job["attempt"],
                job["state"],
            )
            return
        try:
            store.keep_chunk(outcome.job_id, outcome.attempt, index, data, room=self.room_for_chunk)
        except (TypeError, ValueError) as e:  # not JSON, too large, no room: the job goes on, unkept
            self.unkept.warning("job %s: chunk %d not kept: %s", outcome.job_id, index, e)

    def room_for_chunk(self, size: int) -> str | None:
        """Why a chunk of ``size`` bytes may not be kept for lack of disk space
        (``limits.min_free_disk_mb``, :class:`~edge_queue.rules.limits.DiskGuard`), or None."""
        return None if self.disk is None else self.disk.why_full(payload_bytes=size)

    def record_outputs(self, outcome: Outcome) -> None:
        """Record the files a running attempt is about to move into place (``data``: ``files``,
        path -> :func:`~edge_queue.written.identity`) with the turn, and set ``data["recorded"]``,
        which the supervisor answers the worker with after the commit: false for an attempt that
        is no longer the job's, or a report that is not files."""
        files, ok = outcome.data.get("files"), False
        try:
            job = self.store().get(outcome.job_id)
        except NotFoundError:
            job = None
        if job is None or lifecycle.is_stale(job, outcome.attempt):
            log.info(
                "job %s: outputs of attempt %d not recorded (no longer the job's)", outcome.job_id, outcome.attempt
            )
        elif not isinstance(files, dict) or not all(
            isinstance(p, str) and os.path.isabs(p) and valid_identity(i) for p, i in files.items()
        ):
            log.warning("job %s: outputs reported without paths and identities ignored", outcome.job_id)
        else:
            try:
                self.store().record_outputs(outcome.job_id, outcome.attempt, files)
                ok = True
            except ValueError as e:
                self.unkept.warning("job %s: outputs not recorded: %s", outcome.job_id, e)
        outcome.data["recorded"] = ok

    def graceful_stop(self, job_ids: set[str] | list[str], now: float) -> None:
        """The graceful stop ended the workers of ``job_ids``: each takes the step
        :func:`~edge_queue.rules.lifecycle.after_graceful_stop` decides (not the job's fault: its
        attempt does not count)."""
        store = self.store()
        for job_id in job_ids:
            job = store.get(job_id)
            step = lifecycle.after_graceful_stop(job)
            if step is not None:
                job = store.transition(job_id, step.state, now, detail=step.detail, **step.changes)
                self.publisher.publish_job(job)
                log.log(step.level, "%s", step.note)
