"""The queue's typed API (docs/topics.md, "Commands"): what any intake may ask of the queue.

:class:`Queue` takes a typed request (:mod:`.models`) and the :class:`Caller` that sends it, and
owns what every door shares: roles, limits, disk checks, idempotency and error codes. Each
method returns the answer's ``data`` (docs/topics.md, "Response shapes") or raises
:class:`~edge_queue.errors.EdgeQueueError`; :meth:`Queue.answer` is the one place where those
errors become error responses, whatever the door.

The doors themselves are elsewhere: MQTT dispatch (:mod:`.dispatch`, :mod:`.commands`: the
envelope, ``reply_to``, the user from the topic), the HTTP API's intake (:mod:`.http_intake`)
and the watch folders (:mod:`edge_queue.watch.folders`).
"""

from __future__ import annotations

import builtins
import logging
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from edge_queue.config.settings import Role, Settings
from edge_queue.errors import EdgeQueueError, ErrorCode, InputError, NotFoundError, RequestError
from edge_queue.logfmt import clip as _clip
from edge_queue.mqtt import payloads
from edge_queue.mqtt.topics import COMMANDS, valid_id
from edge_queue.rules import lifecycle
from edge_queue.rules.inputs import check_input
from edge_queue.rules.limits import BULK_LIMIT
from edge_queue.rules.rates import RejectionLog
from edge_queue.rules.states import ACTIVE, JobState, is_terminal
from edge_queue.store import JobSpec, LockHeld

from . import models
from .browse import browse
from .outputs import read_outputs
from .ports import QueuePort

#: Commands only the ``admin`` role may send (docs/configuration.md, "[access]").
ADMIN_COMMANDS = frozenset({"pause", "resume", "purge", "republish"})
#: A ``list`` page holds jobs up to this many bytes of JSON (and at least one): 500 jobs with
#: long inputs and transcripts would otherwise make one response of megabytes.
LIST_MAX_BYTES = 1 * 2**20

log = logging.getLogger(__name__)


#: The service's log of rejected requests (see :class:`RejectionLog`).
rejections = RejectionLog(logger=log)


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sends a request: ``user`` (a broker or API user; ``None``: the shared request
    topics, or the service itself) and its ``role`` (docs/configuration.md, "[access]").
    ``input_roots``: the folders a submit's inputs must be in (``None``: ``media_roots``)."""

    user: str | None
    role: Role
    input_roots: tuple[Path, ...] | None = None

    @property
    def mine(self) -> tuple[str | None] | None:
        """The ``submitted_by`` filter of what this caller may see and touch: its own jobs for
        the ``user`` role, ``None`` (every job) for ``admin``."""
        return (self.user,) if self.role == "user" else None


#: The service's own requests (a watch folder's submits): every command, every job.
SERVICE = Caller(None, "admin")


class Queue:
    """The queue's operations, one method per command, against ``service`` (:class:`QueuePort`)."""

    def __init__(self, service: QueuePort) -> None:
        self.service = service

    def refusal(self, command: str, caller: Caller) -> str | None:
        """Why ``caller``'s role may not send ``command`` (the message of ``forbidden``), or None."""
        role = caller.role
        if role == "none" or (role == "user" and command in ADMIN_COMMANDS):
            who = "requests on the shared topics" if caller.user is None else f"user {_clip(caller.user, 64)!r}"
            return f"{who} (role {role}) may not send {_clip(command, 64)}; the service's access settings give roles"
        return None

    def allow(self, command: str, caller: Caller) -> None:
        """Raises :class:`RequestError` ``forbidden`` when ``caller``'s role may not send ``command``."""
        if (why := self.refusal(command, caller)) is not None:
            raise RequestError(why, code=ErrorCode.FORBIDDEN)

    def answer(self, command: str, request: models.Request, caller: Caller, transaction: Any = None) -> dict[str, Any]:
        """The response to ``request`` (docs/topics.md, "Response shapes"): ``ok`` with the
        command's data, or ``error`` with its code; ``transaction`` is echoed. Raises only
        ``sqlite3.Error`` (the store failed: the whole turn is answered by the loop)."""
        try:
            return payloads.ok(getattr(self, command)(request, caller), transaction)
        except RequestError as e:
            rejections.warning("request %s rejected: %s: %s", _clip(command, 64), e.code, _clip(e.message))
            resp = payloads.error(e.code, e.message, transaction, e.field)
            if isinstance(e, _AllRejected):
                resp["error"]["rejected"] = e.rejected
            return resp
        except EdgeQueueError as e:
            log.warning("request %s failed: %s: %s", _clip(command, 64), e.code, _clip(e.message))
            return payloads.error(e.code, e.message, transaction)
        except sqlite3.Error:
            raise  # the store failed (a full disk): the whole turn is answered (Service.tick)
        except Exception as e:  # a bug must cost one response, not the service
            log.exception("request %s: internal error", _clip(command, 64))
            return payloads.error(ErrorCode.INTERNAL_ERROR, f"{type(e).__name__}: {e}", transaction)

    # -- submit -------------------------------------------------------------------------

    def submit(self, req: models.SubmitRequest, caller: Caller) -> dict[str, Any]:
        self.allow("submit", caller)
        svc = self.service
        assert req.kind is not None
        if req.idempotency_key is not None:
            # A key already used returns the first submit's jobs whatever the rest of this
            # payload says: a client resending after a lost response gets them even when its
            # file is gone since, the queue is full or the kind was removed (docs/topics.md,
            # "Duplicates").
            found = svc.job_store().submitted_with(req.idempotency_key, caller.user)
            if found is not None:
                batch_id, created = found
                jobs = [{"job_id": c.job["job_id"], "input": c.job["input"], "duplicate": True} for c in created]
                return {"batch_id": batch_id, "jobs": jobs, "rejected": []}
        kind = svc.kinds.get(req.kind)
        if kind is None:
            raise RequestError(
                f"unknown kind {req.kind[:64]!r}; known: {', '.join(sorted(svc.kinds))}",
                code=ErrorCode.UNKNOWN_KIND,
                field="kind",
            )
        options = checked_options(kind, req.options, svc.settings)
        raw_inputs = req.input_list()
        if kind.needs_input and raw_inputs == [None]:
            raise RequestError(f"kind {kind.name} needs an input file", field="input")
        limits = svc.settings.limits
        if len(raw_inputs) > limits.max_batch_inputs:
            raise RequestError(
                f"{len(raw_inputs)} inputs; one submit takes at most {limits.max_batch_inputs} "
                "(limits.max_batch_inputs): split it",
                field="inputs",
            )
        if why := svc.disk_full(len(raw_inputs), sum(len(i) for i in raw_inputs if i)):
            raise RequestError(why, code=ErrorCode.DISK_FULL)
        waiting = svc.job_store().waiting()
        if waiting + len(raw_inputs) > limits.max_queued_jobs:
            raise RequestError(
                f"{waiting} job(s) waiting to run; the queue holds at most {limits.max_queued_jobs} "
                "(limits.max_queued_jobs): submit again later",
                code=ErrorCode.QUEUE_FULL,
            )
        own_limit = limits.max_queued_jobs_per_user
        if caller.mine is not None and own_limit:
            mine = svc.job_store().waiting_of(caller.user)
            if mine + len(raw_inputs) > own_limit:
                raise RequestError(
                    f"{mine} of your job(s) are waiting to run; one user may have at most {own_limit} "
                    "(limits.max_queued_jobs_per_user): submit again later",
                    code=ErrorCode.QUEUE_FULL,
                )
        if req.lock_key is not None and req.on_lock == "reject" and len(raw_inputs) > 1:
            raise RequestError(
                'a lock key with on_lock "reject" takes one input; with "wait" the inputs run one after another',
                field="on_lock",
            )
        specs, rejected = [], []
        # every input costs its checks (a file system look-up), accepted or not
        svc.count_work(len(raw_inputs))
        for raw in raw_inputs:
            try:
                path = self._checked_input(raw, caller) if kind.needs_input and raw else raw
            except InputError as e:
                rejected.append({"input": raw, "code": str(e.code), "message": e.message})
                rejections.warning("submit: input rejected: %s: %s", e.code, _clip(e.message))
                continue
            specs.append(
                JobSpec(
                    kind=kind.name,
                    input=path,
                    options=options,
                    priority=req.priority,
                    max_attempts=req.max_attempts or svc.settings.retry.max_attempts,
                    timeout_s=req.timeout_s,
                    run_at=req.run_at_ts(),
                    lock_key=req.lock_key,
                    reject_when_locked=req.on_lock == "reject",
                    submitted_by=caller.user,
                )
            )
        if not specs:
            raise _AllRejected(rejected)
        try:
            batch_id, created = svc.job_store().submit(
                specs, svc.clock(), idempotency_key=req.idempotency_key, as_batch=len(raw_inputs) > 1
            )
        except LockHeld as e:
            raise RequestError(
                f"lock key {_clip(e.lock_key, 200)!r} is held by job {e.holder}, which is not finished; "
                'submit with "on_lock": "wait" to run after it',
                code=ErrorCode.LOCK_HELD,
                field="lock_key",
            ) from e
        for c in created:
            if not c.duplicate:
                if log.isEnabledFor(logging.INFO):
                    log.info(
                        "job %s queued: %s %s", c.job["job_id"], c.job["kind"], _clip(c.job["input"] or "(no input)")
                    )
                svc.publish_job(c.job, "new")
        jobs = [{"job_id": c.job["job_id"], "input": c.job["input"], "duplicate": c.duplicate} for c in created]
        return {"batch_id": batch_id, "jobs": jobs, "rejected": rejected}

    def _checked_input(self, raw: str, caller: Caller) -> str:
        if caller.input_roots is not None:  # the HTTP API's own uploads, inside data_dir
            return check_input(raw, builtins.list(caller.input_roots))
        return check_input(raw, self.service.settings.media_roots, self.service.settings.data_dir)

    # -- job control --------------------------------------------------------------------

    def _job(self, job_id: str, caller: Caller) -> dict[str, Any]:
        """The job ``job_id``; raises ``not_found``, or ``forbidden`` when the sender's role
        (``user``) may not touch another sender's job."""
        if not valid_id(job_id):
            raise NotFoundError(f"no job {job_id[:64]!r}")
        job = self.service.job_store().get(job_id)
        if not self._may_touch(job, caller):
            raise RequestError(f"job {job_id} was submitted by another user", code=ErrorCode.FORBIDDEN, field="job_id")
        return job

    def _may_touch(self, job: dict[str, Any], caller: Caller) -> bool:
        return caller.mine is None or job.get("submitted_by") == caller.user

    def get(self, req: models.GetRequest, caller: Caller) -> dict[str, Any]:
        """The job object, with its transcript read back (:func:`.outputs.read_outputs`)."""
        self.allow("get", caller)
        return read_outputs(self.service, payloads.job_object(self._job(req.job_id, caller)), segments=req.segments)

    def browse(self, req: models.BrowseRequest, caller: Caller) -> dict[str, Any]:
        """A page of a folder inside the media roots, or the roots (:func:`.browse.browse`)."""
        self.allow("browse", caller)
        return browse(req.path, self.service.settings.media_roots, limit=req.limit, after=req.after)

    def list(self, req: models.ListRequest, caller: Caller) -> dict[str, Any]:
        self.allow("list", caller)
        if req.state is not None and req.state not in {s.value for s in JobState}:
            raise RequestError(f"unknown state {req.state[:32]!r}", field="state")
        filters: dict[str, Any] = {
            "state": req.state,
            "kind": req.kind,
            "batch_id": req.batch_id,
            "lock_key": req.lock_key,
            "submitted_by": caller.mine,
            "input_contains": req.input_contains,
        }
        store = self.service.job_store()
        # one job more than the page: whether it exists says whether another page follows
        data = list_page(store.list_jobs(before=req.before, limit=req.limit + 1, **filters), req.limit)
        if req.count:
            data["total"] = store.count_jobs(**filters)
        return data

    def cancel(self, req: models.CancelRequest, caller: Caller) -> dict[str, Any]:
        self.allow("cancel", caller)
        svc, store = self.service, self.service.job_store()
        chosen = sum(x is not None for x in (req.job_id, req.batch_id, req.running or None, req.all or None))
        if chosen != 1:
            raise RequestError("give exactly one of job_id, batch_id, running: true, all: true", field="job_id")
        if req.job_id is not None:
            job = self._job(req.job_id, caller)
            if is_terminal(job["state"]):
                raise RequestError(
                    f"job {req.job_id} is already {job['state']}", code=ErrorCode.CONFLICT, field="job_id"
                )
            targets = [req.job_id]
        elif req.batch_id is not None:
            if not valid_id(req.batch_id):
                raise NotFoundError(f"no batch {req.batch_id[:64]!r}")
            targets = store.batch(req.batch_id)["job_ids"]
            if caller.mine is not None and targets and not self._may_touch(store.get(targets[0]), caller):
                raise RequestError(
                    f"batch {req.batch_id} was submitted by another user", code=ErrorCode.FORBIDDEN, field="batch_id"
                )
        elif req.running:
            targets = [
                j["job_id"]
                for j in store.list_jobs(state=JobState.RUNNING.value, limit=BULK_LIMIT + 1, submitted_by=caller.mine)
            ]
        else:
            targets = [
                j["job_id"]
                for s in ACTIVE
                for j in store.list_jobs(state=s.value, limit=BULK_LIMIT + 1, submitted_by=caller.mine)
            ]
        more = len(targets) > BULK_LIMIT
        targets = targets[:BULK_LIMIT]
        svc.count_work(len(targets))
        cancelled, cancelling = [], []
        now = svc.clock()
        for job_id in targets:
            step = lifecycle.after_cancel_request(store.get(job_id))
            if step is None:
                continue
            job = store.transition(job_id, step.state, now, detail=step.detail, **step.changes)
            if step.state == JobState.CANCELLING:
                svc.cancel_running(job_id)
                cancelling.append(job_id)
            else:
                cancelled.append(job_id)
            log.info("job %s %s by request", job_id, job["state"])
            svc.publish_job(job)
        return {"cancelled": cancelled, "cancelling": cancelling, "more": more}

    def retry(self, req: models.RetryRequest, caller: Caller) -> dict[str, Any]:
        self.allow("retry", caller)
        svc = self.service
        if (req.job_id is None) == (not req.failed):
            raise RequestError("give exactly one of job_id, failed: true", field="job_id")
        if req.job_id is None:  # every failed job, up to BULK_LIMIT
            failed = svc.job_store().list_jobs(
                state=JobState.FAILED.value, limit=BULK_LIMIT + 1, submitted_by=caller.mine
            )
            svc.count_work(min(len(failed), BULK_LIMIT))
            retried = [self._retry(j["job_id"])["job_id"] for j in reversed(failed[:BULK_LIMIT])]
            return {"retried": retried, "more": len(failed) > BULK_LIMIT}
        job = self._job(req.job_id, caller)
        if job["state"] not in (JobState.FAILED, JobState.CANCELLED):
            raise RequestError(
                f"only failed or cancelled jobs can be retried; {req.job_id} is {job['state']}",
                code=ErrorCode.CONFLICT,
                field="job_id",
            )
        return payloads.job_object(self._retry(req.job_id))

    def _retry(self, job_id: str) -> dict[str, Any]:
        """Queue a failed or cancelled job again, as new: attempts, error and result cleared."""
        svc = self.service
        step = lifecycle.after_retry_request()
        job = svc.job_store().transition(job_id, step.state, svc.clock(), detail=step.detail, **step.changes)
        svc.publish_job(job)
        return job

    def pause(self, req: models.PauseRequest, caller: Caller) -> dict[str, Any]:
        self.allow("pause", caller)
        self.service.set_paused(req.paused)
        return {"paused": req.paused}

    def resume(self, req: models.EmptyRequest, caller: Caller) -> dict[str, Any]:
        self.allow("resume", caller)
        self.service.set_paused(False)
        return {"paused": False}

    def purge(self, req: models.PurgeRequest, caller: Caller) -> dict[str, Any]:
        self.allow("purge", caller)
        svc, store = self.service, self.service.job_store()
        if (req.job_id is None) == (req.older_than_s is None):
            raise RequestError("give either job_id or older_than_s", field="job_id")
        if req.job_id is not None:
            job = self._job(req.job_id, caller)
            if not is_terminal(job["state"]):
                raise RequestError(
                    f"job {req.job_id} is {job['state']}; only terminal jobs are purged",
                    code=ErrorCode.CONFLICT,
                    field="job_id",
                )
            ids = [req.job_id]
        else:
            assert req.older_than_s is not None
            ids = store.finished_before(
                svc.clock() - req.older_than_s, req.states or ("succeeded", "failed", "cancelled"), limit=BULK_LIMIT + 1
            )
        more = len(ids) > BULK_LIMIT
        svc.count_work(min(len(ids), BULK_LIMIT))
        return {"purged": svc.purge(ids[:BULK_LIMIT]), "more": more}

    def republish(self, req: models.EmptyRequest, caller: Caller) -> dict[str, Any]:
        self.allow("republish", caller)
        started = self.service.republish()
        return {"republished": True, "already_running": not started}

    def events(self, req: models.EventsRequest, caller: Caller) -> dict[str, Any]:
        """The event cursor: the state changes after ``after``, with ``next_after`` to ask for
        next, the oldest ``event_id`` still kept, and ``dropped`` when events after the cursor
        were deleted before they were read (docs/topics.md, ``events``)."""
        self.allow("events", caller)
        store = self.service.job_store()
        events, oldest, dropped = store.events_after(
            req.after, req.limit, job_id=req.job_id, types=req.types, submitted_by=caller.mine
        )
        if len(events) == req.limit:
            next_after = events[-1]["event_id"]
        else:  # everything up to the newest event was looked at
            newest = store.newest_event_id()
            next_after = max(req.after, events[-1]["event_id"] if events else 0, newest)
        return {"events": events, "next_after": next_after, "oldest_event_id": oldest, "dropped": dropped}

    def kinds(self, req: models.EmptyRequest, caller: Caller) -> dict[str, Any]:
        """Every job kind with the JSON Schema of its options (``<base>/info`` names the
        options only, so that it stays small) and its ``max_concurrency`` (``None``: no limit
        of its own)."""
        self.allow("kinds", caller)
        settings = self.service.settings
        return {
            "kinds": {
                name: {
                    "description": k.description,
                    "needs_input": k.needs_input,
                    "max_concurrency": settings.kind(name).max_concurrency,
                    "options": k.schema(),
                }
                for name, k in self.service.kinds.items()
            }
        }


def list_page(rows: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """``list``'s answer for ``rows`` (newest first, at most ``limit + 1``: one more than the
    page, to know whether another follows): the job objects of at most ``limit`` of them, up to
    :data:`LIST_MAX_BYTES` of JSON, and ``next_before``, the last listed job's id when more
    jobs follow (a row was left out: beyond the limit, or the page was cut), else ``None``
    (a filter matching exactly ``limit`` jobs has no next page)."""
    jobs: list[dict[str, Any]] = []
    size = 0
    for row in rows[:limit]:
        job = payloads.job_object(row)
        size += len(payloads.encode(job))
        if jobs and size > LIST_MAX_BYTES:
            break  # the page ends here; next_before goes on from the last job listed
        jobs.append(job)
    more = len(jobs) < len(rows)
    return {"jobs": jobs, "next_before": jobs[-1]["job_id"] if jobs and more else None}


def checked_options(kind: Any, options: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """``options`` validated by ``kind``'s model and checks, as stored (defaults left out).
    Raises :class:`RequestError` naming the first wrong field (``options.<name>``), and the
    kind's options when the field is unknown."""
    try:
        parsed = kind.Options.model_validate(options)
        kind.check_options(parsed, settings)
        return dict(parsed.model_dump(mode="json", exclude_defaults=True))
    except ValidationError as e:
        err = e.errors()[0]
        field = "options." + ".".join(str(p) for p in err["loc"])
        message = f"{field}: {err['msg']}"
        if err["type"] == "extra_forbidden" and len(err["loc"]) == 1:
            known = ", ".join(sorted(kind.Options.model_fields)) or "none"
            message += f"; the options of {kind.name} are: {known}"
        raise RequestError(message, field=field) from e


class _AllRejected(RequestError):
    """Every input of a submit was rejected: the response is an error with the first code."""

    def __init__(self, rejected: list[dict[str, Any]]) -> None:
        first = rejected[0]
        msg = first["message"] if len(rejected) == 1 else f"all {len(rejected)} inputs were rejected"
        super().__init__(msg, code=ErrorCode(first["code"]), field="input")
        self.rejected = rejected


assert all(hasattr(Queue, c) for c in COMMANDS)
