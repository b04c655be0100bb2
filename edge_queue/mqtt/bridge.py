"""The MQTT adapter (paho-mqtt 2.x): requests in, retained state, events and responses out.

Speaks MQTT 5 (mosquitto) and MQTT 3.1.1 (amqtt 0.12, which answers an MQTT 5 CONNECT with
"Unsupported protocol version"; ``mqtt.protocol = "auto"`` then falls back). The session is
persistent (``clean_start``/``clean_session`` false, MQTT 5 session expiry) and incoming QoS 1
requests are acknowledged by hand, only after the service has committed them, so a request
published while the service was away is delivered when it comes back. The Last Will publishes
a retained ``offline`` on ``<base>/status``.

Threads: none of its own. paho runs without its network thread: the service's loop puts
:meth:`Bridge.fileno` in the same ``select`` as the worker pipes and calls :meth:`Bridge.pump`
each turn, which reads, writes, keeps the connection alive and reconnects. paho's callbacks
therefore run on the service's thread, inside :meth:`pump`; they only append to
:attr:`Bridge.inbox` and count acknowledgements. Nothing ever waits for the broker: what cannot
be handed to paho yet waits in its :class:`~edge_queue.mqtt.outbox.Outbox`, in order, and goes out on
a later turn. paho's client itself, with its short paths, is :mod:`.mqtt_client`; finding out what
listens at the address is :mod:`.broker_probe`.

Flow control, end to end (docs/operations.md, "Load and back-pressure"):

- in: the broker sends at most ``RECEIVE_MAXIMUM`` unacknowledged QoS 1 requests (MQTT 5
  Receive Maximum; mosquitto's ``max_inflight_messages`` for MQTT 3.1.1), and a request is
  acknowledged only once committed, so requests that arrive faster than the service commits
  them wait in the broker, not here. The socket is read only while :attr:`inbox` holds fewer
  than ``INBOX_HIGH`` items, or while our own publishes wait for acknowledgements (reading is
  how those arrive, so it never stops then).
- out: at most ``WINDOW`` of our QoS 1 publishes are handed to paho without a PUBACK (paho
  numbers them with 16-bit ids); the rest wait in the outbox, whose length the service reads
  (:attr:`Bridge.backlog`) to slow down what it takes in.
"""

from __future__ import annotations

import logging
import random
import select
import socket
import sqlite3
import ssl
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edge_queue.config.settings import MqttSettings
from edge_queue.errors import BrokerUnavailable

from .outbox import Ack, Outbox, Pub
from .paho_client import FastClient, ack_now, configure_client, set_nodelay, subscribe
from .probe import detect_protocol
from .takeover import ForeignMessages, TakeoverRule
from .topics import OFFLINE, Topics

log = logging.getLogger(__name__)

#: Unacknowledged QoS 1 requests the broker may send us at once (MQTT 5 Receive Maximum).
#: mosquitto 2.0.11 sends more under sustained load: a client that acknowledges as it goes
#: held 1,606 unacknowledged messages at a Receive Maximum of 100. So the inbox bounds itself.
RECEIVE_MAXIMUM = 1_000
#: The socket is not read while the inbox holds this many items or payload bytes, unless the
#: service takes no request until the broker acknowledges some of ours (:data:`BACKLOG_HIGH`):
#: reading is how those acknowledgements arrive.
INBOX_HIGH = 2_000
INBOX_BYTES_HIGH = 32 * 2**20
#: Packets read per :meth:`Bridge.pump` at most, so one turn stays short.
READ_BUDGET = 2_000
#: Seconds between reconnect attempts: from 1, doubling, at most 4 (the retained state must be
#: back within seconds of a broker restart).
RECONNECT_MIN_S, RECONNECT_MAX_S = 1.0, 4.0


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


class Bridge:
    """One paho client for the service, driven by the service's loop (see the module text).

    Args:
        settings: the ``[mqtt]`` section.
        topics: the topic set of ``mqtt.base_topic``.
        client_id: overrides ``settings.client_id`` (tests run several services at once).
        max_packet_bytes: MQTT 5 Maximum Packet Size we accept; the broker does not send us
            larger packets.
        max_payload_bytes: a request payload larger than this is dropped as it arrives (only
            its size is kept, for the ``payload_too_large`` answer), so it never waits in memory.
    """

    def __init__(
        self,
        settings: MqttSettings,
        topics: Topics,
        client_id: str | None = None,
        max_packet_bytes: int | None = None,
        max_payload_bytes: int | None = None,
    ) -> None:
        self.settings = settings
        self.topics = topics
        #: empty until the service sets the default one (:meth:`set_client_id`)
        self.client_id: str = client_id or settings.client_id or ""
        self.max_packet_bytes = max_packet_bytes
        self.max_payload_bytes = max_payload_bytes
        self.inbox_bytes = 0  # payload bytes in the inbox (the service subtracts what it takes)
        #: What arrived, in order; the service takes from the left.
        self.inbox: deque[Incoming | Connected] = deque()
        self.protocol: mqtt.MQTTProtocolVersion = mqtt.MQTTv311 if settings.protocol == "3.1.1" else mqtt.MQTTv5
        self.connected = False
        self.connection = 0  # increments at every CONNACK
        self._refused: str | None = None
        #: what we send, held until the turn's commit and paced by the broker's PUBACKs
        self.outbox = Outbox(settings.max_packet_size)
        self._closing = False
        self._next_reconnect = 0.0
        self._reconnect_delay = RECONNECT_MIN_S
        self._more_to_read = False
        self._client: FastClient = self._make_client()
        #: other topics to follow (QoS 0, not our own messages): topic -> called with
        #: ``(payload, retained)`` from :meth:`pump` (another installation's ``<base>/info``,
        #: Home Assistant's ``<prefix>/status``)
        self.watch: dict[str, Callable[[bytes, bool], None]] = {}
        #: worker nodes' topics (``<base>/nodes/+`` and ``<base>/nodes/+/up``, QoS 1): topic,
        #: payload, retain; None: not subscribed (docs/nodes.md)
        self.on_node: Callable[[str, bytes, bool], None] | None = None
        #: another client connected with our client id: the rule, and how often it happened
        self.takeovers, self.foreign = TakeoverRule(), ForeignMessages()
        self.on_client_id: Callable[[str], None] = lambda _: None  # told the id chosen (`up`'s broker trusts it)
        self.requests_received = 0  # requests taken off the socket since the start
        self._connected_at = 0.0

    def set_client_id(self, client_id: str) -> None:
        """Use ``client_id`` (before :meth:`connect`); :attr:`on_client_id` is told it."""
        self.client_id = client_id
        self._client = self._make_client()
        self.on_client_id(client_id)

    @property
    def protocol_name(self) -> str:
        return "5" if self.protocol == mqtt.MQTTv5 else "3.1.1"

    def _make_client(self) -> FastClient:
        v5 = self.protocol == mqtt.MQTTv5
        client = FastClient(
            CallbackAPIVersion.VERSION2,
            # (a persistent MQTT 3.1.1 session needs an id: the real one is set before connect)
            client_id=self.client_id or "edge-queue-unset",
            protocol=self.protocol,
            clean_session=None if v5 else False,
            manual_ack=True,
        )
        client.max_queued_messages_set(0)  # bounded by WINDOW, below
        client.max_inflight_messages_set(0)  # every message handed over is sent at once
        client.connect_timeout = 5.0
        configure_client(client, self.settings)
        client.will_set(self.topics.status, OFFLINE, qos=1, retain=True)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        # packets wait for the loop's loop_write (and are joined there) instead of being sent one
        # by one as they are queued
        client.on_socket_register_write = lambda *_: None
        return client

    # -- paho's callbacks (run inside pump(), on the service's thread) -------------------

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        if reason.is_failure:
            self._refused = str(reason)
            log.error("broker refused the connection: %s", reason)
            return
        self._refused = None
        self.connected = True
        self._connected_at = time.monotonic()
        self.connection += 1
        self._reconnect_delay = RECONNECT_MIN_S
        set_nodelay(client)
        # PUBACKs still waiting were for the connection that ended (the broker sends those
        # requests again on this one); the packet limit is this connection's.
        self.outbox.connected(self.connection, self.protocol == mqtt.MQTTv5, properties)
        nodes = self.topics.nodes_prefix if self.on_node is not None else None
        requests = self.topics.requests if self.foreign.shared is None else None  # None: leaving a shared id
        subscribe(client, self.protocol, requests, list(self.watch), nodes)
        session_present = bool(getattr(flags, "session_present", False))
        self.foreign.after_connect(session_present, self.client_id)
        if session_present:
            # Requests of the old connection not yet acknowledged: the broker sends them again
            # on this one (same session), so the copies still waiting here are dropped.
            kept = deque(m for m in self.inbox if not (isinstance(m, Incoming) and m.connection != self.connection))
            self.inbox_bytes -= sum(len(m.payload) for m in self.inbox if isinstance(m, Incoming)) - sum(
                len(m.payload) for m in kept if isinstance(m, Incoming)
            )
            self.inbox = kept
        log.info(
            "connected to %s:%s (MQTT %s, session present: %s)",
            self.settings.host,
            self.settings.port,
            self.protocol_name,
            session_present,
        )
        # "online" follows from the service's republish on this event, after the subscription
        # is on its way: requests published after a client sees it are not missed.
        self.inbox.append(Connected(self.protocol_name, session_present))

    def _on_disconnect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        was = self.connected
        self.connected = False
        # a copy on a client-named topic sent on this connection explains its end (refused)
        refused_copy = self.outbox.copies_sent_on == self.connection
        self.outbox.drop_copies(self._client)
        now = time.monotonic()
        takeover = self.takeovers.after_disconnect(
            now,
            reason_code=getattr(reason, "value", None),
            was_connected=was,
            connected_at=self._connected_at,
            closing=self._closing,
            refused_copy=refused_copy,
        )
        if takeover is not None:
            # reconnecting at once would take the id back and be taken again; a newcomer stops
            self._reconnect_delay = self.foreign.after_takeover(takeover, self.client_id)
        elif not self._closing and was:
            log.warning("disconnected from the broker (%s); reconnecting", reason)
        self._next_reconnect = now + self._reconnect_delay

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        watcher = self.watch.get(msg.topic)
        if watcher is not None:
            follow(watcher, msg)
            return
        if self.on_node is not None and msg.topic.startswith(self.topics.nodes_prefix):
            # acknowledged at once, below: a node sends again until the hub's "ok" (docs/nodes.md)
            self.on_node(msg.topic, bytes(msg.payload), bool(msg.retain))
        parsed = self.topics.parse_request(msg.topic)
        if parsed is None:
            first = self.foreign.shared is None
            if self.foreign.note(msg.topic, self.topics, self.client_id) != "leave":
                if msg.qos:
                    client.ack(msg.mid, msg.qos)
            elif first and self.foreign.shared:  # we stop for it: ours stop coming to this session
                client.unsubscribe(self.topics.requests)
            return
        command, user = parsed
        dropped = client.dropped_property_bytes if isinstance(client, FastClient) else 0
        item = incoming(msg, command, user, self.connection, self.max_payload_bytes, dropped)
        self.requests_received += 1
        self.inbox_bytes += len(item.payload)
        self.inbox.append(item)

    def _on_publish(self, client: mqtt.Client, userdata: Any, mid: int, reason: Any, properties: Any) -> None:
        self.outbox.acknowledged(mid, getattr(reason, "value", 0))

    # -- connecting ---------------------------------------------------------------------

    def connect(self, timeout_s: float = 10.0) -> None:
        """Connect and wait for the first CONNACK, pumping the socket on this thread.

        With ``mqtt.protocol = "auto"`` the protocol is found first (:func:`detect_protocol`).
        Raises :class:`BrokerUnavailable` when no CONNACK arrives in ``timeout_s`` seconds or
        the broker refuses (bad credentials, client id not allowed).
        """
        s = self.settings
        if not self.client_id:
            self.set_client_id("edge-queue")
        if s.protocol == "auto":
            found = detect_protocol(s, self.client_id, timeout_s)
            if found == "3.1.1":
                log.info("the broker does not speak MQTT 5; using MQTT 3.1.1")
                self.protocol = mqtt.MQTTv311
                self._client = self._make_client()
        deadline = time.monotonic() + timeout_s
        try:
            if self.protocol == mqtt.MQTTv5:
                self._client.connect(
                    s.host,
                    s.port,
                    keepalive=s.keepalive_s,
                    clean_start=False,
                    properties=connect_properties(self.settings, self.max_packet_bytes),
                )
            else:  # the session flag is the client's clean_session=False
                self._client.connect(s.host, s.port, keepalive=s.keepalive_s)
        except OSError as e:
            raise BrokerUnavailable(f"no MQTT broker at {s.host}:{s.port}: {e}") from e
        while not self.connected and self._refused is None and time.monotonic() < deadline:
            sock = self._client.socket()
            if sock is None:
                break
            select.select([sock], [sock] if self._client.want_write() else [], [], 0.1)
            self.pump(time.monotonic(), reconnect=False)
        if self._refused:
            raise BrokerUnavailable(f"the broker at {s.host}:{s.port} refused us: {self._refused}")
        if not self.connected:
            raise BrokerUnavailable(f"no MQTT broker answered at {s.host}:{s.port} within {timeout_s} s")

    def _reconnect(self, now: float) -> None:
        self._next_reconnect = now + self._reconnect_delay
        self._reconnect_delay = min(RECONNECT_MAX_S, self._reconnect_delay * 2) * (0.75 + random.random() / 4)
        try:
            self._client.reconnect()
        except (OSError, ssl.SSLError) as e:
            self.takeovers.reconnect_failed()
            log.debug("reconnect to %s:%s failed: %s", self.settings.host, self.settings.port, e)

    # -- the loop's side ----------------------------------------------------------------

    def fileno(self) -> socket.socket | None:
        """The socket to wait on for reading (``None`` while disconnected)."""
        sock = self._client.socket()
        return sock if isinstance(sock, socket.socket) else None

    def want_write(self) -> bool:
        """True when paho has bytes the socket did not take yet: wait for writability too."""
        return self._client.socket() is not None and self._client.want_write()

    def wait_s(self, now: float) -> float | None:
        """How long the loop may sleep as far as the bridge goes (``None``: no limit)."""
        if self._more_to_read or (self._client.buffered() and self._may_read()):
            return 0.0
        if self.outbox.out and self.outbox.window_open() and self.connected:
            return 0.0
        if self._client.socket() is None and not self._closing:
            return max(0.0, self._next_reconnect - now)
        return None

    @property
    def holding(self) -> bool:
        """True while the broker is unreachable and ``OFFLINE_HOLD`` messages (or bytes) wait
        for it: no new work should start until the reconnect (docs/operations.md, "Load and
        back-pressure")."""
        return not self.connected and self.outbox.holding()

    @property
    def backlog(self) -> int:
        """Messages waiting here because the broker has not acknowledged earlier ones."""
        return self.outbox.backlog

    @property
    def backlog_bytes(self) -> int:
        """Payload bytes of the messages waiting here and of those not yet acknowledged."""
        return self.outbox.backlog_bytes

    @property
    def unacked(self) -> int:
        """Our publishes handed to paho that the broker has not acknowledged yet."""
        return len(self.outbox.inflight)

    @property
    def held_bytes(self) -> int:
        """Payload bytes made inside the current :meth:`held` block."""
        return self.outbox.held_bytes

    def backlog_high(self) -> bool:
        """True while ``BACKLOG_HIGH`` of our messages (or ``BACKLOG_BYTES_HIGH`` bytes) wait for
        the broker: the service takes no new request until some are acknowledged."""
        return self.outbox.backlog_high()

    def _inbox_full(self) -> bool:
        return len(self.inbox) >= INBOX_HIGH or self.inbox_bytes >= INBOX_BYTES_HIGH

    def _may_read(self) -> bool:
        """False while the inbox is full (back-pressure), except while we wait for the broker's
        acknowledgements (:meth:`backlog_high`) or for its CONNACK: the requests left in the
        inbox by a connection that ended are taken only once the new one is acknowledged, and
        that CONNACK arrives through the socket (docs/operations.md, "Load and back-pressure")."""
        return not self.connected or not self._inbox_full() or self.backlog_high()

    def pump(self, now: float, *, reconnect: bool = True) -> None:
        """Read what arrived (within the budgets), write what waits, keep the connection
        alive, reconnect when due. Never blocks longer than a TCP connect (``connect_timeout``)."""
        client = self._client
        if client.socket() is None:
            if reconnect and not self._closing and now >= self._next_reconnect:
                self._reconnect(now)
            return
        self._read()
        self._hand_over()
        if client.socket() is not None and client.want_write():
            client.loop_write()
        if client.socket() is not None:
            client.loop_misc()

    def _read(self) -> None:
        """Read whole packets until the socket has none, or a budget is reached.

        paho's ``loop_read`` does not say whether the socket ran dry
        (:meth:`FastClient.read_packet` does).
        """
        client = self._client
        self._more_to_read = False
        for _ in range(READ_BUDGET):
            if not self._may_read():
                # back-pressure: leave it in the socket, whatever the broker's Receive Maximum
                # let it send; the service drains the inbox first
                self._more_to_read = False
                return
            if client.socket() is None:
                return
            rc = client.read_packet()
            if rc == MQTTErrorCode.MQTT_ERR_AGAIN:
                return
            if rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
                client.read_failed(rc)
                return
        self._more_to_read = True

    def settle(self) -> None:
        """At the end of a loop turn: when the turn read bytes and sent nothing after them (the
        broker's PUBACKs of our last messages, say), :func:`ack_now`, so that their TCP
        acknowledgement leaves now rather than up to 40 ms later. A turn that sent something
        after its reads carried the acknowledgement with it: no call (under a flood, the
        acknowledgements keep their pace, and so does what the broker sends us)."""
        if self._client.read_since_send:
            self._client.read_since_send = False
            ack_now(self._client)

    def _hand_over(self) -> None:
        if self.connected:
            self.outbox.hand_over(self._client, self.connection)
        else:
            self.outbox.bound_offline()

    # -- what the service sends -----------------------------------------------------------

    def held(self) -> AbstractContextManager[None]:
        """Hold every publish, response and PUBACK made inside; queue them, in order, when the
        block exits normally (after the store's group commit), drop them on an exception."""
        return self.outbox.held()

    def publish(self, topic: str, payload: bytes | str, *, retain: bool = False, expiry_s: int = 0) -> None:
        """Publish at QoS 1 once the enclosing :meth:`held` block has committed (with MQTT 5,
        the broker drops it ``expiry_s`` seconds later when over 0)."""
        self.outbox.put(Pub(topic, payload, retain, expiry_properties(expiry_s, self.protocol)))

    def respond(self, topic: str, payload: bytes, *, correlation_data: bytes | None = None, once: bool = False) -> None:
        """Publish a response (QoS 1, not retained). ``once``: if the connection ends before
        the broker acknowledges it, it is dropped rather than sent again (for topics a client
        named, which the broker may refuse)."""
        props = None
        if correlation_data is not None and self.protocol == mqtt.MQTTv5:
            props = Properties(PacketTypes.PUBLISH)
            props.CorrelationData = correlation_data
        self.outbox.put(Pub(topic, payload, False, props, once))

    def ack(self, msg: Incoming) -> None:
        """Send the PUBACK of a QoS 1 request: call only once its effects are committed."""
        if msg.qos > 0:
            self.outbox.put(Ack(msg.mid, msg.qos, msg.connection))

    def flush(self, timeout_s: float) -> bool:
        """Pump until everything waiting has been acknowledged, at most ``timeout_s`` seconds
        (used when stopping). Returns True when nothing is left."""
        end = time.monotonic() + timeout_s
        while (self.outbox.out or self.outbox.inflight) and self.connected and time.monotonic() < end:
            sock = self._client.socket()
            if sock is None:
                break
            select.select([sock], [sock] if self._client.want_write() else [], [], 0.05)
            self.pump(time.monotonic(), reconnect=False)
        return not self.outbox.out and not self.outbox.inflight

    def close(self, *, offline: bool = True, timeout_s: float = 5.0) -> None:
        """Send what waits, publish ``offline`` (retained), then disconnect."""
        if offline and self.connected:
            self.publish(self.topics.status, OFFLINE, retain=True)
        if self.connected:
            if not self.flush(timeout_s):
                log.warning("stopping with %d messages not acknowledged by the broker", self.backlog + self.unacked)
        self._closing = True
        try:
            self._client.disconnect()
            if self._client.socket() is not None and self._client.want_write():
                self._client.loop_write()
        except (OSError, ValueError):
            pass


def expiry_properties(expiry_s: int, protocol: int) -> Properties | None:
    """PUBLISH properties with a Message Expiry Interval of ``expiry_s`` seconds (None for 0,
    and under MQTT 3.1.1, which has no properties)."""
    if expiry_s <= 0 or protocol != mqtt.MQTTv5:
        return None
    props = Properties(PacketTypes.PUBLISH)
    props.MessageExpiryInterval = expiry_s
    return props


def connect_properties(settings: MqttSettings, max_packet_bytes: int | None) -> Properties:
    """The MQTT 5 CONNECT properties: session expiry (``mqtt.session_expiry_s``), Receive
    Maximum (:data:`RECEIVE_MAXIMUM`), Maximum Packet Size."""
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = settings.session_expiry_s
    props.ReceiveMaximum = RECEIVE_MAXIMUM
    if max_packet_bytes:
        props.MaximumPacketSize = max_packet_bytes
    return props


def follow(watcher: Callable[[bytes, bool], None], msg: mqtt.MQTTMessage) -> None:
    """Hand a message of a followed topic (:attr:`Bridge.watch`) to its watcher, outside any
    turn's transaction. A watcher that cannot write (the disk is full, an I/O error) costs that
    message, logged, never the service's loop."""
    try:
        watcher(bytes(msg.payload), bool(msg.retain))
    except (sqlite3.Error, OSError) as e:
        log.error("could not act on the message on %s: %s", msg.topic[:200], e)


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
