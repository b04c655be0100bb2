"""Job lifecycle rules: plain functions over plain data, no I/O (docs/topics.md, "States").

Given a job (its row as a dict) and what happened to it (its worker's report, its worker's
death, a restart of the service, a graceful stop, a ``cancel`` or ``retry`` request), each
function returns the :class:`Step` to take: the next state, the columns to change with it
(attempt, crashes, retry time, error, result), the event's ``detail`` and the log line. The
service applies a step with ``Store.transition`` (which checks it against
:data:`~edge_queue.rules.states.TRANSITIONS` and fences it by attempt) and publishes the result.

Rules kept here, each tested by tables in ``tests/test_lifecycle.py``:

- **Fencing by attempt**: a report of any attempt but the job's current one, or for a job no
  longer ``running``/``cancelling``, is stale and refused (:func:`is_stale`).
- **Worker deaths**: consecutive deaths count in ``crashes``; ``settings.crash_loop_limit``
  of them in a row end the job ``failed: crash_loop``. A death is retried at once, any other
  retryable failure after a backoff with full jitter (:func:`backoff_s`).
- **Cancelling**: a cancel seen at a checkpoint, or a worker ended after the grace period,
  ends ``cancelled``; a success that arrives while cancelling is still a success (the work
  is done); a failure the job reported by itself stays a failure. A job that reports
  ``cancelled`` when no cancel was asked for fails ``internal_error`` (not retried).
- **Every step is a transition the table allows** from the state it starts in.
- **Attempts not counted**: a job its worker had not started (given back, or its worker
  died first), a job requeued by a graceful stop, and a job still in its worker's queue when
  the service died go back to ``queued`` with their attempt number taken back.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from edge_queue.errors import ErrorCode
from edge_queue.logfmt import clip

from .states import JobState, cancelled_error, is_terminal

#: The states in which a job has a current attempt that a report may speak for.
IN_ATTEMPT = (JobState.RUNNING, JobState.CANCELLING)
#: Codes of a failure that say the job's input is not usable audio: the file's fault, not the
#: service's, so a WARNING and not an ERROR (a caller or a watch folder sending junk fills no
#: error log).
MEDIA_FAULTS = frozenset(
    {ErrorCode.UNSUPPORTED_MEDIA, ErrorCode.NO_AUDIO_STREAM, ErrorCode.TRUNCATED_MEDIA, ErrorCode.DECODE_ERROR}
)


@dataclass(frozen=True, slots=True)
class Step:
    """One change of a job's state, decided by a rule of this module.

    Attributes:
        state: the state to move to.
        changes: other columns of the job to set with it (``Store.transition``'s ``fields``:
            ``attempt``, ``crashes``, ``retry_at`` in Unix seconds, ``error``, ``result``, ...).
        detail: the event's ``detail`` (``{"reason": ...}``), or None.
        level: the ``logging`` level of :attr:`note`; ``0`` for no log line.
        note: the log line, already formatted (client text clipped to one line).
    """

    state: JobState
    changes: dict[str, Any] = field(default_factory=dict)
    detail: dict[str, Any] | None = None
    level: int = 0
    note: str = ""


def backoff_s(attempt: int, base_s: float, cap_s: float, rng: Callable[[], float] = random.random) -> float:
    """Delay before the next attempt, in seconds: "full jitter" (AWS Architecture Blog,
    "Exponential Backoff And Jitter", 2015): uniform in ``[0, min(cap, base * 2**(attempt-1))]``.

    ``attempt`` is the number of the attempt that just failed (1 for the first).
    """
    return rng() * min(cap_s, base_s * 2 ** max(attempt - 1, 0))


def is_stale(job: Mapping[str, Any], attempt: int) -> bool:
    """True when a report of ``attempt`` no longer speaks for ``job``: the job is on another
    attempt (the attempt number is the fencing token), or not in an attempt at all."""
    return job["attempt"] != attempt or job["state"] not in IN_ATTEMPT


def after_report(
    job: Mapping[str, Any],
    op: str,
    data: Mapping[str, Any],
    now: float,
    *,
    crash_loop_limit: int,
    backoff: Callable[[int], float],
) -> Step:
    """The step after a worker's report ``op`` on the job's current attempt (check
    :func:`is_stale` first).

    Args:
        job: the job's row; ``state`` is ``running`` or ``cancelling``.
        op: ``done`` (``data["result"]``), ``failed`` (``data``: ``code``, ``message``,
            ``retryable``), ``lost`` (its worker died; ``data``: ``code`` ``worker_lost``,
            ``timeout`` or ``cancelled``, ``message``) or ``unstarted`` (its worker had not
            started it; ``data["reason"]``). ``progress`` and ``started`` are not state changes.
        now: Unix seconds; a retry's ``retry_at`` is ``now`` plus the backoff.
        crash_loop_limit: worker deaths in a row that end the job ``failed: crash_loop``.
        backoff: seconds to wait after the failed attempt number it is given.
    """
    job_id, attempt = job["job_id"], job["attempt"]
    cancelling = job["state"] == JobState.CANCELLING
    if op == "unstarted" and not cancelling:
        reason = data.get("reason", "its worker ended before it started")
        return Step(JobState.QUEUED, {"attempt": attempt - 1, "owner": None, "started_at": None}, {"reason": reason})
    if op == "done":
        changes = {"result": data.get("result"), "progress": 100.0, "error": None, "crashes": 0}
        return Step(JobState.SUCCEEDED, changes, None, logging.INFO, f"job {job_id} succeeded (attempt {attempt})")
    code = data.get("code", str(ErrorCode.INTERNAL_ERROR))
    message = data.get("message", "")
    # Consecutive worker deaths: any other outcome breaks the run.
    crashes = job["crashes"] + 1 if op == "lost" and code == ErrorCode.WORKER_LOST else 0
    retryable = bool(data.get("retryable", code not in (ErrorCode.CANCELLED,)))
    if code == ErrorCode.CANCELLED and not cancelling:
        # Nobody asked for a cancel (a kind raised JobCancelled by itself): a failure of the
        # kind, not a cancel, and the same again if retried.
        error = {
            "code": str(ErrorCode.INTERNAL_ERROR),
            "message": f"the job reported it was cancelled, but no cancel was asked for ({clip(message)})",
            "retryable": False,
        }
        note = f"job {job_id} failed: internal_error: {error['message']}"
        return Step(JobState.FAILED, {"crashes": crashes, "error": error}, None, logging.ERROR, note)
    if code == ErrorCode.CANCELLED or (cancelling and op in ("lost", "unstarted")):
        # a job cancelled before its worker started it never had that attempt
        unstarted = {"attempt": attempt - 1, "started_at": None} if op == "unstarted" else {}
        changes = {"crashes": crashes, "error": cancelled_error(), **unstarted}
        return Step(JobState.CANCELLED, changes, None, logging.INFO, f"job {job_id} cancelled")
    if crashes >= crash_loop_limit:
        error = {
            "code": str(ErrorCode.CRASH_LOOP),
            "retryable": False,
            "message": f"the job ended its worker {crashes} times in a row",
        }
        note = f"job {job_id} failed: crash_loop after {crashes} worker deaths"
        return Step(JobState.FAILED, {"crashes": crashes, "error": error}, None, logging.ERROR, note)
    if retryable and attempt < job["max_attempts"] and not cancelling:
        delay = 0.0 if code == ErrorCode.WORKER_LOST else backoff(attempt)
        changes = {
            "crashes": crashes,
            "retry_at": now + delay,
            "error": {"code": code, "message": message, "retryable": True},
        }
        note = f"job {job_id} attempt {attempt} failed ({code}: {clip(message)}); retry in {delay:.1f} s"
        return Step(JobState.RETRYING, changes, None, logging.WARNING, note)
    error = {"code": code, "message": message, "retryable": retryable}
    note = f"job {job_id} failed: {code}: {clip(message)}"
    level = logging.WARNING if code in MEDIA_FAULTS else logging.ERROR
    return Step(JobState.FAILED, {"crashes": crashes, "error": error}, None, level, note)


#: Failures after which a job keeps its kept chunks: the work is done, only its outputs could
#: not be written, so a ``retry`` (once the folder is writable) writes them without decoding
#: again. Every other end drops them.
KEEPS_CHUNKS = frozenset({ErrorCode.OUTPUT_NOT_WRITABLE})


def keeps_chunks(state: JobState, error: Mapping[str, Any] | None) -> bool:
    """True when a job that reaches ``state`` with ``error`` (its ``error`` column) keeps its
    kept chunks (docs/topics.md, "Long jobs resume"): a job that is not final, or one that
    failed with a code of :data:`KEEPS_CHUNKS`. A job's chunks go with it in any case
    (``purge``, ``retention_days``)."""
    if not is_terminal(state):
        return True
    return state == JobState.FAILED and isinstance(error, Mapping) and error.get("code") in KEEPS_CHUNKS


def after_service_death(job: Mapping[str, Any]) -> Step:
    """The step for a job a dead run of the service left ``running`` or ``cancelling``, taken
    at boot before any new work: ``cancelling`` ends ``cancelled``; a job its worker had not
    started goes back to ``queued`` with the attempt taken back; otherwise the attempt counts,
    and a job on its last attempt fails ``worker_lost`` (a job that takes the whole service
    down cannot loop forever)."""
    job_id, attempt = job["job_id"], job["attempt"]
    reason = {"reason": "service restart"}
    if job["state"] == JobState.CANCELLING:
        note = f"job {job_id}: cancelled (the service ended while it was cancelling)"
        return Step(JobState.CANCELLED, {"error": cancelled_error()}, reason, logging.WARNING, note)
    if job["started_at"] is None and job["state"] == JobState.RUNNING:
        # Still in its worker's queue when the service ended: the attempt never began.
        detail = {"reason": "service restart before its worker started it"}
        return Step(JobState.QUEUED, {"owner": None, "attempt": attempt - 1}, detail)
    if attempt >= job["max_attempts"]:
        error = {
            "code": str(ErrorCode.WORKER_LOST),
            "retryable": True,
            "message": f"the service ended during attempt {attempt} of {job['max_attempts']}",
        }
        note = f"job {job_id} failed: worker_lost (the service ended during its last attempt)"
        return Step(JobState.FAILED, {"error": error}, reason, logging.ERROR, note)
    note = f"job {job_id}: requeued after the previous run of the service ended during attempt {attempt}"
    return Step(JobState.QUEUED, {"owner": None}, reason, logging.WARNING, note)


def after_graceful_stop(job: Mapping[str, Any]) -> Step | None:
    """The step for a job still in an attempt when a graceful stop ends its worker, or None
    when the job is no longer in one. A graceful stop is not the job's fault: a ``running``
    job goes back to ``queued`` with its attempt taken back; a ``cancelling`` one ends
    ``cancelled``."""
    if job["state"] not in IN_ATTEMPT:
        return None
    reason = {"reason": "graceful stop"}
    if job["state"] == JobState.CANCELLING:
        return Step(JobState.CANCELLED, {}, reason, logging.INFO, f"job {job['job_id']} cancelled by the graceful stop")
    note = f"job {job['job_id']} queued by the graceful stop"
    return Step(JobState.QUEUED, {"attempt": job["attempt"] - 1}, reason, logging.INFO, note)


def after_cancel_request(job: Mapping[str, Any]) -> Step | None:
    """The step for a ``cancel`` request, or None when the job is past cancelling: a job not
    started (``queued``, ``retrying``) ends ``cancelled`` at once; a ``running`` one becomes
    ``cancelling`` until its worker stops (docs/topics.md, ``cancel``)."""
    state = job["state"]
    reason = {"reason": "cancel"}
    if state in (JobState.QUEUED, JobState.RETRYING):
        return Step(JobState.CANCELLED, {"error": cancelled_error()}, reason)
    if state == JobState.RUNNING:
        return Step(JobState.CANCELLING, {}, reason)
    return None


def after_retry_request() -> Step:
    """The step for a ``retry`` request of a ``failed`` or ``cancelled`` job: queued again as
    new, its attempts, crashes, error, result and progress cleared."""
    changes = {
        "attempt": 0,
        "crashes": 0,
        "error": None,
        "result": None,
        "progress": 0.0,
        "stage": None,
        "eta_s": None,
        "started_at": None,
        "retry_at": None,
    }
    return Step(JobState.QUEUED, changes, {"reason": "retry"})
