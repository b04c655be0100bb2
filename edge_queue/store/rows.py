"""The rows of the ``jobs`` table as the store writes them, and what a submit is made of:
:class:`JobSpec` in, :class:`Created` out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson

from edge_queue.rules.states import JobState

from .ids import iso

JSON_COLUMNS = ("options", "error", "result")
#: SQL condition on a row of ``jobs``: it has no lock key, or it is the oldest active job of its
#: key and sender (the one that may run; the others wait for it, in submit order). A lock key
#: belongs to its sender, as an idempotency key does (docs/topics.md, "Lock keys").
LOCK_HEAD = (
    "(jobs.lock_key IS NULL OR jobs.job_id = (SELECT l.job_id FROM jobs AS l INDEXED BY jobs_lock "
    "WHERE l.lock_key = jobs.lock_key AND l.submitted_by IS jobs.submitted_by "
    "AND l.state IN ('queued','running','retrying','cancelling') "
    "ORDER BY l.created_at, l.job_id LIMIT 1))"
)


def json_text(value: Any) -> str:
    """``value`` as JSON text for a column (orjson: once per job on the hot path). What orjson
    does not take (lone surrogates, integers over 64 bits) is written by ``json`` instead."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return json.dumps(value)


def queued_row(
    spec: JobSpec,
    job_id: str,
    key: str,
    batch_id: str | None,
    at: str,
    *,
    options: str | None = None,
    run_at: str | None = None,
) -> dict[str, Any]:
    """The ``jobs`` row of a new job, every column (JSON columns as text): ``queued``, seq 1,
    attempt 0, made at ``at`` (RFC 3339). ``options``/``run_at``: their text when the caller
    already made it."""
    return {
        "job_id": job_id,
        "seq": 1,
        "kind": spec.kind,
        "input": spec.input,
        "options": options if options is not None else json_text(spec.options),
        "batch_id": batch_id,
        "priority": spec.priority,
        "state": JobState.QUEUED.value,
        "stage": None,
        "progress": 0.0,
        "eta_s": None,
        "attempt": 0,
        "max_attempts": spec.max_attempts,
        "retry_at": None,
        "error": None,
        "result": None,
        "dedupe_key": key,
        "timeout_s": spec.timeout_s,
        "run_at": run_at if run_at is not None else (iso(spec.run_at) if spec.run_at else None),
        "lock_key": spec.lock_key,
        "submitted_by": spec.submitted_by,
        "owner": None,
        "crashes": 0,
        "created_at": at,
        "started_at": None,
        "finished_at": None,
        "updated_at": at,
    }


def deferred_job_row(job: dict[str, Any]) -> tuple[Any, ...]:
    """The parameters of :data:`INSERT_JOB` for the row ``job`` (every column, JSON as text)."""
    return (
        job["job_id"],
        job["seq"],
        job["kind"],
        job["input"],
        job["options"],
        job["priority"],
        job["state"],
        job["attempt"],
        job["max_attempts"],
        job["dedupe_key"],
        job["timeout_s"],
        job["run_at"],
        job["submitted_by"],
        job["owner"],
        job["created_at"],
        job["started_at"],
        job["updated_at"],
    )


def bindable(text: str | None) -> bool:
    """True when SQLite can store ``text`` (UTF-8: no lone surrogates)."""
    if text is None or text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


#: a new plain job's row (Submits.submit_deferred: the columns that are not their defaults;
#: ``queued`` with seq 1 and attempt 0, or ``running`` when claimed before it was written,
#: Claims.claim_deferred)
INSERT_JOB = (
    "INSERT INTO jobs (job_id, seq, kind, input, options, batch_id, priority, state, stage, progress, eta_s, "
    "attempt, max_attempts, retry_at, error, result, dedupe_key, timeout_s, run_at, lock_key, submitted_by, owner, "
    "crashes, created_at, started_at, finished_at, updated_at) "
    "VALUES (?, ?, ?, ?, ?, NULL, ?, ?, NULL, 0.0, NULL, ?, ?, NULL, NULL, NULL, ?, ?, ?, NULL, ?, ?, "
    "0, ?, ?, NULL, ?)"
)
#: the event rows of the group's plain submits: ``(id, job_id, at, from_state, to_state, attempt)``
INSERT_DEFERRED_EVENT = (
    "INSERT INTO job_events (id, job_id, at, from_state, to_state, attempt, detail) VALUES (?, ?, ?, ?, ?, ?, NULL)"
)
REMEMBER_REQUEST = "INSERT OR REPLACE INTO delivered_requests (key, response, reply_to, at, seq) VALUES (?, ?, ?, ?, ?)"
SET_META = "INSERT INTO store_meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value"


@dataclass(frozen=True, slots=True)
class JobSpec:
    """One job to create; ``options`` are already validated by the kind."""

    kind: str
    input: str | None
    options: dict[str, Any]
    priority: int = 0
    max_attempts: int = 3
    timeout_s: float | None = None
    run_at: float | None = None
    #: jobs with one lock key run one at a time, in submit order (docs/topics.md, "Lock keys")
    lock_key: str | None = None
    #: with a lock key: refuse the job (:class:`LockHeld`) while another job holds the key
    reject_when_locked: bool = False
    #: the broker user whose own request topic the submit came on; None: the shared topic
    #: (docs/topics.md, "Who sent a request")
    submitted_by: str | None = None


class LockHeld(Exception):
    """A submit with ``on_lock: reject`` met an active job holding its lock key."""

    def __init__(self, lock_key: str, holder: str) -> None:
        super().__init__(f"lock key {lock_key!r} is held by job {holder}")
        self.lock_key, self.holder = lock_key, holder


@dataclass(frozen=True, slots=True)
class Created:
    """Outcome of :meth:`~edge_queue.store.Store.submit`: the job row and whether it existed before."""

    job: dict[str, Any]
    duplicate: bool


def decode_row(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with its JSON columns (``options``, ``error``, ``result``) decoded, in place."""
    for col in JSON_COLUMNS:
        text = row.get(col)
        if text is not None:
            try:
                row[col] = orjson.loads(text)
            except orjson.JSONDecodeError:  # lone surrogate escapes (non-UTF-8 file names)
                row[col] = json.loads(text)
    return row
