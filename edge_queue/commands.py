"""Request commands (docs/topics.md, "Commands"): decode, execute against the store, build the response.

:meth:`Commands.execute` is the one place where request errors become error responses: every
request gets exactly one response, whatever its payload.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from . import payloads
from .browse import browse
from .config import Role
from .errors import EdgeQueueError, ErrorCode, InputError, NotFoundError, RequestError
from .states import ACTIVE, JobState, cancelled_error, is_terminal
from .store import JobSpec, LockHeld
from .topics import COMMANDS, valid_id

if TYPE_CHECKING:
    from .service import Service

#: Jobs one ``cancel`` (batch or all) or ``purge`` (older_than_s) request, or one retention
#: run, handles at most: one request cannot make one loop turn long. The response says
#: ``"more": true`` when some are left for the next request.
BULK_LIMIT = 5_000
#: Commands only the ``admin`` role may send (docs/configuration.md, "[access]").
ADMIN_COMMANDS = frozenset({"pause", "resume", "purge", "republish"})
#: Rejected requests logged per window at most (:class:`RejectionLog`).
REJECTIONS_LOGGED, REJECTION_WINDOW_S = 20, 10.0
#: A ``list`` page holds jobs up to this many bytes of JSON (and at least one): 500 jobs with
#: long inputs and transcripts would otherwise make one response of megabytes.
LIST_MAX_BYTES = 1 * 2**20

log = logging.getLogger(__name__)


def roots_text(media_roots: list[Path]) -> str:
    """The media roots as one short text for messages: ``/srv/media, /mnt/rec`` or ``none
    configured``."""
    return ", ".join(str(r) for r in media_roots) or "none configured"


def check_input(raw: str, media_roots: list[Path]) -> str:
    """Resolve ``raw`` (symlinks, ``..``) and confine it to ``media_roots`` (docs/topics.md, "`submit`").

    Returns the resolved absolute path. Raises :class:`InputError` with
    ``input_outside_media_roots`` (relative path, or outside every root; checked first, so
    the answer does not reveal which files exist outside the roots) or ``input_not_found``
    (missing, not a regular file, a real path that is not UTF-8 text, or any other error of
    the file system: a name too long, a folder the service may not enter).
    """
    where = roots_text(media_roots)
    if "\x00" in raw or not os.path.isabs(raw):
        raise InputError(
            f"input must be an absolute path inside media_roots ({where}): {raw[:200]!r}",
            code=ErrorCode.INPUT_OUTSIDE_MEDIA_ROOTS,
            field="input",
        )
    resolved = Path(os.path.realpath(raw))
    roots = [Path(os.path.realpath(r)) for r in media_roots]
    if not any(resolved == r or resolved.is_relative_to(r) for r in roots):
        raise InputError(
            f"{raw[:200]} is outside media_roots ({where}); the service's configuration sets them "
            "(media_roots, or --media-root of edge-queue up/serve)",
            code=ErrorCode.INPUT_OUTSIDE_MEDIA_ROOTS,
            field="input",
        )
    try:
        str(resolved).encode()
    except UnicodeEncodeError:
        # a link to a file or folder whose name is not UTF-8: the store, the job object and
        # MQTT carry text only (docs/topics.md, "`submit`")
        raise InputError(
            f"{raw[:200]} leads to a file whose path is not UTF-8 text; rename the file or folder "
            "(or link to it under a UTF-8 name: links are followed to the real path)",
            code=ErrorCode.INPUT_NOT_FOUND,
            field="input",
        ) from None
    try:
        is_file = stat.S_ISREG(os.stat(resolved).st_mode)
    except OSError as e:  # missing, a name too long, a folder the service may not enter, ...
        reason = f" ({os.strerror(e.errno).lower()})" if e.errno else ""
        raise InputError(
            f"{raw[:200]} does not exist, is not a file, or is not readable by the service{reason}",
            code=ErrorCode.INPUT_NOT_FOUND,
            field="input",
        ) from None
    if not is_file:
        raise InputError(
            f"{raw[:200]} does not exist, is not a file, or is not readable by the service",
            code=ErrorCode.INPUT_NOT_FOUND,
            field="input",
        )
    if (what := refers_to_other_files(resolved)) is not None:
        raise InputError(
            f"{raw[:200]} is {what}, which refers to other files: edge-queue opens single audio and video files only",
            code=ErrorCode.UNSUPPORTED_MEDIA,
            field="input",
        )
    return str(resolved)


#: Suffixes of playlists and lists that name other files or URLs (docs/topics.md, "Inputs").
_LIST_SUFFIXES = {
    ".m3u": "a playlist",
    ".m3u8": "an HLS playlist",
    ".pls": "a playlist",
    ".xspf": "a playlist",
    ".asx": "a playlist",
    ".wpl": "a playlist",
    ".mpd": "a DASH manifest",
    ".ffconcat": "an FFmpeg concat list",
    ".concat": "an FFmpeg concat list",
    ".sdp": "an SDP session description",
}
#: How such files start, whatever their name.
_LIST_MAGIC = (
    (b"#EXTM3U", "an HLS or M3U playlist"),
    (b"ffconcat version", "an FFmpeg concat list"),
    (b"[playlist]", "a playlist"),
    (b"v=0", "an SDP session description"),
)


def refers_to_other_files(path: Path) -> str | None:
    """What ``path`` is when it is a playlist, list or manifest that names other files or URLs
    (by its suffix, or by its first bytes), else ``None``. The worker's FFmpeg cannot open such
    files anyway (:data:`~edge_queue.kinds.media.SINGLE_FILE_DEMUXERS`); this refuses them at
    submit with a clear message."""
    if (what := _LIST_SUFFIXES.get(path.suffix.lower())) is not None:
        return what
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None  # the worker reports what it finds
    try:
        head = os.read(fd, 512).lstrip(b"\xef\xbb\xbf \t\r\n")
    except OSError:
        return None
    finally:
        os.close(fd)
    for magic, what in _LIST_MAGIC:
        if head.startswith(magic):
            return what
    if head.startswith(b"<") and (b"<MPD" in head or b"<smil" in head.lower()):
        return "an XML manifest"
    return None


class RejectionLog:
    """Log lines of one repeated kind (rejected requests, failed commits), at most
    :data:`REJECTIONS_LOGGED` per :data:`REJECTION_WINDOW_S` seconds: one client sending
    thousands of bad requests, or a full disk, cannot flood the journal. The ones left out are
    counted, and the count is logged in one line with the first line of a later window.

    Args:
        what: what is counted, for that line ("rejected request(s)").
        level: the ``logging`` level of every line.
        logger: where the lines go.
    """

    def __init__(
        self, what: str = "rejected request(s)", level: int = logging.WARNING, logger: logging.Logger = log
    ) -> None:
        self.what, self.level, self.logger = what, level, logger
        self.window_start = -REJECTION_WINDOW_S
        self.logged = 0
        self.left_out = 0

    def warning(self, message: str, *args: Any) -> None:
        """Log ``message % args`` at :attr:`level`, unless this window's lines are spent."""
        now = time.monotonic()
        if now - self.window_start >= REJECTION_WINDOW_S:
            if self.left_out:
                self.logger.log(
                    self.level, "%d more %s not logged in %.0f s", self.left_out, self.what, now - self.window_start
                )
            self.window_start, self.logged, self.left_out = now, 0, 0
        if self.logged < REJECTIONS_LOGGED:
            self.logged += 1
            self.logger.log(self.level, message, *args)
        else:
            self.left_out += 1


#: The service's log of rejected requests (see :class:`RejectionLog`).
rejections = RejectionLog()


class Commands:
    """The request handlers of one service."""

    def __init__(self, service: Service) -> None:
        self.service = service
        #: the request being executed: its sender (``None``: the shared request topics) ...
        self._user: str | None = None
        #: ... and, for the ``user`` role, the filter to its own jobs (``None``: every job)
        self._mine: tuple[str | None] | None = None

    def execute(
        self, command: str, raw: bytes, user: str | None = None, *, role: Role | None = None
    ) -> tuple[dict[str, Any], str | None]:
        """Run ``command`` with payload ``raw`` for ``user`` (the broker user of the request
        topic ``<base>/request/<command>/<user>``; ``None`` for ``<base>/request/<command>``);
        returns ``(response, reply_to)``.

        ``reply_to`` is the request's validated ``reply_to`` topic, or ``None``. What the
        sender's role (``access``, or ``role`` when given: the service's own requests, such as
        a watch folder's submits) does not allow is answered with ``forbidden``.
        """
        svc = self.service
        limit = svc.settings.max_payload_bytes
        if len(raw) > limit:
            # Refused before anything is parsed; nothing of it is echoed back.
            rejections.warning("request %s rejected: payload_too_large (%d bytes)", _clip(command, 64), len(raw))
            return payloads.error(
                ErrorCode.PAYLOAD_TOO_LARGE, f"payload is {len(raw)} bytes; the limit is {limit} (max_payload_bytes)"
            ), None
        # parsed once: for the envelope's checks here, and for the request's model below
        parsed = payloads.parse_object(raw)
        transaction, reply_to = payloads.envelope(parsed) if parsed is not None else payloads.peek_envelope(raw)
        # a reply_to that is there but not a usable string (a number, over 1,024 characters, a
        # lone surrogate) is as invalid as one outside the reply prefix: step 3 for both
        unusable = parsed is not None and parsed.get("reply_to") is not None and reply_to is None
        if unusable or (reply_to is not None and not svc.topics.valid_reply_to(reply_to, user)):
            rejections.warning("request %s rejected: invalid_request (reply_to)", _clip(command, 64))
            prefix = svc.topics.reply_prefix() if user is None else svc.topics.user_reply_prefix(user)
            return payloads.error(
                ErrorCode.INVALID_REQUEST,
                f"reply_to must be a topic name under {prefix}: a string of at most 1024 bytes of UTF-8, "
                "without wildcards, control characters or surrogates",
                transaction,
                "reply_to",
            ), None
        if parsed is not None and parsed.get("transaction") is not None and transaction is None:
            try:
                too_large = payloads.transaction_too_large(parsed["transaction"])
            except (TypeError, ValueError, RecursionError):
                too_large = False
            if too_large:  # docs/topics.md, "Order of checks": with reply_to, before the command
                rejections.warning("request %s rejected: invalid_request (transaction)", _clip(command, 64))
                return payloads.error(
                    ErrorCode.INVALID_REQUEST,
                    f"transaction must encode to at most {payloads.MAX_TRANSACTION_BYTES} bytes of JSON (UTF-8); "
                    "it is not echoed back",
                    None,
                    "transaction",
                ), reply_to
        role = role or svc.settings.access.role_of(user)
        if role == "none" or (role == "user" and command in ADMIN_COMMANDS):
            who = "requests on the shared topics" if user is None else f"user {_clip(user, 64)!r}"
            rejections.warning("request %s rejected: forbidden (%s, role %s)", _clip(command, 64), who, role)
            return payloads.error(
                ErrorCode.FORBIDDEN,
                f"{who} (role {role}) may not send {_clip(command, 64)}; the service's access settings give roles",
                transaction,
            ), reply_to
        self._user = user
        self._mine = (user,) if role == "user" else None
        try:
            request = payloads.decode_request(
                command,
                raw,
                max_bytes=svc.settings.max_payload_bytes,
                default_kind=svc.settings.default_kind,
                parsed=parsed,
            )
            transaction = request.transaction
            data = getattr(self, f"do_{command}")(request)
            return payloads.ok(data, transaction), reply_to
        except RequestError as e:
            rejections.warning("request %s rejected: %s: %s", _clip(command, 64), e.code, _clip(e.message))
            resp = payloads.error(e.code, e.message, transaction, e.field)
            if isinstance(e, _AllRejected):
                resp["error"]["rejected"] = e.rejected
            return resp, reply_to
        except EdgeQueueError as e:
            log.warning("request %s failed: %s: %s", _clip(command, 64), e.code, _clip(e.message))
            return payloads.error(e.code, e.message, transaction), reply_to
        except sqlite3.Error:
            raise  # the store failed (a full disk): the whole turn is answered (Service.tick)
        except Exception as e:  # a bug must cost one response, not the service
            log.exception("request %s: internal error", _clip(command, 64))
            return payloads.error(ErrorCode.INTERNAL_ERROR, f"{type(e).__name__}: {e}", transaction), reply_to

    # -- submit -------------------------------------------------------------------------

    def do_submit(self, req: payloads.SubmitRequest) -> dict[str, Any]:
        svc = self.service
        assert req.kind is not None
        if req.idempotency_key is not None:
            # A key already used returns the first submit's jobs whatever the rest of this
            # payload says: a client resending after a lost response gets them even when its
            # file is gone since, the queue is full or the kind was removed (docs/topics.md,
            # "Duplicates").
            found = svc._store().submitted_with(req.idempotency_key, self._user)
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
        try:
            parsed = kind.Options.model_validate(req.options)
            kind.check_options(parsed, svc.settings)
            options = parsed.model_dump(mode="json", exclude_defaults=True)
        except ValidationError as e:
            err = e.errors()[0]
            field = "options." + ".".join(str(p) for p in err["loc"])
            message = f"{field}: {err['msg']}"
            if err["type"] == "extra_forbidden" and len(err["loc"]) == 1:
                known = ", ".join(sorted(kind.Options.model_fields)) or "none"
                message += f"; the options of {kind.name} are: {known}"
            raise RequestError(message, field=field) from e
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
        if why := svc.disk_full():
            raise RequestError(why, code=ErrorCode.DISK_FULL)
        waiting = svc._store().waiting()
        if waiting + len(raw_inputs) > limits.max_queued_jobs:
            raise RequestError(
                f"{waiting} job(s) waiting to run; the queue holds at most {limits.max_queued_jobs} "
                "(limits.max_queued_jobs): submit again later",
                code=ErrorCode.QUEUE_FULL,
            )
        own_limit = limits.max_queued_jobs_per_user
        if self._mine is not None and own_limit:
            mine = svc._store().waiting_of(self._user)
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
        svc.turn_work += len(raw_inputs)
        for raw in raw_inputs:
            try:
                path = check_input(raw, svc.settings.media_roots) if kind.needs_input and raw else raw
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
                    submitted_by=self._user,
                )
            )
        if not specs:
            raise _AllRejected(rejected)
        try:
            batch_id, created = svc._store().submit(
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

    # -- job control --------------------------------------------------------------------

    def _job(self, job_id: str) -> dict[str, Any]:
        """The job ``job_id``; raises ``not_found``, or ``forbidden`` when the sender's role
        (``user``) may not touch another sender's job."""
        if not valid_id(job_id):
            raise NotFoundError(f"no job {job_id[:64]!r}")
        job = self.service._store().get(job_id)
        if not self._may_touch(job):
            raise RequestError(f"job {job_id} was submitted by another user", code=ErrorCode.FORBIDDEN, field="job_id")
        return job

    def _may_touch(self, job: dict[str, Any]) -> bool:
        return self._mine is None or job.get("submitted_by") == self._mine[0]

    def do_get(self, req: payloads.GetRequest) -> dict[str, Any]:
        job = payloads.job_object(self._job(req.job_id))
        result = job.get("result") or {}
        txt = (result.get("outputs") or {}).get("txt")
        if result.get("text_truncated") and txt and os.path.isfile(txt):
            with open(txt, encoding="utf-8") as fh:
                job["result"] = {
                    **result,
                    "text": " ".join(line.strip() for line in fh).strip(),
                    "text_truncated": False,
                }
        if req.segments and isinstance(job.get("result"), dict):
            job["result"] = {**job["result"], **transcript_segments(result.get("outputs") or {})}
        return job

    def do_browse(self, req: payloads.BrowseRequest) -> dict[str, Any]:
        """A page of a folder inside the media roots, or the roots (:func:`.browse.browse`)."""
        return browse(req.path, self.service.settings.media_roots, limit=req.limit, after=req.after)

    def do_list(self, req: payloads.ListRequest) -> dict[str, Any]:
        if req.state is not None and req.state not in {s.value for s in JobState}:
            raise RequestError(f"unknown state {req.state[:32]!r}", field="state")
        rows = self.service._store().list_jobs(
            state=req.state,
            kind=req.kind,
            batch_id=req.batch_id,
            before=req.before,
            limit=req.limit,
            lock_key=req.lock_key,
            submitted_by=self._mine,
        )
        jobs: list[dict[str, Any]] = []
        size = 0
        for row in rows:
            job = payloads.job_object(row)
            size += len(payloads.encode(job))
            if jobs and size > LIST_MAX_BYTES:
                break  # the page ends here; next_before goes on from the last job listed
            jobs.append(job)
        full = len(jobs) == req.limit or len(jobs) < len(rows)
        return {"jobs": jobs, "next_before": jobs[-1]["job_id"] if jobs and full else None}

    def do_cancel(self, req: payloads.CancelRequest) -> dict[str, Any]:
        svc, store = self.service, self.service._store()
        chosen = sum(x is not None for x in (req.job_id, req.batch_id, req.running or None, req.all or None))
        if chosen != 1:
            raise RequestError("give exactly one of job_id, batch_id, running: true, all: true", field="job_id")
        if req.job_id is not None:
            job = self._job(req.job_id)
            if is_terminal(job["state"]):
                raise RequestError(
                    f"job {req.job_id} is already {job['state']}", code=ErrorCode.CONFLICT, field="job_id"
                )
            targets = [req.job_id]
        elif req.batch_id is not None:
            if not valid_id(req.batch_id):
                raise NotFoundError(f"no batch {req.batch_id[:64]!r}")
            targets = store.batch(req.batch_id)["job_ids"]
            if self._mine is not None and targets and not self._may_touch(store.get(targets[0])):
                raise RequestError(
                    f"batch {req.batch_id} was submitted by another user", code=ErrorCode.FORBIDDEN, field="batch_id"
                )
        elif req.running:
            targets = [
                j["job_id"]
                for j in store.list_jobs(state=JobState.RUNNING.value, limit=BULK_LIMIT + 1, submitted_by=self._mine)
            ]
        else:
            targets = [
                j["job_id"]
                for s in ACTIVE
                for j in store.list_jobs(state=s.value, limit=BULK_LIMIT + 1, submitted_by=self._mine)
            ]
        more = len(targets) > BULK_LIMIT
        targets = targets[:BULK_LIMIT]
        svc.turn_work += len(targets)
        cancelled, cancelling = [], []
        now = svc.clock()
        for job_id in targets:
            job = store.get(job_id)
            state = JobState(job["state"])
            if state in (JobState.QUEUED, JobState.RETRYING):
                job = store.transition(
                    job_id,
                    JobState.CANCELLED,
                    now,
                    detail={"reason": "cancel"},
                    error=cancelled_error(),
                )
                cancelled.append(job_id)
            elif state == JobState.RUNNING:
                job = store.transition(job_id, JobState.CANCELLING, now, detail={"reason": "cancel"})
                svc.supervisor.cancel(job_id, svc.settings.cancel_grace_s)
                cancelling.append(job_id)
            else:
                continue
            log.info("job %s %s by request", job_id, job["state"])
            svc.publish_job(job)
        return {"cancelled": cancelled, "cancelling": cancelling, "more": more}

    def do_retry(self, req: payloads.RetryRequest) -> dict[str, Any]:
        svc = self.service
        if (req.job_id is None) == (not req.failed):
            raise RequestError("give exactly one of job_id, failed: true", field="job_id")
        if req.job_id is None:  # every failed job, up to BULK_LIMIT
            failed = svc._store().list_jobs(state=JobState.FAILED.value, limit=BULK_LIMIT + 1, submitted_by=self._mine)
            svc.turn_work += min(len(failed), BULK_LIMIT)
            retried = [self._retry(j["job_id"])["job_id"] for j in reversed(failed[:BULK_LIMIT])]
            return {"retried": retried, "more": len(failed) > BULK_LIMIT}
        job = self._job(req.job_id)
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
        job = svc._store().transition(
            job_id,
            JobState.QUEUED,
            svc.clock(),
            detail={"reason": "retry"},
            attempt=0,
            crashes=0,
            error=None,
            result=None,
            progress=0.0,
            stage=None,
            eta_s=None,
            started_at=None,
            retry_at=None,
        )
        svc.publish_job(job)
        return job

    def do_pause(self, req: payloads.PauseRequest) -> dict[str, Any]:
        self.service.set_paused(req.paused)
        return {"paused": req.paused}

    def do_resume(self, req: payloads.EmptyRequest) -> dict[str, Any]:
        self.service.set_paused(False)
        return {"paused": False}

    def do_purge(self, req: payloads.PurgeRequest) -> dict[str, Any]:
        svc, store = self.service, self.service._store()
        if (req.job_id is None) == (req.older_than_s is None):
            raise RequestError("give either job_id or older_than_s", field="job_id")
        if req.job_id is not None:
            job = self._job(req.job_id)
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
        svc.turn_work += min(len(ids), BULK_LIMIT)
        return {"purged": svc.purge(ids[:BULK_LIMIT]), "more": more}

    def do_republish(self, req: payloads.EmptyRequest) -> dict[str, Any]:
        started = self.service.republish()
        return {"republished": True, "already_running": not started}

    def do_events(self, req: payloads.EventsRequest) -> dict[str, Any]:
        """The event cursor: the state changes after ``after``, with ``next_after`` to ask for
        next, the oldest ``event_id`` still kept, and ``dropped`` when events after the cursor
        were deleted before they were read (docs/topics.md, ``events``)."""
        store = self.service._store()
        events, oldest, dropped = store.events_after(
            req.after, req.limit, job_id=req.job_id, types=req.types, submitted_by=self._mine
        )
        if len(events) == req.limit:
            next_after = events[-1]["event_id"]
        else:  # everything up to the newest event was looked at
            newest = store.conn.execute("SELECT max(id) FROM job_events").fetchone()[0] or 0
            next_after = max(req.after, events[-1]["event_id"] if events else 0, newest)
        return {"events": events, "next_after": next_after, "oldest_event_id": oldest, "dropped": dropped}

    def do_kinds(self, req: payloads.EmptyRequest) -> dict[str, Any]:
        """Every job kind with the JSON Schema of its options (``<base>/info`` names the
        options only, so that it stays small)."""
        return {
            "kinds": {
                name: {"description": k.description, "needs_input": k.needs_input, "options": k.schema()}
                for name, k in self.service.kinds.items()
            }
        }


#: ``get`` with ``segments``: at most this many bytes of segment text are returned.
SEGMENTS_MAX_BYTES = 1 * 2**20


def transcript_segments(outputs: dict[str, Any]) -> dict[str, Any]:
    """``{"segment_list": [{"start", "end", "text"}], "segment_list_truncated": bool}`` from a
    transcription's ``json`` output (times in seconds), or ``{}`` when it wrote none or the file
    cannot be read. At most :data:`SEGMENTS_MAX_BYTES` of text (and at least one segment)."""
    path = outputs.get("json")
    if not isinstance(path, str) or not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            segments = json.load(fh).get("segments") or []
    except (OSError, ValueError, AttributeError):
        return {}
    out: list[dict[str, Any]] = []
    size = 0
    for s in segments:
        size += len(str(s.get("text", ""))) + 32
        if out and size > SEGMENTS_MAX_BYTES:
            break
        out.append({"start": s.get("start"), "end": s.get("end"), "text": str(s.get("text", "")).strip()})
    return {"segment_list": out, "segment_list_truncated": len(out) < len(segments)}


def _clip(text: str, n: int = 200) -> str:
    """Client text for a log line: one line (escaped), at most ``n`` characters."""
    return text[:n].encode("unicode_escape").decode("ascii")


class _AllRejected(RequestError):
    """Every input of a submit was rejected: the response is an error with the first code."""

    def __init__(self, rejected: list[dict[str, Any]]) -> None:
        first = rejected[0]
        msg = first["message"] if len(rejected) == 1 else f"all {len(rejected)} inputs were rejected"
        super().__init__(msg, code=ErrorCode(first["code"]), field="input")
        self.rejected = rejected


assert all(hasattr(Commands, f"do_{c}") for c in COMMANDS)
