"""MQTT's adapter to the queue (docs/topics.md, "Order of checks"): a request payload's envelope
checks, the sender's role, its decoding into a typed request, then the queue's answer.

:meth:`Commands.execute` takes what MQTT dispatch read off a request topic (the command, the raw
payload, the user from the topic) and returns one response for it, whatever its payload; the
commands themselves are :class:`~edge_queue.requests.queue.Queue`'s.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path
from typing import Any

from edge_queue.config.settings import Role
from edge_queue.errors import ErrorCode, RequestError
from edge_queue.logfmt import clip as _clip
from edge_queue.mqtt import payloads

from . import models
from .ports import QueuePort
from .queue import Caller, Queue, rejections

log = logging.getLogger(__name__)


class Commands:
    """MQTT's request handler of one service, over its typed queue (``queue``)."""

    def __init__(self, service: QueuePort, queue: Queue | None = None) -> None:
        self.service = service
        self.queue = queue or Queue(service)

    def execute(
        self,
        command: str,
        raw: bytes,
        user: str | None = None,
        *,
        role: Role | None = None,
        input_roots: list[Path] | None = None,
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
        svc.reply_areas.note(user)
        if unusable or (reply_to is not None and not svc.topics.valid_reply_to(reply_to, user, svc.reply_areas)):
            rejections.warning("request %s rejected: invalid_request (reply_to)", _clip(command, 64))
            prefix = svc.topics.reply_prefix() if user is None else svc.topics.user_reply_prefix(user)
            outside = "" if user is not None else f", outside the reply area of a user ({prefix}<user>/)"
            return payloads.error(
                ErrorCode.INVALID_REQUEST,
                f"reply_to must be a topic name under {prefix}{outside}: a string of at most 1024 bytes of UTF-8, "
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
        caller = Caller(user, role, None if input_roots is None else tuple(input_roots))
        if (why := self.queue.refusal(command, caller)) is not None:
            who = "requests on the shared topics" if user is None else f"user {_clip(user, 64)!r}"
            rejections.warning("request %s rejected: forbidden (%s, role %s)", _clip(command, 64), who, role)
            return payloads.error(ErrorCode.FORBIDDEN, why, transaction), reply_to
        try:
            request = models.decode_request(
                command,
                raw,
                max_bytes=svc.settings.max_payload_bytes,
                default_kind=svc.settings.default_kind,
                parsed=parsed,
            )
        except RequestError as e:
            rejections.warning("request %s rejected: %s: %s", _clip(command, 64), e.code, _clip(e.message))
            return payloads.error(e.code, e.message, transaction, e.field), reply_to
        except sqlite3.Error:
            raise
        except Exception as e:  # a bug must cost one response, not the service
            log.exception("request %s: internal error", _clip(command, 64))
            return payloads.error(ErrorCode.INTERNAL_ERROR, f"{type(e).__name__}: {e}", transaction), reply_to
        return self.queue.answer(command, request, caller, request.transaction), reply_to
