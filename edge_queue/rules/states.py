"""Job states and the one table of allowed transitions (docs/topics.md, "States").

The store checks every state change against :data:`TRANSITIONS`; payloads and tests use
:class:`JobState`, never a bare string.
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    """The state of a job, as published in the job object's ``state`` field."""

    QUEUED = "queued"
    RUNNING = "running"
    RETRYING = "retrying"
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL: frozenset[JobState] = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})

#: Active states: a job in one of these occupies a dedupe slot and is not yet finished.
ACTIVE: frozenset[JobState] = frozenset({JobState.QUEUED, JobState.RUNNING, JobState.RETRYING, JobState.CANCELLING})

#: from-state -> the states it may move to. ``running -> queued`` is the requeue of an attempt
#: interrupted by a service crash or a graceful stop (docs/topics.md, "States"). ``failed``/``cancelled``
#: -> ``queued`` is the ``retry`` command.
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.CANCELLED}),
    JobState.RUNNING: frozenset(
        {
            JobState.SUCCEEDED,
            JobState.FAILED,
            JobState.RETRYING,
            JobState.CANCELLING,
            JobState.QUEUED,
        }
    ),
    JobState.RETRYING: frozenset({JobState.RUNNING, JobState.CANCELLED}),
    JobState.CANCELLING: frozenset({JobState.CANCELLED, JobState.SUCCEEDED, JobState.FAILED, JobState.QUEUED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset({JobState.QUEUED}),
    JobState.CANCELLED: frozenset({JobState.QUEUED}),
}


_STATES = frozenset(JobState)


def is_terminal(state: JobState | str) -> bool:
    """True for ``succeeded``, ``failed`` and ``cancelled``: the job will not run again by itself.
    Raises ``ValueError`` for a name that is no state."""
    if state in TERMINAL:  # a StrEnum member hashes and compares as its text
        return True
    if state not in _STATES:
        JobState(state)  # ValueError
    return False


def can_transition(src: JobState | str, dst: JobState | str) -> bool:
    """True when :data:`TRANSITIONS` allows ``src -> dst``. Raises ``ValueError`` for unknown names."""
    return JobState(dst) in TRANSITIONS[JobState(src)]


def cancelled_error() -> dict[str, object]:
    """The ``error`` of a job that ended ``cancelled`` (a fresh dict each time)."""
    return {"code": "cancelled", "message": "cancelled", "retryable": False}
