"""Wire payloads, version 1 (docs/topics.md): requests in, responses and state out.

Requests are decoded and validated at the edge with pydantic (``extra="forbid"``); a failure
raises :class:`RequestError` with the code (``invalid_json``, ``invalid_request``,
``payload_too_large``) and, for a bad field, its name. Outgoing payloads are plain dicts that
always carry ``"v": 1``.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from edge_queue.errors import ErrorCode, RequestError

VERSION = 1

JsonValue = Any


#: The latest ``run_at`` (9999-12-30T00:00:00Z, in seconds since the epoch): a day short of
#: the end of what ``datetime`` represents, so no time computed from it overflows.
MAX_RUN_AT = 253_402_128_000.0
#: A ``transaction`` is echoed in the response; its JSON may be at most this many bytes.
MAX_TRANSACTION_BYTES = 1024


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    transaction: JsonValue = None
    reply_to: str | None = Field(None, max_length=1024)

    @field_validator("transaction")
    @classmethod
    def _transaction(cls, v: JsonValue) -> JsonValue:
        if v is not None and transaction_too_large(v):
            raise ValueError(f"transaction must encode to at most {MAX_TRANSACTION_BYTES} bytes of JSON")
        return v


def _rfc3339(text: str) -> datetime:
    """``datetime.fromisoformat`` of an RFC 3339 timestamp, with the lower-case ``t`` and ``z``
    that RFC 3339 section 5.6 allows. Raises ``ValueError``."""
    return datetime.fromisoformat(text.upper().replace("Z", "+00:00"))


def transaction_too_large(value: Any) -> bool:
    """True when ``value`` as compact JSON takes more than :data:`MAX_TRANSACTION_BYTES` bytes
    of UTF-8 (a character outside ASCII counts its UTF-8 bytes, not a ``\\u`` escape).
    Raises ``TypeError``/``ValueError``/``RecursionError`` for what is not JSON."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return len(text) > MAX_TRANSACTION_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_TRANSACTION_BYTES


class SubmitRequest(_Request):
    """``submit``: one job per input; several inputs make a batch."""

    kind: str | None = Field(None, min_length=1, max_length=64)
    input: str | None = Field(None, min_length=1, max_length=4096)
    inputs: list[str] | None = Field(None, min_length=1, max_length=10_000)
    options: dict[str, Any] = Field(default_factory=dict)  # (a plain {} default is deep-copied per request)
    priority: int = Field(0, ge=-100, le=100)
    idempotency_key: str | None = Field(None, min_length=1, max_length=200, pattern=r"^[^\x00]+$")
    max_attempts: int | None = Field(None, ge=1, le=100)
    timeout_s: float | None = Field(None, gt=0, le=7 * 86400)
    run_at: str | None = None
    lock_key: str | None = Field(None, min_length=1, max_length=200)
    on_lock: Literal["reject", "wait"] = "reject"

    @field_validator("inputs")
    @classmethod
    def _inputs(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(not s or len(s) > 4096 for s in v):
            raise ValueError("every input must be a non-empty path of at most 4096 characters")
        return v

    @field_validator("run_at")
    @classmethod
    def _run_at(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                parsed = _rfc3339(v)
            except ValueError as e:
                raise ValueError("run_at must be an RFC 3339 timestamp") from e
            if parsed.tzinfo is None:
                raise ValueError("run_at must carry a time zone (e.g. Z)")
            try:
                if not 0 <= parsed.timestamp() <= MAX_RUN_AT:
                    raise OverflowError
            except (OverflowError, ValueError, OSError) as e:
                raise ValueError("run_at must be between 1970-01-01 and 9999-12-30 (UTC)") from e
        return v

    def run_at_ts(self) -> float | None:
        if self.run_at is None:
            return None
        return _rfc3339(self.run_at).timestamp()

    def input_list(self) -> list[str | None]:
        if self.input is not None and self.inputs is not None:
            raise RequestError("give either input or inputs, not both", field="inputs")
        if self.inputs is not None:
            return list(self.inputs)
        return [self.input]


class JobRef(_Request):
    """One job, by its id."""

    job_id: str = Field(min_length=1, max_length=64)


class GetRequest(JobRef):
    """``get``: one job; ``segments`` adds the transcript's segments with their times."""

    segments: bool = False


class CancelRequest(_Request):
    """``cancel``: exactly one of ``job_id``, ``batch_id``, ``running: true``, ``all: true``."""

    job_id: str | None = Field(None, min_length=1, max_length=64)
    batch_id: str | None = Field(None, min_length=1, max_length=64)
    running: bool = False
    all: bool = False


class RetryRequest(_Request):
    """``retry``: one job (``job_id``), or every failed job (``failed: true``)."""

    job_id: str | None = Field(None, min_length=1, max_length=64)
    failed: bool = False


class PauseRequest(_Request):
    """``pause``: ``paused`` false resumes (one command topic for a Home Assistant switch)."""

    paused: bool = True


class ListRequest(_Request):
    """``list``: newest first, ``limit`` 1-500 (default 50), ``before`` a job id to page past."""

    state: str | None = None
    kind: str | None = Field(None, max_length=64)
    batch_id: str | None = Field(None, max_length=64)
    limit: int = Field(50, ge=1, le=500)
    before: str | None = Field(None, max_length=64)
    lock_key: str | None = Field(None, min_length=1, max_length=200)
    #: only jobs whose input path holds this text (ASCII letters in any case)
    input_contains: str | None = Field(None, min_length=1, max_length=200)
    #: true: the response also says how many jobs match, on every page (``total``)
    count: bool = False


class EventsRequest(_Request):
    """``events``: the event log after the cursor ``after`` (an ``event_id``; 0: from the
    start), oldest first, at most ``limit`` (1-500, default 500), optionally of one job and of
    some event types."""

    after: int = Field(0, ge=0, le=2**63 - 1)
    limit: int = Field(500, ge=1, le=500)
    job_id: str | None = Field(None, min_length=1, max_length=64)
    types: list[Literal["new", "update", "end"]] | None = Field(None, min_length=1, max_length=3)


class PurgeRequest(_Request):
    """``purge``: one terminal job, or terminal jobs older than ``older_than_s`` in ``states``."""

    job_id: str | None = Field(None, min_length=1, max_length=64)
    older_than_s: float | None = Field(None, ge=0, le=100 * 365 * 86400)
    # at least one: an empty list must not mean "every state" for a command that deletes
    states: list[Literal["succeeded", "failed", "cancelled"]] | None = Field(None, min_length=1, max_length=3)


class BrowseRequest(_Request):
    """``browse``: one page of a folder inside the media roots (``path``; none: the roots),
    ``limit`` entries (1-1000, default 200) after the name ``after``."""

    path: str | None = Field(None, min_length=1, max_length=4096)
    limit: int = Field(200, ge=1, le=1000)
    #: "" (the ``next_after`` of an answer while the folder is being read): from the start
    after: str | None = Field(None, max_length=4096)


class EmptyRequest(_Request):
    """``pause``, ``resume``, ``republish``, ``kinds``: no fields but ``transaction``/``reply_to``."""


REQUEST_MODELS: dict[str, type[_Request]] = {
    "submit": SubmitRequest,
    "cancel": CancelRequest,
    "retry": RetryRequest,
    "get": GetRequest,
    "list": ListRequest,
    "pause": PauseRequest,
    "resume": EmptyRequest,
    "purge": PurgeRequest,
    "republish": EmptyRequest,
    "kinds": EmptyRequest,
    "events": EventsRequest,
    "browse": BrowseRequest,
}


def _unicode(value: JsonValue) -> bool:
    """True when ``value`` (decoded JSON) holds only Unicode text: JSON's ``\\ud800``-style
    escapes can make lone surrogates, which no UTF-8 encoder (nor MQTT) accepts."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    except (TypeError, ValueError, RecursionError):
        return False
    return True


def peek_envelope(raw: bytes) -> tuple[JsonValue, str | None]:
    """Best-effort ``(transaction, reply_to)`` of a raw request, for error responses.

    Either is ``None`` when absent, unreadable, too large to echo, or not Unicode text."""
    if b"reply_to" not in raw and b"transaction" not in raw and b"\\u" not in raw:
        # neither key is there (a key could only be spelt otherwise with \u escapes): the
        # usual request is not parsed twice
        return None, None
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None, None
    return envelope(data)


def envelope(data: Any) -> tuple[JsonValue, str | None]:
    """``(transaction, reply_to)`` of a request already parsed (:func:`parse_object`), with
    the rules of :func:`peek_envelope`."""
    if not isinstance(data, dict):
        return None, None
    reply_to = data.get("reply_to")
    transaction = data.get("transaction")
    try:
        if transaction_too_large(transaction):
            transaction = None  # too large to echo back
    except (TypeError, ValueError, RecursionError):
        transaction = None
    if not _unicode(transaction):
        transaction = None
    if not isinstance(reply_to, str) or len(reply_to) > 1024 or not _unicode(reply_to):
        reply_to = None
    return transaction, reply_to


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:32]} is out of range")
    return value


#: json.loads(..., parse_constant=_no_constant, parse_float=_finite) with one decoder for every call
_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite)


def parse_object(raw: bytes) -> dict[str, Any] | None:
    """The JSON object a request payload holds, read as :func:`decode_request` reads it
    (UTF-8, a byte-order mark and white space around it ignored, no ``NaN``, no number out of
    range), or ``None`` when the payload is anything else: :func:`decode_request` then says
    why. Parsed once, it serves both :func:`envelope` and :func:`decode_request`."""
    try:
        stripped = raw.decode("utf-8").removeprefix("\ufeff").strip()
    except UnicodeDecodeError:
        return None
    if not stripped.startswith("{"):
        return None
    try:
        data = _DECODER.decode(stripped)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def decode_request(
    command: str, raw: bytes, *, max_bytes: int, default_kind: str, parsed: dict[str, Any] | None = None
) -> _Request:
    """Decode the payload of ``<base>/request/<command>`` into its request model.

    A ``submit`` payload that does not start with ``{``, ``[`` or ``"`` is a bare path; a JSON
    string is one path and a JSON array of strings is a batch, each of kind ``default_kind``.

    ``parsed``: the payload's object as :func:`parse_object` returned it, not parsed again.

    Raises :class:`RequestError` with code ``payload_too_large`` (over ``max_bytes``),
    ``invalid_json`` (not UTF-8 JSON), ``unknown_command`` or ``invalid_request`` (the
    offending field in ``field`` and the message).
    """
    if len(raw) > max_bytes:
        raise RequestError(f"payload is {len(raw)} bytes; the limit is {max_bytes}", code=ErrorCode.PAYLOAD_TOO_LARGE)
    model = REQUEST_MODELS.get(command)
    if model is None:
        raise RequestError(f"unknown command {command[:64]!r}", code=ErrorCode.UNKNOWN_COMMAND)
    if parsed is not None:
        data: Any = parsed
        escapes = b"\\u" in raw
    else:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"payload is not UTF-8: {e}", code=ErrorCode.INVALID_JSON) from e
        # a UTF-8 byte-order mark (Windows tools write one) is not part of the request
        stripped = text.removeprefix("\ufeff").strip()
        if command == "submit" and stripped and stripped[0] not in '{["':
            return SubmitRequest(kind=default_kind, input=stripped)
        if not stripped and command == "pause":
            return PauseRequest()
        if not stripped and command in ("resume", "republish", "kinds"):
            return EmptyRequest()
        if not stripped and command == "browse":
            return BrowseRequest()
        try:
            data = _DECODER.decode(stripped)
        except ValueError as e:
            raise RequestError(f"payload is not valid JSON: {e}", code=ErrorCode.INVALID_JSON) from e
        except RecursionError as e:
            raise RequestError("payload is nested too deeply", code=ErrorCode.INVALID_JSON) from e
        if command == "submit" and isinstance(data, str):
            data = {"input": data}
        elif command == "submit" and isinstance(data, list):
            data = {"inputs": data}
        escapes = "\\u" in stripped
    if not isinstance(data, dict):
        raise RequestError("payload must be a JSON object", field="(root)")
    if escapes and not _unicode(data):
        raise RequestError(
            "payload holds a lone surrogate escape (such as \\ud800), which is not a Unicode character",
            field="(root)",
        )
    try:
        request = model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "(root)"
        more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
        raise RequestError(f"{field}: {err['msg']}{more}", field=field) from e
    if isinstance(request, SubmitRequest) and request.kind is None:
        request = request.model_copy(update={"kind": default_kind})
    return request


def ok(data: dict[str, Any], transaction: JsonValue = None) -> dict[str, Any]:
    """A success response: ``{"v": 1, "status": "ok", "data": ..., "transaction": ...}``."""
    return {"v": VERSION, "status": "ok", "data": data, "transaction": transaction}


def error(
    code: ErrorCode | str, message: str, transaction: JsonValue = None, field: str | None = None
) -> dict[str, Any]:
    """An error response with ``error.code`` from the closed vocabulary (docs/topics.md, "Error codes")."""
    err: dict[str, Any] = {"code": str(code), "message": message}
    if field:
        err["field"] = field
    return {"v": VERSION, "status": "error", "error": err, "transaction": transaction}


_JOB_FIELDS = (
    "job_id",
    "seq",
    "kind",
    "input",
    "options",
    "batch_id",
    "priority",
    "state",
    "stage",
    "progress",
    "eta_s",
    "attempt",
    "max_attempts",
    "retry_at",
    "error",
    "result",
    "created_at",
    "started_at",
    "finished_at",
    "updated_at",
    "lock_key",
    "submitted_by",
)


def job_object(row: dict[str, Any]) -> dict[str, Any]:
    """The job object of docs/topics.md, "The job object", from a store row."""
    obj: dict[str, Any] = {"v": VERSION}
    for key in _JOB_FIELDS:
        obj[key] = row.get(key)
    if obj["progress"] is not None:
        obj["progress"] = round(float(obj["progress"]), 1)
    if obj["eta_s"] is not None:
        obj["eta_s"] = round(float(obj["eta_s"]))
    # where the attempt runs or ran: a worker node's id, "hub" for the hub's own workers
    owner = row.get("owner")
    obj["node"] = None if not owner else owner[5:] if owner.startswith("node:") else "hub"
    return obj


def batch_object(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch object: ``batch_id``, ``total``, ``counts`` per state, ``done``, ``job_ids``."""
    return {
        "v": VERSION,
        "batch_id": batch["batch_id"],
        "total": batch["total"],
        "counts": batch["counts"],
        "done": batch["done"],
        "job_ids": batch["job_ids"],
        "created_at": batch["created_at"],
        "updated_at": batch["updated_at"],
    }


def encode(payload: dict[str, Any]) -> bytes:
    """Compact UTF-8 JSON (orjson: job objects are encoded once per state change, so this is on
    the service's hot path). Text that is not Unicode (a file name that is not UTF-8, kept by
    Python as lone surrogates) is written as JSON ``\\udcxx`` escapes rather than failing, and so
    is what orjson does not take (an integer over 64 bits)."""
    try:
        return orjson.dumps(payload)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return json.dumps(payload, separators=(",", ":")).encode()
