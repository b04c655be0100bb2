"""The MQTT adapter (paho-mqtt 2.x): requests in, retained state, events and responses out.

Speaks MQTT 5 (mosquitto) and MQTT 3.1.1 (amqtt 0.12, which answers an MQTT 5 CONNECT with
"Unsupported protocol version"; ``mqtt.protocol = "auto"`` then falls back). The session is
persistent (fixed client id, ``clean_start``/``clean_session`` false, MQTT 5 session expiry)
and incoming QoS 1 requests are acknowledged by hand, only after the service has committed
them (PRODUCT 4.1), so a request published while the service was away is delivered when it
comes back. The Last Will publishes a retained ``offline`` on ``<base>/status``.

paho's network thread only queues what arrives (:attr:`Bridge.inbox`) and wakes the service
through a socket pair; every decision is taken on the service's own thread.
"""

from __future__ import annotations

import logging
import queue
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from .config import MqttSettings
from .errors import BrokerUnavailable
from .topics import OFFLINE, Topics

log = logging.getLogger(__name__)

#: Our QoS 1 messages that may wait for a PUBACK at once (below paho's 16-bit message ids).
MAX_UNACKED = 20_000


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


@dataclass(slots=True)
class RetainedJob:
    """A retained ``<base>/jobs/<id>`` message read during the start-up scan."""

    job_id: str


@dataclass(slots=True)
class Connected:
    """The bridge (re)connected: the service republishes its retained state (PRODUCT 3 rule 2)."""

    protocol: str


def configure_client(client: mqtt.Client, s: MqttSettings) -> None:
    """Credentials and TLS of ``[mqtt]`` on a paho client."""
    if s.username:
        client.username_pw_set(s.username, s.password.get_secret_value() if s.password else None)
    if s.tls.enabled:
        client.tls_set(
            ca_certs=str(s.tls.ca_file) if s.tls.ca_file else None,
            certfile=str(s.tls.cert_file) if s.tls.cert_file else None,
            keyfile=str(s.tls.key_file) if s.tls.key_file else None,
            cert_reqs=ssl.CERT_NONE if s.tls.insecure else ssl.CERT_REQUIRED,
        )
        client.tls_insecure_set(s.tls.insecure)


def set_nodelay(client: mqtt.Client) -> None:
    """Turn off Nagle's algorithm on the client's socket (paho leaves it on): a small QoS 1
    publish then leaves at once instead of waiting up to 40 ms for the previous one's ACK."""
    sock = client.socket()
    setsockopt = getattr(sock, "setsockopt", None)  # a plain or TLS socket; None before connect
    if setsockopt is not None:
        try:
            setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


def _probe(s: MqttSettings, client_id: str, protocol: mqtt.MQTTProtocolVersion, timeout_s: float) -> str | None:
    """Connect once without a Last Will; the CONNACK reason, or None when none came."""
    answer: dict[str, str] = {}
    done = threading.Event()

    def on_connect(client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        answer["reason"] = str(reason)
        done.set()

    probe = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"{client_id}-probe", protocol=protocol)
    configure_client(probe, s)
    probe.on_connect = on_connect
    probe.on_disconnect = lambda *a: done.set()
    try:
        probe.connect(s.host, s.port, keepalive=s.keepalive_s)
    except OSError as e:
        raise BrokerUnavailable(f"no MQTT broker at {s.host}:{s.port}: {e}") from e
    probe.loop_start()
    try:
        done.wait(timeout_s)
    finally:
        probe.disconnect()
        probe.loop_stop()
    return answer.get("reason")


def detect_protocol(s: MqttSettings, client_id: str, timeout_s: float) -> str:
    """``"5"`` or ``"3.1.1"``: what the broker at ``mqtt.host:port`` speaks.

    Tries an MQTT 5 CONNECT without a Last Will. amqtt 0.12 answers it with "Unsupported
    protocol version", or, when the CONNECT carries credentials or a Will it cannot parse,
    closes the connection without a CONNACK; then MQTT 3.1.1 is tried. Raises
    :class:`BrokerUnavailable` when neither gets an answer within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    last: BrokerUnavailable | None = None
    while time.monotonic() < deadline:  # the broker may still be starting (boot order)
        try:
            reason = _probe(s, client_id, mqtt.MQTTv5, min(5.0, max(deadline - time.monotonic(), 0.5)))
            if reason is not None and reason != "Unsupported protocol version":
                return "5"
            if _probe(s, client_id, mqtt.MQTTv311, max(deadline - time.monotonic(), 0.5)) is not None:
                return "3.1.1"
        except BrokerUnavailable as e:
            last = e
            time.sleep(min(1.0, max(deadline - time.monotonic(), 0)))
    raise last or BrokerUnavailable(f"no MQTT broker answered at {s.host}:{s.port} within {timeout_s} s")


class Bridge:
    """One paho client for the service.

    Args:
        settings: the ``[mqtt]`` section.
        topics: the topic set of ``mqtt.base_topic``.
        client_id: overrides ``settings.client_id`` (tests run several services at once).
    """

    def __init__(self, settings: MqttSettings, topics: Topics, client_id: str | None = None) -> None:
        self.settings = settings
        self.topics = topics
        self.client_id = client_id or settings.client_id
        self.inbox: queue.SimpleQueue[Incoming | Connected | RetainedJob] = queue.SimpleQueue()
        self.wake_r, self._wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.protocol: mqtt.MQTTProtocolVersion = mqtt.MQTTv311 if settings.protocol == "3.1.1" else mqtt.MQTTv5
        self.connected = threading.Event()
        self._refused: str | None = None
        self._scanning = False
        self._held: list[Callable[[], object]] | None = None
        self._acks = threading.Condition()
        self._unacked = 0
        self._client = self._make_client()

    @property
    def protocol_name(self) -> str:
        return "5" if self.protocol == mqtt.MQTTv5 else "3.1.1"

    def _make_client(self) -> mqtt.Client:
        v5 = self.protocol == mqtt.MQTTv5
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            protocol=self.protocol,
            clean_session=None if v5 else False,
            manual_ack=True,
        )
        client.max_queued_messages_set(0)
        client.max_inflight_messages_set(100)
        # Capped low: after a broker restart the retained state must be back within seconds.
        client.reconnect_delay_set(min_delay=1, max_delay=4)
        configure_client(client, self.settings)
        client.will_set(self.topics.status, OFFLINE, qos=1, retain=True)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        return client

    # -- paho's thread ------------------------------------------------------------------

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # the socket buffer is full: the service is awake anyway

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        if reason.is_failure:
            self._refused = str(reason)
            log.error("broker refused the connection: %s", reason)
            self.connected.set()  # wakes connect(), which reports the refusal
            return
        self._refused = None
        set_nodelay(client)
        with self._acks:  # paho resends what was in flight; count afresh from here
            self._unacked = 0
            self._acks.notify_all()
        v5 = self.protocol == mqtt.MQTTv5
        if v5:
            opts = SubscribeOptions(qos=1, noLocal=True, retainAsPublished=True)
            client.subscribe(self.topics.requests, options=opts)
            client.subscribe(self.topics.all_jobs, options=SubscribeOptions(qos=0, noLocal=True))
        else:
            client.subscribe(self.topics.requests, 1)
            client.subscribe(self.topics.all_jobs, 0)
        self._scanning = True
        # "online" follows from the service's republish on this Connected event, after the
        # subscription is on its way: requests published after a client sees it are not missed.
        log.info(
            "connected to %s:%s (MQTT %s, session present: %s)",
            self.settings.host,
            self.settings.port,
            self.protocol_name,
            getattr(flags, "session_present", None),
        )
        self.connected.set()
        self.inbox.put(Connected(self.protocol_name))
        self._wake()

    def _on_disconnect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        self.connected.clear()
        with self._acks:
            self._acks.notify_all()
        if reason.is_failure or str(reason) != "Normal disconnection":
            log.warning("disconnected from the broker (%s); reconnecting", reason)

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        command = self.topics.parse_request(msg.topic)
        if command is None:
            client.ack(msg.mid, msg.qos)
            job_id = self.topics.parse_job(msg.topic)
            if job_id and msg.retain and msg.payload and self._scanning:
                self.inbox.put(RetainedJob(job_id))
                self._wake()
            return
        props = getattr(msg, "properties", None)
        response_topic = getattr(props, "ResponseTopic", None) if props else None
        correlation = getattr(props, "CorrelationData", None) if props else None
        self.inbox.put(
            Incoming(
                msg.topic, command, bytes(msg.payload), bool(msg.retain), msg.qos, msg.mid, response_topic, correlation
            )
        )
        self._wake()

    # -- service thread -----------------------------------------------------------------

    def connect(self, timeout_s: float = 10.0) -> None:
        """Connect and start paho's network thread; paho reconnects with backoff from then on.

        With ``mqtt.protocol = "auto"`` the protocol is found first (:func:`detect_protocol`).
        Blocks until the first CONNACK; raises :class:`BrokerUnavailable` when
        none arrives in ``timeout_s`` seconds or the broker refuses (bad credentials).
        """
        s = self.settings
        if s.protocol == "auto":
            found = detect_protocol(s, self.client_id, timeout_s)
            if found == "3.1.1":
                log.info("the broker does not speak MQTT 5; using MQTT 3.1.1")
                self.protocol = mqtt.MQTTv311
                self._client = self._make_client()
        props = None
        if self.protocol == mqtt.MQTTv5:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = s.session_expiry_s
        self.connected.clear()
        self._client.connect_async(s.host, s.port, keepalive=s.keepalive_s, clean_start=False, properties=props)
        self._client.loop_start()
        if not self.connected.wait(timeout_s):
            raise BrokerUnavailable(f"no MQTT broker answered at {s.host}:{s.port} within {timeout_s} s")
        if self._refused:
            self._client.loop_stop()
            raise BrokerUnavailable(f"the broker at {s.host}:{s.port} refused us: {self._refused}")

    def stop_retained_scan(self) -> None:
        """End the start-up read of retained ``<base>/jobs/+`` (see ``Service.on_retained_job``)."""
        self._scanning = False
        self._client.unsubscribe(self.topics.all_jobs)

    def drain_wake(self) -> None:
        try:
            while self.wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    @contextmanager
    def held(self) -> Iterator[None]:
        """Hold every publish, response and PUBACK made inside; send them, in order, when the
        block exits normally (after the store's group commit), drop them on an exception."""
        if self._held is not None:
            yield
            return
        self._held = []
        try:
            yield
            for action in self._held:
                action()
        finally:
            self._held = None

    def _do(self, action: Callable[[], object]) -> None:
        if self._held is None:
            action()
        else:
            self._held.append(action)

    def publish(self, topic: str, payload: bytes | str, *, retain: bool = False) -> None:
        """Publish at QoS 1 (see :meth:`_send` for the bound on what waits for a PUBACK)."""
        self._do(partial(self._send, topic, payload, retain, None))

    def respond(self, topic: str, payload: bytes, *, correlation_data: bytes | None = None) -> None:
        props = None
        if correlation_data is not None and self.protocol == mqtt.MQTTv5:
            props = Properties(PacketTypes.PUBLISH)
            props.CorrelationData = correlation_data
        self._do(partial(self._send, topic, payload, False, props))

    def _send(self, topic: str, payload: bytes | str, retain: bool, props: Properties | None) -> None:
        """Hand one QoS 1 message to paho, keeping at most :data:`MAX_UNACKED` of ours without
        a PUBACK: paho numbers them with 16-bit message ids, so 100,000 retained job topics
        queued at once would overwrite each other (measured: 65,533 of 100,000 arrived).
        Connected, it waits for PUBACKs to free room; while the broker is away a retained
        message over the bound is dropped, since the republish on reconnect sends it again."""
        with self._acks:
            if self._unacked >= MAX_UNACKED:
                if not self.connected.is_set() and retain:
                    return
                self._acks.wait_for(lambda: self._unacked < MAX_UNACKED or not self.connected.is_set(), 30)
            self._unacked += 1
        self._client.publish(topic, payload, qos=1, retain=retain, properties=props)

    def _on_publish(self, client: mqtt.Client, userdata: Any, mid: int, reason: Any, properties: Any) -> None:
        with self._acks:
            self._unacked = max(0, self._unacked - 1)
            self._acks.notify_all()

    def ack(self, msg: Incoming) -> None:
        """Send the PUBACK of a QoS 1 request: call only once its effects are committed."""
        if msg.qos > 0:
            self._do(partial(self._client.ack, msg.mid, msg.qos))

    def close(self, *, offline: bool = True, timeout_s: float = 5.0) -> None:
        """Publish ``offline`` (retained), wait for it to be sent, then disconnect."""
        try:
            if offline and self.connected.is_set():
                info = self._client.publish(self.topics.status, OFFLINE, qos=1, retain=True)
                info.wait_for_publish(timeout_s)
        except (RuntimeError, ValueError) as e:
            log.warning("could not publish offline: %s", e)
        self._client.disconnect()
        self._client.loop_stop()
