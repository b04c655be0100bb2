"""Wire payloads, version 1 (docs/topics.md): a request's envelope in, responses and state out.

A request payload's JSON is read here (:func:`parse_object`, :data:`JSON_DECODER`) and its
envelope (``transaction``, ``reply_to``) taken from it; the request models themselves and their
validation are the queue's (:mod:`edge_queue.requests.models`). Outgoing payloads are plain
dicts that always carry ``"v": 1``.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from edge_queue.errors import ErrorCode

VERSION = 1

JsonValue = Any


#: A ``transaction`` is echoed in the response; its JSON may be at most this many bytes.
MAX_TRANSACTION_BYTES = 1024


def transaction_too_large(value: Any) -> bool:
    """True when ``value`` as compact JSON takes more than :data:`MAX_TRANSACTION_BYTES` bytes
    of UTF-8 (a character outside ASCII counts its UTF-8 bytes, not a ``\\u`` escape).
    Raises ``TypeError``/``ValueError``/``RecursionError`` for what is not JSON."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return len(text) > MAX_TRANSACTION_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_TRANSACTION_BYTES


def is_unicode(value: JsonValue) -> bool:
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
    if transaction is not None:  # (most requests have none: nothing to encode)
        try:
            if transaction_too_large(transaction):
                transaction = None  # too large to echo back
        except (TypeError, ValueError, RecursionError):
            transaction = None
        if not is_unicode(transaction):
            transaction = None
    if not isinstance(reply_to, str) or len(reply_to) > 1024 or not is_unicode(reply_to):
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
#: (a request's JSON: no ``NaN``, no number out of range)
JSON_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite)


def parse_object(raw: bytes) -> dict[str, Any] | None:
    """The JSON object a request payload holds, read as :func:`~edge_queue.requests.models.decode_request` reads it
    (UTF-8, a byte-order mark and white space around it ignored, no ``NaN``, no number out of
    range), or ``None`` when the payload is anything else: :func:`~edge_queue.requests.models.decode_request` then says
    why. Parsed once, it serves both :func:`envelope` and :func:`~edge_queue.requests.models.decode_request`."""
    try:
        stripped = raw.decode("utf-8").removeprefix("\ufeff").strip()
    except UnicodeDecodeError:
        return None
    if not stripped.startswith("{"):
        return None
    try:
        data = JSON_DECODER.decode(stripped)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


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
