"""Our messages on their way to the broker: held until the loop turn's commit, then queued in
order, handed to paho while the window of unacknowledged publishes is open, and bounded while
the broker is away (docs/operations.md, "Load and back-pressure").
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from paho.mqtt.enums import MQTTErrorCode
from paho.mqtt.properties import Properties

from .paho_client import FastClient

log = logging.getLogger(__name__)

#: Our QoS 1 publishes handed to paho and not yet acknowledged, at most (paho's ids are 16-bit),
#: and their payload bytes at most (one larger publish may go alone).
WINDOW = 2_000
WINDOW_BYTES = 8 * 2**20
#: The service takes no new request while this many of our messages wait to be handed to paho,
#: or this many bytes of ours wait for the broker's acknowledgements (:attr:`Bridge.backlog`,
#: :attr:`Outbox.backlog_bytes`).
BACKLOG_HIGH = 5_000
BACKLOG_BYTES_HIGH = 8 * 2**20
#: While disconnected, at most this many responses and events (and this many bytes of them)
#: wait for the broker; older ones are dropped (retained state is not kept: the republish
#: after the reconnect sends it again).
OFFLINE_BACKLOG = 10_000
OFFLINE_BACKLOG_BYTES = 32 * 2**20
#: While disconnected with this many messages (or bytes) waiting, the service starts no new
#: job and takes no watch-folder file (:attr:`Bridge.holding`), so that what it is already
#: running stays far below :data:`OFFLINE_BACKLOG` and no event or response is dropped.
OFFLINE_HOLD = OFFLINE_BACKLOG // 2
OFFLINE_HOLD_BYTES = OFFLINE_BACKLOG_BYTES // 2
#: Publishes dropped for being larger than the broker takes are logged at most this often.
TOO_LARGE_LOG_S = 10.0


def packet_bytes(
    topic: str, payload_bytes: int, props: Properties | None, mqtt5: bool, packed: bytes | None = None
) -> int:
    """Bytes of a QoS 1 PUBLISH of ``payload_bytes`` on ``topic``: the fixed header, the topic,
    the packet identifier, the properties (MQTT 5 only; one byte when there are none; ``packed``:
    ``props.pack()`` when the caller has it) and the payload (MQTT 5.0, 3.3). What the broker's
    Maximum Packet Size is compared with."""
    remaining = 2 + len(topic.encode("utf-8", "surrogatepass")) + 2 + payload_bytes
    if mqtt5:
        if packed is not None:
            remaining += len(packed)
        else:
            remaining += len(props.pack()) if props is not None else 1
    return 1 + max(1, (remaining.bit_length() + 6) // 7) + remaining


@dataclass(slots=True)
class Pub:
    """A publish of ours, QoS 1."""

    topic: str
    payload: bytes | str
    retain: bool
    props: Properties | None = None
    once: bool = False  # not sent again after a disconnect (a copy on a topic a client named)
    #: called with the PUBACK's reason code (MQTT 5; 0 with 3.1.1) once the broker acknowledges it
    receipt: Callable[[int], None] | None = None
    #: ``props.pack()``, for shared properties packed once (``bridge.expiry``)
    packed: bytes | None = None

    @property
    def size(self) -> int:
        return len(self.payload) + len(self.topic)


@dataclass(slots=True)
class Ack:
    """The PUBACK of a request, sent once its effects are committed."""

    mid: int
    qos: int
    connection: int  # the connection the request came on; a PUBACK is for that one only


class Outbox:
    """What the service sends, in order: publishes, responses and PUBACKs.

    Everything made inside :meth:`held` waits for the block to exit normally (after the store's
    group commit) and is dropped on an exception. At most :data:`WINDOW` publishes (and
    :data:`WINDOW_BYTES` bytes) are handed to paho without a PUBACK; the rest wait in
    :attr:`out`, whose length the service reads (:attr:`backlog`) to slow down what it takes in.
    """

    def __init__(self, max_packet_size: int) -> None:
        self.max_packet_size = max_packet_size  # mqtt.max_packet_size
        #: the largest packet the broker takes, in bytes: its CONNACK's Maximum Packet Size
        #: (MQTT 5), else ``mqtt.max_packet_size`` (:meth:`connected`)
        self.packet_limit = max_packet_size
        self.mqtt5 = True  # the connection's protocol: MQTT 5 packets carry properties
        self.out: deque[Pub | Ack] = deque()
        self.out_bytes = 0
        #: our publishes handed to paho and not yet acknowledged: message id -> bytes
        self.inflight: dict[int, int] = {}
        self.inflight_bytes = 0
        self.once: set[int] = set()  # message ids of in-flight publishes not to send again
        self.receipts: dict[int, Callable[[int], None]] = {}  # message id -> its Pub's receipt
        self.held_list: list[Pub | Ack] | None = None
        #: payload bytes made inside the current :meth:`held` block
        self.held_bytes = 0
        self.copies_sent_on = -1  # the last connection a copy on a client-named topic went out on
        self.too_large = 0  # publishes over the broker's packet limit, dropped since the last log line
        self.too_large_said = -TOO_LARGE_LOG_S

    @contextmanager
    def held(self) -> Iterator[None]:
        """Hold every publish, response and PUBACK made inside; queue them, in order, when the
        block exits normally (after the store's group commit), drop them on an exception."""
        if self.held_list is not None:
            yield
            return
        self.held_list = []
        self.held_bytes = 0
        try:
            yield
            self.out.extend(self.held_list)
            self.out_bytes += self.held_bytes
        finally:
            self.held_list = None
            self.held_bytes = 0

    def put(self, m: Pub | Ack) -> None:
        size = m.size if isinstance(m, Pub) else 0
        if self.held_list is None:
            self.out.append(m)
            self.out_bytes += size
        else:
            self.held_list.append(m)
            self.held_bytes += size

    @property
    def backlog(self) -> int:
        """Messages waiting here because the broker has not acknowledged earlier ones."""
        return len(self.out)

    @property
    def backlog_bytes(self) -> int:
        """Payload bytes of the messages waiting here and of those not yet acknowledged."""
        return self.out_bytes + self.inflight_bytes

    def backlog_high(self) -> bool:
        """True while :data:`BACKLOG_HIGH` of our messages (or :data:`BACKLOG_BYTES_HIGH` bytes)
        wait for the broker: the service takes no new request until some are acknowledged."""
        return len(self.out) >= BACKLOG_HIGH or self.backlog_bytes >= BACKLOG_BYTES_HIGH

    def holding(self) -> bool:
        """While disconnected: True when :data:`OFFLINE_HOLD` messages (or bytes) wait."""
        return len(self.out) >= OFFLINE_HOLD or self.out_bytes >= OFFLINE_HOLD_BYTES

    def window_open(self) -> bool:
        return len(self.inflight) < WINDOW and (self.inflight_bytes < WINDOW_BYTES or not self.inflight)

    def acknowledged(self, mid: int, reason_code: int = 0) -> None:
        """The broker acknowledged our publish ``mid`` (``reason_code``: its PUBACK's)."""
        self.inflight_bytes -= self.inflight.pop(mid, 0)
        self.once.discard(mid)
        if self.receipts:
            receipt = self.receipts.pop(mid, None)
            if receipt is not None:
                receipt(reason_code)

    def connected(self, connection: int, mqtt5: bool, properties: Properties | None) -> None:
        """A new connection (``properties``: its CONNACK's): its packet limit (the Maximum
        Packet Size the broker gives, else ``mqtt.max_packet_size``); PUBACKs still waiting
        were for the one that ended (the broker sends those requests again on this one, and
        they are answered then)."""
        self.mqtt5 = mqtt5
        self.packet_limit = getattr(properties, "MaximumPacketSize", None) or self.max_packet_size
        self.out = deque(m for m in self.out if not isinstance(m, Ack) or m.connection == connection)

    def drop_copies(self, client: FastClient) -> None:
        """The connection ended: copies of responses on topics that clients named are not sent
        again on the next connection, so that one the broker refuses (and closes our connection
        for) cannot do it again at every reconnect. The response itself was on our topic."""
        if not self.once:
            return
        for mid in self.once:
            client.forget_message(mid)
            self.inflight_bytes -= self.inflight.pop(mid, 0)
        log.warning(
            "%d response copie(s) on client-named reply topics were not acknowledged before the connection "
            "ended; they are not sent again",
            len(self.once),
        )
        self.once.clear()

    def dropped_too_large(self, topic: str) -> None:
        """Count a publish dropped for its size; log the count at most once per
        :data:`TOO_LARGE_LOG_S`."""
        self.too_large += 1
        now = time.monotonic()
        if now - self.too_large_said >= TOO_LARGE_LOG_S:
            log.warning(
                "%d message(s) not sent: larger than the %d bytes the broker takes in one packet (last on %s)",
                self.too_large,
                self.packet_limit,
                topic[:200],
            )
            self.too_large, self.too_large_said = 0, now

    def bound_offline(self) -> None:
        """Disconnected: beyond :data:`OFFLINE_BACKLOG` messages (or bytes), the oldest are
        dropped, retained states first (the republish after the reconnect sends them again)."""
        out = self.out
        if len(out) > OFFLINE_BACKLOG or self.out_bytes > OFFLINE_BACKLOG_BYTES:
            kept: deque[Pub | Ack] = deque(m for m in out if isinstance(m, Pub) and not m.retain)
            dropped = len(out) - len(kept)
            size = sum(m.size for m in kept if isinstance(m, Pub))
            while kept and (len(kept) > OFFLINE_BACKLOG or size > OFFLINE_BACKLOG_BYTES):
                size -= kept.popleft().size  # type: ignore[union-attr]
                dropped += 1
            self.out, self.out_bytes = kept, size
            log.warning("broker unreachable: dropped %d waiting messages (state is republished)", dropped)

    def fits(self, topic: str, payload_bytes: int) -> bool:
        """True when a publish of ``payload_bytes`` on ``topic`` (no properties) is a packet of
        at most :attr:`packet_limit` bytes."""
        return packet_bytes(topic, payload_bytes, None, self.mqtt5) <= self.packet_limit

    def hand_over(self, client: FastClient, connection: int) -> None:
        """Give waiting messages to paho, in order, while the window (:data:`WINDOW` messages,
        :data:`WINDOW_BYTES` bytes) of publishes awaiting a PUBACK is open. A publish over
        :attr:`packet_limit` bytes as a packet (:func:`packet_bytes`) is dropped, never sent:
        the broker would close the connection, and the message would go again at every
        reconnect; logged at most once per :data:`TOO_LARGE_LOG_S`."""
        out = self.out
        while out and self.window_open():
            m = out.popleft()
            if isinstance(m, Ack):
                if m.connection == connection:
                    client.ack(m.mid, m.qos)
                continue
            size = m.size
            self.out_bytes -= size
            if packet_bytes(m.topic, len(m.payload), m.props, self.mqtt5, m.packed) > self.packet_limit:
                self.dropped_too_large(m.topic)
                continue
            if (m.props is None or m.packed is not None) and not m.once and client.socket() is not None:
                # the usual message (state, event, response): paho's bookkeeping, less work
                payload = m.payload.encode() if isinstance(m.payload, str) else m.payload
                mid = client.publish_qos1(m.topic, payload, m.retain, m.props, m.packed)
                self.inflight[mid] = size
                self.inflight_bytes += size
                if m.receipt is not None:
                    self.receipts[mid] = m.receipt
                if client.socket() is None:
                    break
                continue
            info = client.publish(m.topic, m.payload, qos=1, retain=m.retain, properties=m.props)
            self.inflight[info.mid] = size
            self.inflight_bytes += size
            if m.receipt is not None:
                self.receipts[info.mid] = m.receipt
            if m.once:
                self.once.add(info.mid)
                self.copies_sent_on = connection
            if info.rc == MQTTErrorCode.MQTT_ERR_NO_CONN:
                break  # paho keeps it and sends it after the reconnect
            if client.socket() is None:
                break
