"""From a request taken off the broker to its answer: the checks before a command runs, in the
order of docs/topics.md ("Order of checks"), redelivery after a lost acknowledgement, the echoes
of our own clearings (MQTT 3.1.1), and where the response and its copies go ("Where the
response goes").

The commands themselves are :mod:`.commands`; this module decides whether one runs, and
answers it. The PUBACK of a request goes out with its response, after the turn's commit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
import time
from collections.abc import Callable
from typing import Any

from edge_queue.component import Component
from edge_queue.config.settings import Settings
from edge_queue.errors import ErrorCode
from edge_queue.logfmt import clip
from edge_queue.mqtt import payloads
from edge_queue.mqtt.bridge import Bridge
from edge_queue.mqtt.inbox import Connected, Incoming
from edge_queue.mqtt.paho_client import MAX_PROPERTY_BYTES
from edge_queue.mqtt.topics import ReplyAreas, Topics
from edge_queue.rules.limits import TURN_BYTES, TURN_REQUESTS, TURN_WORK
from edge_queue.rules.rates import RequestRate
from edge_queue.store import Store

from .commands import Commands
from .queue import rejections

log = logging.getLogger(__name__)

#: MQTT 3.1.1: after clearing a retained request, the broker's echo of the clearing is expected
#: for this long (seconds).
ECHO_WINDOW_S = 5.0
#: Requests whose effect changes the store: their first response is kept, so that the same
#: request delivered again after a lost acknowledgement is answered with it, not run twice.
STATEFUL_COMMANDS = frozenset({"submit", "cancel", "retry", "pause", "resume", "purge"})
#: A redelivery comes within this many requests of the first delivery (at most RECEIVE_MAXIMUM,
#: 1,000, are in flight to us), and the broker reuses a packet identifier only after 65,535 others.
REDELIVERY_WINDOW = 10_000


class Dispatcher(Component):
    """Runs each request taken off the broker once, and answers it.

    Args:
        settings: ``max_payload_bytes``.
        topics: the installation's topic names.
        bridge: the broker connection (responses, PUBACKs, clearings).
        store: returns the open store (the records of executed requests).
        commands: the request handlers.
        clock: Unix seconds.
    """

    def __init__(
        self,
        settings: Settings,
        topics: Topics,
        bridge: Bridge,
        store: Callable[[], Store],
        commands: Commands,
        clock: Callable[[], float],
        reply_areas: ReplyAreas | None = None,
        on_shared_submit: Callable[[bytes, dict[str, Any]], None] | None = None,
    ) -> None:
        self.settings, self.topics, self.bridge, self.store = settings, topics, bridge, store
        self.commands, self.clock = commands, clock
        self.reply_areas = reply_areas
        #: told of a (re)connect found in the inbox, in its order (:meth:`turn`)
        self.on_connected: Callable[[Connected], None] = lambda item: None
        #: the requests taken in this turn (answered with the error when its commit fails)
        self.taken: list[Incoming] = []
        #: told (request payload, response) of the last submit answered on the shared topic in
        #: a turn, once at the turn's end (Home Assistant's retained <base>/ha/submit)
        self.on_shared_submit = on_shared_submit
        self.shared_submit: tuple[bytes, dict[str, Any]] | None = None
        #: told the command of every request taken (the publisher: its sender may be listening)
        self.on_request: Callable[[str], None] = lambda command: None
        self.rate = RequestRate(settings.limits.max_requests_per_s)
        self.turn_work = 0  # job changes requests made in this turn (see TURN_WORK)
        self.requests_seen = 0  # QoS 1 requests received, ever (kept in the store each turn)
        #: ids of the turn's taken messages that were not requests (clearings of retained requests,
        #: echoes of ours): acknowledged without an answer, also when the turn fails
        self.not_requests: set[int] = set()
        #: MQTT 3.1.1 only: topic -> (echoes of our clearing still expected, monotonic deadline)
        self.echoes: dict[str, tuple[int, float]] = {}
        #: retained requests answered lately: (topic, payload digest) -> monotonic deadline
        self.answered_retained: dict[tuple[str, bytes], float] = {}

    def turn(self, now: float) -> None:
        """Take what arrived and run it, within the turn's budget: at most
        :data:`~edge_queue.rules.limits.TURN_REQUESTS` requests and ``TURN_WORK`` job changes, none
        while the broker has ``BACKLOG_HIGH`` of our messages to acknowledge, and at most
        ``limits.max_requests_per_s``. What is left stays in the inbox, unacknowledged, so the
        broker holds back the rest (MQTT flow control). Each taken request is kept in
        :attr:`taken` for the turn; a (re)connect in the inbox goes to :attr:`on_connected`, in
        its order. The first intake of a turn: it opens the turn's count of job changes."""
        self.taken = taken = []
        self.not_requests.clear()
        self.turn_work = 0
        on_connected = self.on_connected
        inbox = self.bridge.inbox.items
        budget = self.rate.budget(TURN_REQUESTS)
        while inbox:
            item = inbox[0]
            if isinstance(item, Incoming):
                if budget <= 0 or self.turn_work >= TURN_WORK or self.bridge.held_bytes >= TURN_BYTES:
                    break
                if not self.bridge.connected:
                    # Its PUBACK could not be sent: the broker would deliver it again, and it
                    # would run twice. It waits for the reconnect (which drops the copies the
                    # broker redelivers: the bridge's on-connect).
                    break
                if self.bridge.backlog_high():
                    break
                budget -= 1
                self.rate.spend()
                inbox.popleft()
                self.bridge.inbox.bytes -= len(item.payload)
                taken.append(item)
                self.on_request(item.command)
                self.on_message(item)
            else:
                inbox.popleft()
                on_connected(item)
        self.tell_shared_submit()

    def tell_shared_submit(self) -> None:
        """:attr:`on_shared_submit` of the last submit answered on the shared topic since the
        last call, if any (once per turn: a retained topic keeps only the last one anyway)."""
        if self.shared_submit is not None and self.on_shared_submit is not None:
            self.on_shared_submit(*self.shared_submit)
        self.shared_submit = None

    def wait_s(self, now: float) -> float | None:
        """0 when :meth:`turn` would take a request now, else None."""
        return 0.0 if self.takeable() else None

    def committed(self) -> None:
        """Nothing to do: the answers and PUBACKs leave with the bridge's held messages."""

    def turn_failed(self, *, disk_full: bool) -> None:
        """The turn's commit failed: each request it took is answered with the error."""
        self.answer_failed_turn(self.taken, disk_full=disk_full)

    def takeable(self) -> bool:
        """True when :meth:`turn` would take a request now."""
        bridge = self.bridge
        return bool(bridge.inbox) and not bridge.backlog_high() and bridge.connected and self.rate.ready()

    def on_message(self, msg: Incoming) -> None:
        """Execute one request and answer it; the PUBACK follows the commit. A bug costs one
        request, never the service; an error of the store fails the whole turn (re-raised)."""
        try:
            self.check_and_run(msg)
        except sqlite3.Error:
            raise  # the whole turn fails over (Service.tick)
        except Exception:  # a bug costs one request, never the service
            log.exception("request on %s: internal error", clip(msg.topic))
            self.answer(msg, payloads.error(ErrorCode.INTERNAL_ERROR, "internal error; see the service log"), None)

    def check_and_run(self, msg: Incoming) -> None:
        """Checks in the order of docs/topics.md, "Order of checks"."""
        if msg.qos:
            self.requests_seen += 1
        now = time.monotonic()
        limit = self.settings.max_payload_bytes
        if not msg.size and (msg.retain or self.take_echo(msg.topic, now)):
            # Someone clearing a retained request, or (MQTT 3.1.1) the broker echoing our own
            # clearing of one: not a request.
            self.not_requests.add(id(msg))
            self.bridge.ack(msg)
            return
        if msg.retain:
            self.refuse_retained(msg, now)
            return
        if msg.property_bytes:
            # Its MQTT 5 properties were too many to decode: answered on our topic only.
            rejections.warning(
                "request on %s rejected: invalid_request (%d bytes of properties)", clip(msg.topic), msg.property_bytes
            )
            self.answer(
                msg,
                payloads.error(
                    ErrorCode.INVALID_REQUEST,
                    f"the request's MQTT 5 properties take {msg.property_bytes} bytes; "
                    f"the limit is {MAX_PROPERTY_BYTES}",
                    field="(properties)",
                ),
                None,
            )
            return
        if msg.size > limit:
            # Its bytes were dropped on arrival: refused from its size, nothing echoed back.
            rejections.warning("request on %s rejected: payload_too_large (%d bytes)", clip(msg.topic), msg.size)
            self.answer(
                msg,
                payloads.error(
                    ErrorCode.PAYLOAD_TOO_LARGE,
                    f"payload is {msg.size} bytes; the limit is {limit} (max_payload_bytes)",
                ),
                None,
            )
            return
        key = request_key(msg) if msg.qos and msg.command in STATEFUL_COMMANDS else None
        if key is not None and msg.dup:
            first = self.store().requests.recall_request(key)
            # Only a record of one of the last REDELIVERY_WINDOW requests can be for this very
            # message: the broker numbers its messages to us on, 1..65535, and may reuse a
            # number only after it had our PUBACK for it.
            if first is not None and self.requests_seen - first[2] <= REDELIVERY_WINDOW:
                # Delivered again after its acknowledgement was lost: it took effect already.
                log.info(
                    "request %s on %s delivered again after a lost acknowledgement: answered with its first "
                    "response, not executed again",
                    msg.mid,
                    clip(msg.topic),
                )
                self.answer(msg, json.loads(first[0]), first[1])
                return
        response, reply_to = self.commands.execute(msg.command, msg.payload, msg.user)
        response = self.fitted(msg, response)
        if key is not None:  # errors too: delivered again, it gets the same answer
            records = self.store().requests
            records.remember_request(key, payloads.encode(response), reply_to, self.clock(), self.requests_seen)
        self.answer(msg, response, reply_to)

    def refuse_retained(self, msg: Incoming, now: float) -> None:
        """A retained request is not executed: it is cleared and answered ``invalid_request``,
        once per retained message (an MQTT 3.1.1 broker sends it from the session's queue and
        again for the subscription)."""
        retained_key = (msg.topic, hashlib.sha256(msg.payload).digest() + msg.size.to_bytes(8))
        if self.answered_retained.get(retained_key, 0.0) > now:
            self.bridge.ack(msg)
            return
        if len(self.answered_retained) >= 1000:
            self.answered_retained = {k: t for k, t in self.answered_retained.items() if t > now}
        self.answered_retained[retained_key] = now + ECHO_WINDOW_S
        rejections.warning(
            "retained request on %s not executed; cleared it (publish requests without the retain flag)",
            clip(msg.topic),
        )
        self.expect_echo(msg.topic, now)
        self.bridge.publish(msg.topic, b"", retain=True)
        limit = self.settings.max_payload_bytes
        transaction, reply_to = payloads.peek_envelope(msg.payload) if msg.size <= limit else (None, None)
        self.answer(
            msg,
            payloads.error(ErrorCode.INVALID_REQUEST, "retained requests are not executed", transaction),
            reply_to,
        )

    def expect_echo(self, topic: str, now: float) -> None:
        """We clear a retained request on ``topic``. MQTT 5: our subscription has No Local, so
        the broker does not send the clearing back. MQTT 3.1.1 has no such option: the broker
        sends it back as a plain empty message, which is counted here and not answered; an empty
        request beyond that count (a client's) is answered as any other."""
        if self.bridge.protocol_name == "5":
            return
        if len(self.echoes) >= 1000:
            self.echoes = {t: e for t, e in self.echoes.items() if e[1] > now}
        count, _ = self.echoes.get(topic, (0, 0.0))
        self.echoes[topic] = (count + 1, now + ECHO_WINDOW_S)

    def take_echo(self, topic: str, now: float) -> bool:
        """True when an empty message on ``topic`` is the echo of our own clearing (see
        :meth:`expect_echo`); counts it."""
        count, deadline = self.echoes.get(topic, (0, 0.0))
        if count <= 0 or deadline < now:
            self.echoes.pop(topic, None)
            return False
        if count == 1:
            del self.echoes[topic]
        else:
            self.echoes[topic] = (count - 1, deadline)
        return True

    def answer(self, msg: Incoming, response: dict[str, Any], reply_to: str | None) -> None:
        """Publish the response (on ``<base>/response/<command>``, or for a request on a user's
        own request topic on ``<base>/reply/<user>/response/<command>``), acknowledge the
        request, then publish the copies for the topics the client named (``reply_to``, the
        MQTT 5 Response Topic; for a user, under its own ``<base>/reply/<user>/``), in that order.

        A copy on a client-named topic goes out after the PUBACK and is never sent twice
        (:meth:`Bridge.respond` with ``once=True``): whatever the broker does with it (refuse
        it, close our connection), the request is not delivered again and the service goes on.
        """
        body = payloads.encode(response)
        user = msg.user
        if user is None:
            self.bridge.respond(self.topics.response(msg.command), body)
            if msg.command == "submit":
                self.shared_submit = (msg.payload, response)  # told at the turn's end
        else:  # a user's own request topic: the response is for that user only
            self.bridge.respond(self.topics.user_response(user, msg.command), body, once=True)
        self.bridge.ack(msg)
        if ours_only(response):
            return
        if msg.response_topic and self.topics.valid_reply_to(msg.response_topic, user, self.reply_areas):
            self.bridge.respond(msg.response_topic, body, correlation_data=msg.correlation_data, once=True)
        if reply_to and self.topics.valid_reply_to(reply_to, user, self.reply_areas):
            self.bridge.respond(reply_to, body, once=True)

    def fitted(self, msg: Incoming, response: dict[str, Any]) -> dict[str, Any]:
        """``response``, or a ``response_too_large`` error in its place when its packet would be
        larger than the broker takes (``Outbox.packet_limit``): every request is answered,
        and the broker never closes the connection over an answer (which would bring the
        request again, and the same answer, at every reconnect)."""
        body = payloads.encode(response)
        topic = (
            self.topics.response(msg.command) if msg.user is None else self.topics.user_response(msg.user, msg.command)
        )
        if self.bridge.outbox.fits(topic, len(body)):
            return response
        limit = self.bridge.outbox.packet_limit
        rejections.warning(
            "the answer to %s (%d bytes) is over the broker's packet limit of %d bytes: answered %s",
            msg.command,
            len(body),
            limit,
            ErrorCode.RESPONSE_TOO_LARGE,
        )
        transaction, _ = payloads.peek_envelope(msg.payload)
        return payloads.error(
            ErrorCode.RESPONSE_TOO_LARGE,
            f"the answer would be {len(body):,} bytes, over the {limit:,} bytes the broker takes in one packet",
            transaction,
        )

    def answer_failed_turn(self, taken: list[Incoming], *, disk_full: bool) -> ErrorCode:
        """The turn's commit failed (``disk_full``: because the disk is full): each request it
        took is answered with the error (a clearing or an echo is only acknowledged). Returns
        the error's code."""
        code = ErrorCode.DISK_FULL if disk_full else ErrorCode.INTERNAL_ERROR
        message = (
            "the disk holding the job store is full; free space and retry"
            if disk_full
            else "the job store could not be written; see the service log"
        )
        with self.bridge.held():
            for msg in taken:
                if id(msg) in self.not_requests:  # a clearing or an echo: no answer (check_and_run)
                    self.bridge.ack(msg)
                    continue
                transaction, reply_to = payloads.peek_envelope(msg.payload)
                self.answer(msg, payloads.error(code, message, transaction), reply_to)
            self.tell_shared_submit()
        return code


def ours_only(response: dict[str, Any]) -> bool:
    """True for the errors docs/topics.md ("Where the response goes", "Order of checks") sends
    to ``<base>/response/<command>`` only, without the copies for a Response Topic or
    ``reply_to``: ``payload_too_large``, and ``invalid_request`` for the ``reply_to`` itself or
    for MQTT 5 properties too large to read. Decided from the response, so a request delivered
    again is answered the same way."""
    error = response.get("error")
    if not isinstance(error, dict):
        return False
    code = error.get("code")
    return code == ErrorCode.PAYLOAD_TOO_LARGE or (
        code == ErrorCode.INVALID_REQUEST and error.get("field") in ("reply_to", "(properties)")
    )


def request_key(msg: Incoming) -> bytes:
    """What identifies one delivery of a request to this service: the packet identifier the
    broker gave it on our session (kept when the broker sends it again, MQTT 5.0 4.4), its
    topic and payload (SHA-256). The same publish delivered again after a lost PUBACK has the
    same key; the broker numbers new messages on, so two requests share a key only when they
    are equal and 65,536 messages apart, and then only a redelivery (DUP) is looked up."""
    digest = hashlib.sha256()
    digest.update(msg.mid.to_bytes(2, "big"))
    digest.update(msg.topic.encode())
    digest.update(b"\0")
    digest.update(msg.payload)
    return digest.digest()
