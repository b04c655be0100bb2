"""The queue's typed requests (docs/topics.md, "Commands"): one pydantic model per command,
validated with ``extra="forbid"``, and the decoding of a request payload into its model.

Every intake builds these: MQTT dispatch from a payload (:func:`decode_request`), the HTTP API
and the watch folders from their own fields. A failure raises :class:`RequestError` with the
code (``invalid_json``, ``invalid_request``, ``payload_too_large``, ``unknown_command``) and,
for a bad field, its name.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from edge_queue.errors import ErrorCode, RequestError
from edge_queue.mqtt.payloads import (
    JSON_DECODER,
    MAX_TRANSACTION_BYTES,
    JsonValue,
    is_unicode,
    transaction_too_large,
)

#: The latest ``run_at`` (9999-12-30T00:00:00Z, in seconds since the epoch): a day short of
#: the end of what ``datetime`` represents, so no time computed from it overflows.
MAX_RUN_AT = 253_402_128_000.0


class Request(BaseModel):
    """What every request may carry: ``transaction`` (echoed back) and ``reply_to``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    transaction: JsonValue = None
    reply_to: str | None = Field(None, max_length=1024)

    @field_validator("transaction")
    @classmethod
    def _transaction(cls, v: JsonValue) -> JsonValue:
        if v is not None and transaction_too_large(v):
            raise ValueError(f"transaction must encode to at most {MAX_TRANSACTION_BYTES} bytes of JSON")
        return v


def rfc3339(text: str) -> datetime:
    """``datetime.fromisoformat`` of an RFC 3339 timestamp, with the lower-case ``t`` and ``z``
    that RFC 3339 section 5.6 allows. Raises ``ValueError``."""
    return datetime.fromisoformat(text.upper().replace("Z", "+00:00"))


class SubmitRequest(Request):
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
                parsed = rfc3339(v)
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
        return rfc3339(self.run_at).timestamp()

    def input_list(self) -> list[str | None]:
        if self.input is not None and self.inputs is not None:
            raise RequestError("give either input or inputs, not both", field="inputs")
        if self.inputs is not None:
            return list(self.inputs)
        return [self.input]


class JobRef(Request):
    """One job, by its id."""

    job_id: str = Field(min_length=1, max_length=64)


class GetRequest(JobRef):
    """``get``: one job; ``segments`` adds the transcript's segments with their times."""

    segments: bool = False


class CancelRequest(Request):
    """``cancel``: exactly one of ``job_id``, ``batch_id``, ``running: true``, ``all: true``."""

    job_id: str | None = Field(None, min_length=1, max_length=64)
    batch_id: str | None = Field(None, min_length=1, max_length=64)
    running: bool = False
    all: bool = False


class RetryRequest(Request):
    """``retry``: one job (``job_id``), or every failed job (``failed: true``)."""

    job_id: str | None = Field(None, min_length=1, max_length=64)
    failed: bool = False


class PauseRequest(Request):
    """``pause``: ``paused`` false resumes (one command topic for a Home Assistant switch)."""

    paused: bool = True


class ListRequest(Request):
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


class EventsRequest(Request):
    """``events``: the event log after the cursor ``after`` (an ``event_id``; 0: from the
    start), oldest first, at most ``limit`` (1-500, default 500), optionally of one job and of
    some event types."""

    after: int = Field(0, ge=0, le=2**63 - 1)
    limit: int = Field(500, ge=1, le=500)
    job_id: str | None = Field(None, min_length=1, max_length=64)
    types: list[Literal["new", "update", "end"]] | None = Field(None, min_length=1, max_length=3)


class PurgeRequest(Request):
    """``purge``: one terminal job, or terminal jobs older than ``older_than_s`` in ``states``."""

    job_id: str | None = Field(None, min_length=1, max_length=64)
    older_than_s: float | None = Field(None, ge=0, le=100 * 365 * 86400)
    # at least one: an empty list must not mean "every state" for a command that deletes
    states: list[Literal["succeeded", "failed", "cancelled"]] | None = Field(None, min_length=1, max_length=3)


class BrowseRequest(Request):
    """``browse``: one page of a folder inside the media roots (``path``; none: the roots),
    ``limit`` entries (1-1000, default 200) after the name ``after``."""

    path: str | None = Field(None, min_length=1, max_length=4096)
    limit: int = Field(200, ge=1, le=1000)
    #: "" (the ``next_after`` of an answer while the folder is being read): from the start
    after: str | None = Field(None, max_length=4096)


class EmptyRequest(Request):
    """``pause``, ``resume``, ``republish``, ``kinds``: no fields but ``transaction``/``reply_to``."""


REQUEST_MODELS: dict[str, type[Request]] = {
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


def decode_request(
    command: str, raw: bytes, *, max_bytes: int, default_kind: str, parsed: dict[str, Any] | None = None
) -> Request:
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
            data = JSON_DECODER.decode(stripped)
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
    if escapes and not is_unicode(data):
        raise RequestError(
            "payload holds a lone surrogate escape (such as \\ud800), which is not a Unicode character",
            field="(root)",
        )
    return _validated(model, data, default_kind)


def validated(command: str, data: dict[str, Any], *, default_kind: str) -> Request:
    """An intake's own fields ``data`` as the request model of ``command`` (a submit without a
    kind gets ``default_kind``). Raises :class:`RequestError` as :func:`decode_request` does:
    ``unknown_command``, or ``invalid_request`` naming the field (text that is not Unicode:
    ``(root)``)."""
    model = REQUEST_MODELS.get(command)
    if model is None:
        raise RequestError(f"unknown command {command[:64]!r}", code=ErrorCode.UNKNOWN_COMMAND)
    if not is_unicode(data):
        raise RequestError("the request holds text that is not Unicode (a lone surrogate)", field="(root)")
    return _validated(model, data, default_kind)


def _validated(model: type[Request], data: dict[str, Any], default_kind: str) -> Request:
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
