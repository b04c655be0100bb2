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
a later turn. paho's client itself, with its short paths, is :mod:`.paho_client`; finding out what
listens at the address is :mod:`.probe`.

Flow control, end to end (docs/operations.md, "Load and back-pressure"):

- in: the broker sends at most ``RECEIVE_MAXIMUM`` (:mod:`.connecting`) unacknowledged QoS 1
  requests (MQTT 5 Receive Maximum; mosquitto's ``max_inflight_messages`` for MQTT 3.1.1), and a request is
  acknowledged only once committed, so requests that arrive faster than the service commits
  them wait in the broker, not here. The socket is read only while :attr:`inbox` holds fewer
  than ``INBOX_HIGH`` items (:mod:`.inbox`), or while our own publishes wait for acknowledgements (reading is
  how those arrive, so it never stops then).
- out: at most ``WINDOW`` of our QoS 1 publishes are handed to paho without a PUBACK (paho
  numbers them with 16-bit ids); the rest wait in the outbox, whose length the service reads
  (:attr:`Bridge.backlog`) to slow down what it takes in.
"""

from __future__ import annotations

import functools
import logging
import select
import socket
import sqlite3
import ssl
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edge_queue.config.settings import MqttSettings
from edge_queue.errors import BrokerUnavailable

from .connecting import Backoff, new_client, send_connect
from .inbox import Inbox, Incoming, incoming
from .outbox import Ack, Outbox, Pub
from .paho_client import FastClient, ack_now, set_nodelay, subscribe
from .probe import detect_protocol
from .takeover import ForeignMessages, TakeoverRule
from .topics import OFFLINE, Topics

log = logging.getLogger(__name__)

#: Message Expiry properties kept made (:func:`expiry`): ``mqtt.finished_expiry_s``, and the
#: seconds left of the finished jobs a republish sends again (one value per second of age).
EXPIRIES_KEPT = 4096


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
        #: what arrived, in order; the service takes from the left
        self.inbox = Inbox()
        self.protocol: mqtt.MQTTProtocolVersion = mqtt.MQTTv311 if settings.protocol == "3.1.1" else mqtt.MQTTv5
        self.connected = False
        self.connection = 0  # increments at every CONNACK
        self._refused: str | None = None
        #: what we send, held until the turn's commit and paced by the broker's PUBACKs
        self.outbox = Outbox(settings.max_packet_size)
        self._closing = False
        self.backoff = Backoff()  # when to connect again
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
        client = new_client(self.client_id, self.protocol, self.settings, self.topics.status)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_publish = self._on_publish
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
        self.backoff.connected()
        set_nodelay(client)
        # PUBACKs still waiting were for the connection that ended (the broker sends those
        # requests again on this one); the packet limit is this connection's.
        self.outbox.connected(self.connection, self.protocol == mqtt.MQTTv5, properties)
        nodes = self.topics.nodes_prefix if self.on_node is not None else None
        requests = self.topics.requests if self.foreign.shared is None else None  # None: leaving a shared id
        subscribe(client, self.protocol, requests, list(self.watch), nodes)
        session_present = bool(getattr(flags, "session_present", False))
        self.foreign.after_connect(session_present, self.client_id)
        log.info(
            "connected to %s:%s (MQTT %s, session present: %s)",
            self.settings.host,
            self.settings.port,
            self.protocol_name,
            session_present,
        )
        # "online" follows from the service's republish on this event, after the subscription
        # is on its way: requests published after a client sees it are not missed. With the
        # session present, the copies of the old connection's requests still waiting here are
        # dropped: the broker sends those not acknowledged again on this one.
        self.inbox.connected(self.connection, self.protocol_name, session_present)

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
            self.backoff.delay = self.foreign.after_takeover(takeover, self.client_id)
        elif not self._closing and was:
            log.warning("disconnected from the broker (%s); reconnecting", reason)
        self.backoff.ended(now)

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
        self.inbox.add(incoming(msg, command, user, self.connection, self.max_payload_bytes, dropped))

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
        send_connect(self._client, s, self.protocol, self.max_packet_bytes)
        self._pump_while(lambda: not self.connected and self._refused is None, deadline, 0.1)
        if self._refused:
            raise BrokerUnavailable(f"the broker at {s.host}:{s.port} refused us: {self._refused}")
        if not self.connected:
            raise BrokerUnavailable(f"no MQTT broker answered at {s.host}:{s.port} within {timeout_s} s")

    def _reconnect(self, now: float) -> None:
        self.backoff.attempt(now)
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
        if self.inbox.more or (self._client.buffered() and self._may_read()):
            return 0.0
        if self.outbox.out and self.outbox.window_open() and self.connected:
            return 0.0
        if self._client.socket() is None and not self._closing:
            return max(0.0, self.backoff.next_at - now)
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

    def _may_read(self) -> bool:
        """The inbox's rule (:meth:`.Inbox.may_read`) on this connection and outbox."""
        return self.inbox.may_read(self.connected, self.backlog_high())

    def pump(self, now: float, *, reconnect: bool = True) -> None:
        """Read what arrived (within the budgets), write what waits, keep the connection
        alive, reconnect when due. Never blocks longer than a TCP connect (``connect_timeout``)."""
        client = self._client
        if client.socket() is None:
            if reconnect and not self._closing and now >= self.backoff.next_at:
                self._reconnect(now)
            return
        self.inbox.read(client, self._may_read)
        self._hand_over()
        if client.socket() is not None and client.want_write():
            client.loop_write()
        if client.socket() is not None:
            client.loop_misc()

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

    def publish(
        self,
        topic: str,
        payload: bytes | str,
        *,
        retain: bool = False,
        expiry_s: int = 0,
        receipt: Callable[[int], None] | None = None,
    ) -> None:
        """Publish at QoS 1 once the enclosing :meth:`held` block has committed (with MQTT 5,
        the broker drops it ``expiry_s`` seconds later when over 0). ``receipt``: called with
        the PUBACK's reason code (MQTT 5; 0 with 3.1.1) once the broker acknowledges it."""
        if expiry_s > 0 and self.protocol == mqtt.MQTTv5:
            props, packed = expiry(expiry_s)
            self.outbox.put(Pub(topic, payload, retain, props, receipt=receipt, packed=packed))
        else:
            self.outbox.put(Pub(topic, payload, retain, receipt=receipt))

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
        self._pump_while(lambda: bool(self.outbox.out or self.outbox.inflight) and self.connected, end, 0.05)
        return not self.outbox.out and not self.outbox.inflight

    def _pump_while(self, waiting: Callable[[], bool], end: float, poll_s: float) -> None:
        """Pump on this thread while ``waiting()`` and before ``end`` (monotonic), ``poll_s``
        seconds at most in each ``select``; ends with the socket."""
        while waiting() and time.monotonic() < end:
            sock = self._client.socket()
            if sock is None:
                break
            select.select([sock], [sock] if self._client.want_write() else [], [], poll_s)
            self.pump(time.monotonic(), reconnect=False)

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


@functools.lru_cache(maxsize=EXPIRIES_KEPT)
def expiry(expiry_s: int) -> tuple[Properties, bytes]:
    """MQTT 5 PUBLISH properties with a Message Expiry Interval of ``expiry_s`` seconds (> 0),
    and their packed bytes: one shared object per value, made once (every finished job's
    retained state carries ``mqtt.finished_expiry_s``; a republish, the seconds each one has
    left). Never change one: it is shared by every message that carries it."""
    props = Properties(PacketTypes.PUBLISH)
    props.MessageExpiryInterval = expiry_s
    return props, props.pack()


def follow(watcher: Callable[[bytes, bool], None], msg: mqtt.MQTTMessage) -> None:
    """Hand a message of a followed topic (:attr:`Bridge.watch`) to its watcher, outside any
    turn's transaction. A watcher that cannot write (the disk is full, an I/O error) costs that
    message, logged, never the service's loop."""
    try:
        watcher(bytes(msg.payload), bool(msg.retain))
    except (sqlite3.Error, OSError) as e:
        log.error("could not act on the message on %s: %s", msg.topic[:200], e)
