"""A worker node's reports of an attempt it holds (docs/nodes.md): ``progress``, ``chunk``,
``done``, ``failed``, ``lost`` and ``unstarted`` turned into the same :class:`Outcome` records
as the local worker pool's, their values checked first (a progress in range, a result of its
kind's shape). Plain functions: the lease a report must match is the hub's (:mod:`.hub`)."""

from __future__ import annotations

from typing import Any, TypeGuard

from edge_queue.errors import ErrorCode
from edge_queue.logfmt import clip
from edge_queue.rules.rates import RejectionLog
from edge_queue.rules.results import result_problem
from edge_queue.workers.supervisor import Outcome

#: Longest ``stage`` a node's progress may carry (the kinds' own are at most 13 characters).
STAGE_MAX_CHARS = 64
#: Largest ``eta_s`` a node's progress may carry: a year.
ETA_MAX_S = 365 * 86400


def node_progress(msg: dict[str, Any]) -> dict[str, Any] | None:
    """The ``progress``, ``stage`` and ``eta_s`` of a node's ``progress`` message as the job
    object takes them (docs/topics.md: percent 0-100, a stage name, seconds or null), or
    ``None`` when one is out of range: ``progress`` not a number in 0-100, ``stage`` neither
    null nor a string of at most :data:`STAGE_MAX_CHARS`, ``eta_s`` neither null nor a number
    in 0-:data:`ETA_MAX_S` (``NaN`` and infinities, which Python's JSON reads, are out of
    range too)."""
    progress, stage, eta_s = msg.get("progress"), msg.get("stage"), msg.get("eta_s")
    if not _in_range(progress, 100):
        return None
    if stage is not None and not (isinstance(stage, str) and len(stage) <= STAGE_MAX_CHARS):
        return None
    if eta_s is not None and not _in_range(eta_s, ETA_MAX_S):
        return None
    return {"progress": float(progress), "stage": stage, "eta_s": eta_s}


def _in_range(value: Any, top: float) -> TypeGuard[float]:
    """A JSON number (not a boolean) in 0-``top``; ``NaN`` is not."""
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= top


def report_outcome(
    node_id: str, msg: dict[str, Any], kind: str, kind_class: Any, refused: RejectionLog
) -> Outcome | None:
    """The outcome of ``msg``, a report of node ``node_id`` on the attempt whose lease it holds
    (``op``, ``job_id`` and ``attempt`` checked by the hub; ``kind`` the job's kind, its
    ``kind_class`` giving the result's shape, ``Result``, or None); None for a progress out of
    range (:func:`node_progress`). A ``done`` whose result is not of that shape is a
    ``failed`` attempt (``invalid_result``, retryable), never a succeeded job. Refusals and
    jobs given back are logged through ``refused``, the hub's rate limit."""
    op, job_id, attempt = msg["op"], msg["job_id"], msg["attempt"]
    if op == "progress":
        data = node_progress(msg)
        if data is None:
            refused.warning("node %s sent progress of job %s out of range: ignored", node_id, clip(job_id))
            return None
        return Outcome("progress", job_id, attempt, data)
    if op == "chunk":  # a finished chunk, kept for the job's next attempt (Outcomes.keep_chunk)
        return Outcome("chunk", job_id, attempt, {"index": msg.get("index"), "data": msg.get("data")})
    if op == "done":
        problem = result_problem(msg.get("result"), getattr(kind_class, "Result", None))
        if problem is None:
            return Outcome("done", job_id, attempt, {"result": msg.get("result")})
        # never a succeeded job: a failed attempt, and the next one goes elsewhere or again
        refused.warning("node %s: the result of job %s refused: %s", node_id, clip(job_id), problem)
        message = f"node {node_id} reported a result that is not a {kind} result: {clip(problem)}"
        return Outcome(
            "failed", job_id, attempt, {"code": ErrorCode.INVALID_RESULT, "message": message, "retryable": True}
        )
    if op == "unstarted":
        reason = f"node {node_id} gave it back: {clip(str(msg.get('message') or 'no reason given'))}"
        refused.warning("job %s: %s", clip(job_id), reason)
        return Outcome("unstarted", job_id, attempt, {"reason": reason})
    data = {"code": str(msg.get("code") or ErrorCode.WORKER_LOST), "message": str(msg.get("message") or "")}
    if op == "failed":
        data["retryable"] = bool(msg.get("retryable"))
    return Outcome(op, job_id, attempt, data)
