"""What the service's MQTT connection received, for the service's loop (docs/operations.md,
"Load and back-pressure"): the requests (:class:`Incoming`) and the (re)connects
(:class:`Connected`) in the order they arrived, taken from the left; and the inbox's share of
the back-pressure: the socket read in whole packets, at most :data:`READ_BUDGET` a turn, and not
while the inbox holds :data:`INBOX_HIGH` items or :data:`INBOX_BYTES_HIGH` payload bytes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import paho.mqtt.client as mqtt
from paho.mqtt.enums import MQTTErrorCode

from .paho_client import FastClient

#: The socket is not read while the inbox holds this many items or payload bytes, unless the
#: service takes no request until the broker acknowledges some of ours (``BACKLOG_HIGH``):
#: reading is how those acknowledgements arrive.
INBOX_HIGH = 2_000
INBOX_BYTES_HIGH = 32 * 2**20
#: Packets read per :meth:`Inbox.read` (so per ``Bridge.pump``) at most, so one turn stays short.
READ_BUDGET = 2_000


@dataclass(slots=True)
class Incoming:
    """A message on ``<base>/request/#`` as paho delivered it."""

    topic: str
    command: str
    payload: bytes
    retain: bool
    qos: int
    mid: int
    response_topic: str | None = None
    correlation_data: bytes | None = None
    dup: bool = False
    connection: int = 0  # which connection it came on (its PUBACK is for that one only)
    size: int = 0  # bytes of the payload as received (the payload itself is dropped when too large)
    property_bytes: int = 0  # MQTT 5 properties over MAX_PROPERTY_BYTES: their size; they were not decoded
    user: str | None = None  # the broker user of <base>/request/<command>/<user>; None on the shared topics


@dataclass(slots=True)
class Connected:
    """The bridge (re)connected: the service republishes its retained state."""

    protocol: str
    session_present: bool


class Inbox:
    """What arrived, in order (:attr:`items`): the service takes from the left, and subtracts
    the payload of each request it takes from :attr:`bytes`. Its length is that of
    :attr:`items`."""

    def __init__(self) -> None:
        self.items: deque[Incoming | Connected] = deque()
        self.bytes = 0  # payload bytes of the requests in items
        self.received = 0  # requests taken off the socket since the start
        #: the last :meth:`read` stopped at :data:`READ_BUDGET`: the socket may hold more
        self.more = False

    def __len__(self) -> int:
        return len(self.items)

    def add(self, item: Incoming) -> None:
        """A request arrived (after those already in)."""
        self.received += 1
        self.bytes += len(item.payload)
        self.items.append(item)

    def connected(self, connection: int, protocol: str, session_present: bool) -> None:
        """The broker accepted the connection numbered ``connection`` (MQTT ``protocol``, "5" or
        "3.1.1"): a :class:`Connected` after what is in. With ``session_present``, the requests
        of the connections before it are dropped first: the broker sends those not yet
        acknowledged again on this one (the same session)."""
        if session_present:
            kept = deque(m for m in self.items if not (isinstance(m, Incoming) and m.connection != connection))
            self.bytes -= sum(len(m.payload) for m in self.items if isinstance(m, Incoming)) - sum(
                len(m.payload) for m in kept if isinstance(m, Incoming)
            )
            self.items = kept
        self.items.append(Connected(protocol, session_present))

    def full(self) -> bool:
        """True at :data:`INBOX_HIGH` items or :data:`INBOX_BYTES_HIGH` payload bytes."""
        return len(self.items) >= INBOX_HIGH or self.bytes >= INBOX_BYTES_HIGH

    def may_read(self, connected: bool, backlog_high: bool) -> bool:
        """False while the inbox is full (back-pressure), except while we wait for the broker's
        acknowledgements (``backlog_high``: the outbox's ``BACKLOG_HIGH``) or for its CONNACK
        (not ``connected``): the requests left in the inbox by a connection that ended are
        taken only once the new one is acknowledged, and that CONNACK arrives through the
        socket (docs/operations.md, "Load and back-pressure")."""
        return not connected or not self.full() or backlog_high

    def read(self, client: FastClient, may_read: Callable[[], bool]) -> None:
        """Read whole packets from ``client``'s socket (paho's callbacks add what arrives) until
        it has none, :data:`READ_BUDGET` were read, or ``may_read`` says no more.

        paho's ``loop_read`` does not say whether the socket ran dry
        (:meth:`FastClient.read_packet` does).
        """
        self.more = False
        for _ in range(READ_BUDGET):
            if not may_read():
                # back-pressure: leave it in the socket, whatever the broker's Receive Maximum
                # let it send; the service drains the inbox first
                self.more = False
                return
            if client.socket() is None:
                return
            rc = client.read_packet()
            if rc == MQTTErrorCode.MQTT_ERR_AGAIN:
                return
            if rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
                client.read_failed(rc)
                return
        self.more = True


def incoming(
    msg: mqtt.MQTTMessage,
    command: str,
    user: str | None,
    connection: int,
    max_payload_bytes: int | None,
    dropped_property_bytes: int,
) -> Incoming:
    """The request ``msg`` as the service takes it: a payload over ``max_payload_bytes`` is
    dropped (its size is kept), Correlation Data over 1,024 bytes too (it is echoed back)."""
    props = getattr(msg, "properties", None)
    response_topic = getattr(props, "ResponseTopic", None) if props else None
    correlation = getattr(props, "CorrelationData", None) if props else None
    size = len(msg.payload)
    payload = b"" if max_payload_bytes and size > max_payload_bytes else bytes(msg.payload)
    if correlation is not None and len(correlation) > 1024:
        correlation = None  # echoed back: bounded like a transaction
    return Incoming(
        msg.topic,
        command,
        payload,
        bool(msg.retain),
        msg.qos,
        msg.mid,
        response_topic,
        correlation,
        bool(msg.dup),
        connection,
        size,
        dropped_property_bytes,
        user,
    )
