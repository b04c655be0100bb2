"""The job lifecycle rules (edge_queue/rules/lifecycle.py), by tables: no broker, no process, no
database (docs/topics.md, "States")."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from edge_queue.rules import lifecycle
from edge_queue.rules.lifecycle import Step
from edge_queue.rules.states import TRANSITIONS, JobState

NOW = 1_000_000.0


def job(state: str = "running", attempt: int = 1, max_attempts: int = 3, crashes: int = 0, **extra: Any) -> dict:
    return {
        "job_id": "j1",
        "state": state,
        "attempt": attempt,
        "max_attempts": max_attempts,
        "crashes": crashes,
        "started_at": extra.pop("started_at", "2026-12-03T10:00:00.000Z"),
        **extra,
    }


def report(j: dict, op: str, data: dict | None = None, *, limit: int = 3, backoff: float = 7.5) -> Step:
    return lifecycle.after_report(j, op, data or {}, NOW, crash_loop_limit=limit, backoff=lambda attempt: backoff)


def allowed(j: dict, step: Step) -> bool:
    return step.state in TRANSITIONS[JobState(j["state"])]


# -- fencing ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "attempt", "reported", "stale"),
    [
        ("running", 2, 2, False),
        ("cancelling", 2, 2, False),
        ("running", 2, 1, True),  # an old attempt's report: refused
        ("running", 1, 2, True),  # a report from the future (a stale worker's numbering)
        ("queued", 1, 1, True),  # requeued since
        ("retrying", 1, 1, True),
        ("succeeded", 1, 1, True),
        ("failed", 1, 1, True),
        ("cancelled", 1, 1, True),
    ],
)
def test_a_report_speaks_for_the_current_attempt_only(state: str, attempt: int, reported: int, stale: bool) -> None:
    assert lifecycle.is_stale(job(state, attempt), reported) is stale


# -- reports on the current attempt -------------------------------------------------------

TABLE = [
    # (job state, attempt, max, crashes, op, data, expected state, expected changes (subset))
    (
        "running",
        1,
        3,
        0,
        "done",
        {"result": {"x": 1}},
        "succeeded",
        {"result": {"x": 1}, "progress": 100.0, "crashes": 0},
    ),
    ("running", 1, 3, 2, "done", {}, "succeeded", {"crashes": 0, "error": None}),
    # a success while cancelling is still a success: the work is done
    ("cancelling", 1, 3, 0, "done", {}, "succeeded", {"progress": 100.0}),
    (
        "running",
        1,
        3,
        0,
        "failed",
        {"code": "internal_error", "message": "m", "retryable": True},
        "retrying",
        {"retry_at": NOW + 7.5, "crashes": 0, "error": {"code": "internal_error", "message": "m", "retryable": True}},
    ),
    (
        "running",
        3,
        3,
        0,
        "failed",
        {"code": "internal_error", "message": "m", "retryable": True},
        "failed",
        {"error": {"code": "internal_error", "message": "m", "retryable": True}},
    ),
    (
        "running",
        1,
        3,
        0,
        "failed",
        {"code": "no_audio_stream", "message": "m", "retryable": False},
        "failed",
        {"error": {"code": "no_audio_stream", "message": "m", "retryable": False}},
    ),
    # a worker death is retried at once, and counted
    (
        "running",
        1,
        3,
        0,
        "lost",
        {"code": "worker_lost", "message": "killed"},
        "retrying",
        {"retry_at": NOW, "crashes": 1},
    ),
    (
        "running",
        2,
        5,
        2,
        "lost",
        {"code": "worker_lost", "message": "killed"},
        "failed",
        {
            "crashes": 3,
            "error": {"code": "crash_loop", "retryable": False, "message": "the job ended its worker 3 times in a row"},
        },
    ),
    # any other outcome breaks the run of deaths
    ("running", 2, 5, 2, "failed", {"code": "internal_error", "message": "m"}, "retrying", {"crashes": 0}),
    ("running", 1, 3, 0, "lost", {"code": "timeout", "message": "over 5 s"}, "retrying", {"crashes": 0}),
    # cancelled at a checkpoint, or a worker ended after the grace period while cancelling
    # a job that says it was cancelled when nobody asked: a failure of its kind, not retried
    ("running", 1, 3, 0, "failed", {"code": "cancelled", "message": "m", "retryable": True}, "failed", {"crashes": 0}),
    ("cancelling", 1, 3, 0, "failed", {"code": "cancelled", "message": "cancelled"}, "cancelled", {"crashes": 0}),
    ("cancelling", 1, 3, 0, "lost", {"code": "cancelled", "message": "grace over"}, "cancelled", {}),
    ("cancelling", 1, 3, 0, "lost", {"code": "worker_lost", "message": "died"}, "cancelled", {"crashes": 1}),
    # a failure the job reported by itself while cancelling stays a failure, not retried
    ("cancelling", 1, 3, 0, "failed", {"code": "internal_error", "message": "m", "retryable": True}, "failed", {}),
    # not started by its worker: back to the queue, the attempt taken back
    ("running", 2, 3, 0, "unstarted", {"reason": "pause"}, "queued", {"attempt": 1, "owner": None, "started_at": None}),
    ("cancelling", 2, 3, 0, "unstarted", {"reason": "pause"}, "cancelled", {"attempt": 1, "started_at": None}),
]


@pytest.mark.parametrize(("state", "attempt", "max_", "crashes", "op", "data", "expected", "changes"), TABLE)
def test_the_next_state_after_a_report(
    state: str, attempt: int, max_: int, crashes: int, op: str, data: dict, expected: str, changes: dict
) -> None:
    j = job(state, attempt, max_, crashes)
    step = report(j, op, data)
    assert step.state == expected
    assert {k: step.changes.get(k, "(unset)") for k in changes} == changes
    assert allowed(j, step), f"{state} -> {step.state} is not in the transition table"


def test_a_cancelled_attempt_has_the_cancelled_error() -> None:
    step = report(job("cancelling"), "lost", {"code": "cancelled"})
    assert step.changes["error"] == {"code": "cancelled", "message": "cancelled", "retryable": False}


def test_the_backoff_is_asked_for_the_attempt_that_failed() -> None:
    asked: list[int] = []

    def backoff(attempt: int) -> float:
        asked.append(attempt)
        return 3.0

    lifecycle.after_report(job("running", 2), "failed", {"code": "x"}, NOW, crash_loop_limit=3, backoff=backoff)
    assert asked == [2]


def test_log_lines_name_the_job_and_clip_client_text() -> None:
    step = report(job(), "failed", {"code": "internal_error", "message": "a\nINFO forged" + "x" * 500, "retryable": 0})
    assert step.level == logging.ERROR
    assert step.note.startswith("job j1 failed: internal_error: a\\nINFO forged")
    assert "\n" not in step.note and len(step.note) < 300


@pytest.mark.parametrize(
    ("draw", "attempt", "expected"),
    [(1.0, 1, 5.0), (1.0, 2, 10.0), (1.0, 3, 20.0), (1.0, 20, 300.0), (0.5, 4, 20.0), (0.0, 2, 0.0)],
)
def test_backoff_is_full_jitter_capped(draw: float, attempt: int, expected: float) -> None:
    assert lifecycle.backoff_s(attempt, 5, 300, rng=lambda: draw) == expected


# -- a dead service, a graceful stop, requests ---------------------------------------------


@pytest.mark.parametrize(
    ("j", "expected", "changes"),
    [
        (job("cancelling"), "cancelled", {"error": {"code": "cancelled", "message": "cancelled", "retryable": False}}),
        (job("running", 2, started_at=None), "queued", {"attempt": 1, "owner": None}),
        (
            job("running", 3, 3),
            "failed",
            {"error": {"code": "worker_lost", "retryable": True, "message": "the service ended during attempt 3 of 3"}},
        ),
        (job("running", 2, 3), "queued", {"owner": None}),
    ],
)
def test_jobs_a_dead_service_left_in_an_attempt(j: dict, expected: str, changes: dict) -> None:
    step = lifecycle.after_service_death(j)
    assert step.state == expected and step.changes == changes
    assert allowed(j, step)


@pytest.mark.parametrize(
    ("state", "expected", "changes"),
    [("running", "queued", {"attempt": 1}), ("cancelling", "cancelled", {}), ("succeeded", None, None)],
)
def test_a_graceful_stop_does_not_count_the_attempt(state: str, expected: str | None, changes: dict | None) -> None:
    step = lifecycle.after_graceful_stop(job(state, 2))
    if expected is None:
        assert step is None
        return
    assert step is not None and step.state == expected and step.changes == changes
    assert step.detail == {"reason": "graceful stop"}


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        ("queued", "cancelled"),
        ("retrying", "cancelled"),
        ("running", "cancelling"),
        ("cancelling", None),
        ("succeeded", None),
        ("failed", None),
        ("cancelled", None),
    ],
)
def test_a_cancel_request(state: str, expected: str | None) -> None:
    step = lifecycle.after_cancel_request(job(state))
    assert (step.state if step else None) == expected
    if step is not None:
        assert allowed(job(state), step)


def test_a_retry_request_starts_the_job_over() -> None:
    step = lifecycle.after_retry_request()
    assert step.state == "queued"
    assert step.changes["attempt"] == 0 and step.changes["crashes"] == 0
    assert step.changes["error"] is None and step.changes["result"] is None and step.changes["started_at"] is None
    for src in ("failed", "cancelled"):
        assert allowed(job(src), step)


@pytest.mark.parametrize("state", ["running", "cancelling"])
@pytest.mark.parametrize("op", ["done", "failed", "lost", "unstarted"])
@pytest.mark.parametrize("code", ["internal_error", "worker_lost", "timeout", "cancelled", "no_audio_stream", None])
@pytest.mark.parametrize(("attempt", "max_", "crashes"), [(1, 1, 0), (1, 3, 0), (3, 3, 2), (2, 5, 9)])
def test_every_step_is_a_transition_the_table_allows(
    state: str, op: str, code: str | None, attempt: int, max_: int, crashes: int
) -> None:
    j = job(state, attempt, max_, crashes)
    data = {} if code is None else {"code": code, "message": "m"}
    step = report(j, op, data)
    assert allowed(j, step), f"{state} + {op}/{code} -> {step.state} is not in the transition table"
    if step.state == "retrying":
        assert step.changes["retry_at"] >= NOW and attempt < max_


def test_a_file_that_is_not_usable_audio_fails_its_job_with_a_warning_not_an_error() -> None:
    # before: an ERROR line for every upload or watched file that is not audio (a caller's fault)
    for code in ("unsupported_media", "no_audio_stream", "truncated_media", "decode_error"):
        step = report(job(), "failed", {"code": code, "message": "not audio", "retryable": False})
        assert step.state == JobState.FAILED and step.level == logging.WARNING, code
    assert report(job(), "failed", {"code": "output_not_writable", "retryable": False}).level == logging.ERROR


def test_a_job_keeps_its_chunks_only_while_they_can_serve_it() -> None:
    unwritable = {"code": "output_not_writable", "message": "cannot write /m: Read-only file system"}
    assert all(lifecycle.keeps_chunks(s, None) for s in (JobState.QUEUED, JobState.RUNNING, JobState.RETRYING))
    assert lifecycle.keeps_chunks(JobState.CANCELLING, None)
    assert lifecycle.keeps_chunks(JobState.FAILED, unwritable)  # decoded, only not written: a retry writes it
    assert not lifecycle.keeps_chunks(JobState.FAILED, {"code": "decode_error", "message": "x"})
    assert not lifecycle.keeps_chunks(JobState.FAILED, None)
    assert not lifecycle.keeps_chunks(JobState.SUCCEEDED, None)
    assert not lifecycle.keeps_chunks(JobState.CANCELLED, unwritable)
