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
be handed to paho yet waits in :attr:`Bridge._out`, in order, and goes out on a later turn.

Flow control, end to end (docs/operations.md, "Load and limits"):

- in: the broker sends at most ``RECEIVE_MAXIMUM`` unacknowledged QoS 1 requests (MQTT 5
  Receive Maximum; mosquitto's ``max_inflight_messages`` for MQTT 3.1.1), and a request is
  acknowledged only once committed, so requests that arrive faster than the service commits
  them wait in the broker, not here. The socket is read only while :attr:`inbox` holds fewer
  than ``INBOX_HIGH`` items, or while our own publishes wait for acknowledgements (reading is
  how those arrive, so it never stops then).
- out: at most ``WINDOW`` of our QoS 1 publishes are handed to paho without a PUBACK (paho
  numbers them with 16-bit ids); the rest wait in :attr:`_out`, whose length the service reads
  (:attr:`backlog`) to slow down what it takes in.
"""

from __future__ import annotations

import logging
import random
import select
import socket
import ssl
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import paho.mqtt.client as mqtt
from paho.mqtt.client import MQTTMessage
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.exception import MalformedPacket
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from .config import MqttSettings
from .errors import BrokerUnavailable
from .topics import OFFLINE, Topics

log = logging.getLogger(__name__)

#: Our QoS 1 publishes handed to paho and not yet acknowledged, at most (paho's ids are 16-bit),
#: and their payload bytes at most (one larger publish may go alone).
WINDOW = 2_000
WINDOW_BYTES = 8 * 2**20
#: Unacknowledged QoS 1 requests the broker may send us at once (MQTT 5 Receive Maximum).
#: mosquitto 2.0.11 sends more under sustained load: a client that acknowledges as it goes
#: held 1,606 unacknowledged messages at a Receive Maximum of 100. So the inbox bounds itself.
RECEIVE_MAXIMUM = 1_000
#: The socket is not read while the inbox holds this many items or payload bytes, unless the
#: service takes no request until the broker acknowledges some of ours (:data:`BACKLOG_HIGH`):
#: reading is how those acknowledgements arrive.
INBOX_HIGH = 2_000
INBOX_BYTES_HIGH = 32 * 2**20
#: The service takes no new request while this many of our messages wait to be handed to paho,
#: or this many bytes of ours wait for the broker's acknowledgements (:attr:`Bridge.backlog`,
#: :attr:`Bridge.backlog_bytes`).
BACKLOG_HIGH = 5_000
BACKLOG_BYTES_HIGH = 8 * 2**20
#: Packets read per :meth:`Bridge.pump` at most, so one turn stays short.
READ_BUDGET = 2_000
#: Seconds between reconnect attempts: from 1, doubling, at most 4 (the retained state must be
#: back within seconds of a broker restart).
RECONNECT_MIN_S, RECONNECT_MAX_S = 1.0, 4.0
#: MQTT 5 DISCONNECT reason code 0x8E: another connection took our client id (MQTT 5.0, 3.14.2.1).
SESSION_TAKEN_OVER = 0x8E
#: Seconds before reconnecting after a take-over: 10, doubling with each take-over of the last
#: TAKEOVER_WINDOW_S, at most 60.
TAKEOVER_MIN_S, TAKEOVER_MAX_S = 10.0, 60.0
TAKEOVER_WINDOW_S = 600.0
#: A broker that does not say "session taken over" (mosquitto 2.0.11 closes the old connection
#: without a DISCONNECT): this many connections that it ended within SHORT_CONNECTION_S of their
#: start, within SHORT_WINDOW_S, are taken for a take-over (two clients with one id take it from
#: each other every second or two).
SHORT_CONNECTIONS, SHORT_CONNECTION_S, SHORT_WINDOW_S = 3, 10.0, 120.0
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
#: Bytes asked of the socket per read: one ``recv`` brings many packets, which paho then takes
#: from memory (paho asks the socket for each packet's first byte, its length and its body).
READ_CHUNK = 64 * 1024
#: Packets queued for the socket are joined into writes of at most this many bytes (paho sends
#: each packet with its own ``send``).
WRITE_CHUNK = 64 * 1024
#: Seconds a broker gets to answer a probe CONNECT (one for MQTT 5, one for 3.1.1); a broker
#: answers within milliseconds, so a port that answers neither is not an MQTT broker.
PROBE_S = 3.0
#: A request's MQTT 5 properties (Response Topic, Correlation Data, user properties) may take
#: this many bytes; a request with more is answered ``invalid_request`` without them being
#: decoded (paho's decoder copies the rest of the packet for every property it reads).
MAX_PROPERTY_BYTES = 8 * 1024


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


@dataclass(slots=True)
class _Pub:
    topic: str
    payload: bytes | str
    retain: bool
    props: Properties | None = None
    once: bool = False  # not sent again after a disconnect (a copy on a topic a client named)

    @property
    def size(self) -> int:
        return len(self.payload) + len(self.topic)


@dataclass(slots=True)
class _Ack:
    mid: int
    qos: int
    connection: int  # the connection the request came on; a PUBACK is for that one only


_PUBACK_OK = ReasonCode(PacketTypes.PUBACK)
_NO_PROPERTIES = Properties(PacketTypes.PUBACK)
#: the (empty, shared, never changed) properties of a PUBLISH that came without any
_NO_PUBLISH_PROPERTIES = Properties(PacketTypes.PUBLISH)
#: Linux's ``TCP_QUICKACK`` (tcp(7)); ``None`` where the platform has none (see :meth:`Bridge._ack_now`).
_TCP_QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)


class _Client(mqtt.Client):
    """paho's client, with shorter paths where the service spends its time at load:

    - reads: one ``recv`` of up to :data:`READ_CHUNK` bytes serves many packets (paho reads a
      packet's first byte, each byte of its length and its body with a ``recv`` each);
    - writes: packets queued in one loop turn are joined and sent with one ``send`` per
      :data:`WRITE_CHUNK` bytes, when the loop calls ``loop_write`` (paho sends each at once);
    - PUBACKs: paho decodes every PUBACK into a new ``ReasonCode`` and ``Properties`` object,
      even one that holds nothing but its message id (a success without properties, which is
      what brokers send). Such a PUBACK is handled here with shared, read-only success values;
      any other goes to paho.

    The client must be driven by :meth:`Bridge.pump` (``loop_write`` after each turn's
    publishes); it has no network thread.
    """

    _rbuf: bytes = b""
    _rpos = 0
    #: Bytes were read since the last send: their TCP acknowledgement may be delayed
    #: (:meth:`Bridge.settle`).
    read_since_send = False

    def buffered(self) -> bool:
        """True when bytes already read from the socket wait to be handled."""
        return self._rpos < len(self._rbuf)

    def _packet_read(self) -> MQTTErrorCode:
        """paho's, with a short path for a packet that is whole in the read buffer (most are):
        it is cut out of the buffer at once, a success PUBACK is handled in place, anything else
        goes to paho's handlers as paho would give it. A packet cut by the buffer's end, and the
        socket's errors, take paho's path."""
        if self._in_packet["command"] == 0:
            buf, pos = self._rbuf, self._rpos
            if pos >= len(buf):
                # the buffer is filled first, so that the first packet of a read takes the
                # short path too
                try:
                    data = mqtt.Client._sock_recv(self, READ_CHUNK)
                except BlockingIOError:
                    return MQTTErrorCode.MQTT_ERR_AGAIN
                except OSError:
                    return super()._packet_read()  # paho reads again, and reports the error its way
                if not data:
                    return MQTTErrorCode.MQTT_ERR_CONN_LOST
                self.read_since_send = True
                self._rbuf, self._rpos = buf, pos = data, 0
            end = len(buf)
            at, length, shift = pos + 1, 0, 0
            while at < end and shift < 28:
                byte = buf[at]
                at += 1
                length |= (byte & 0x7F) << shift
                shift += 7
                if not byte & 0x80:
                    break
            else:
                return super()._packet_read()  # the length is cut short, or malformed
            if at + length > end:
                return super()._packet_read()
            command = buf[pos]
            self._rpos = at + length
            with self._msgtime_mutex:
                self._last_bytes_received = time.monotonic()
            if command == 0x40 and self._puback_ok(buf, at, length):
                self._acked((buf[at] << 8) | buf[at + 1])
                return MQTTErrorCode.MQTT_ERR_SUCCESS
            self._in_packet = {
                "command": command,
                "have_remaining": 1,
                "remaining_count": [],
                "remaining_mult": 1,
                "remaining_length": length,
                "packet": bytearray(buf[at : at + length]),
                "to_process": 0,
                "pos": 0,
            }
            try:
                rc = self._packet_handle()
            except MalformedPacket:
                rc = MQTTErrorCode.MQTT_ERR_PROTOCOL
            self._in_packet = {
                "command": 0,
                "have_remaining": 0,
                "remaining_count": [],
                "remaining_mult": 1,
                "remaining_length": 0,
                "packet": bytearray(),
                "to_process": 0,
                "pos": 0,
            }
            return rc
        return super()._packet_read()

    @staticmethod
    def _puback_ok(packet: bytes | bytearray, at: int, n: int) -> bool:
        """A PUBACK body of ``n`` bytes at ``packet[at:]`` that says success and holds nothing
        but that: the message id alone, or with a success reason code (0, or 16 "no matching
        subscribers": an event nobody listens to) and an empty property length."""
        return n == 2 or (2 < n <= 4 and packet[at + 2] < 0x80 and not any(packet[at + 3 : at + n]))

    def _acked(self, mid: int) -> None:
        """Our QoS 1 publish ``mid`` was acknowledged with success (paho's bookkeeping)."""
        msg = self._out_messages.pop(mid, None)
        if msg is not None:
            self._inflight_messages -= 1
            on_publish = self.on_publish
            if on_publish is not None:
                on_publish(self, self._userdata, mid, _PUBACK_OK, _NO_PROPERTIES)  # type: ignore[call-arg]
            msg.info._set_as_published()

    def publish_qos1(self, topic: str, payload: bytes, retain: bool) -> int:
        """paho's ``publish(topic, payload, qos=1, retain=retain)`` without MQTT 5 properties,
        connected, on a topic the service built: the same message kept in ``_out_messages``
        (sent again, with DUP, after a reconnect, by paho), the packet built here, and a
        :class:`_Info` without paho's per-message ``threading.Condition``. Returns the
        message id. Raises ``ValueError`` for a topic paho would refuse (empty, wildcards, NUL)."""
        topic_bytes = topic.encode()
        if not topic_bytes or b"+" in topic_bytes or b"#" in topic_bytes or b"\x00" in topic_bytes:
            raise ValueError("Invalid topic.")
        mid = self._mid_generate()
        if mid in self._out_messages:  # paho refuses it too (16-bit ids all in flight)
            return self.publish(topic, payload, qos=1, retain=retain).mid
        message = MQTTMessage.__new__(MQTTMessage)
        message.timestamp = time.monotonic()
        message.dup = False
        message.mid = mid
        message._topic = topic_bytes
        message.payload = payload
        message.qos = 1
        message.retain = retain
        message.info = info = _Info(mid)
        message.properties = None
        message.state = _WAIT_FOR_PUBACK
        self._out_messages[mid] = message
        self._inflight_messages += 1
        # PUBLISH, QoS 1: fixed header, remaining length, topic, message id, (MQTT 5) an empty
        # property section, payload (MQTT 5.0 section 3.3)
        v5 = self._protocol == mqtt.MQTTv5
        size = 2 + len(topic_bytes) + 2 + v5 + len(payload)
        packet = bytearray(((0x32 | retain),))
        while True:
            byte = size & 0x7F
            size >>= 7
            if size:
                packet.append(byte | 0x80)
            else:
                packet.append(byte)
                break
        packet += struct.pack("!H", len(topic_bytes))
        packet += topic_bytes
        packet += struct.pack("!H", mid)
        if v5:
            packet.append(0)
        packet += payload
        self._packet_queue(_PUBLISH, packet, mid, 1, info)
        return mid

    def _sock_recv(self, bufsize: int) -> bytes:
        if self._rpos >= len(self._rbuf):
            data = super()._sock_recv(max(bufsize, READ_CHUNK))  # BlockingIOError: nothing there
            self.read_since_send = True
            if len(data) <= bufsize:
                return data
            self._rbuf, self._rpos = data, 0
        pos = self._rpos
        chunk = self._rbuf[pos : pos + bufsize]
        self._rpos = pos + len(chunk)
        return chunk

    def _sock_send(self, buf: bytes | bytearray) -> int:
        sent = super()._sock_send(buf)
        self.read_since_send = False  # the acknowledgement of what was read leaves with it
        return sent

    def _sock_close(self) -> None:
        self._rbuf, self._rpos = b"", 0  # what was read belonged to the connection that ends
        super()._sock_close()

    def _packet_queue(
        self,
        command: int,
        packet: bytes | bytearray,
        mid: int,
        qos: int,
        info: mqtt.MQTTMessageInfo | None = None,
    ) -> MQTTErrorCode:
        out = self._out_packet
        if out and _joinable(command, qos):
            last = out[-1]
            if _joinable(last["command"], last["qos"]) and last["to_process"] + len(packet) <= WRITE_CHUNK:
                buf = last["packet"]
                if not isinstance(buf, bytearray):
                    buf = last["packet"] = bytearray(buf)
                buf += packet
                last["to_process"] += len(packet)
                return MQTTErrorCode.MQTT_ERR_SUCCESS
        return super()._packet_queue(command, packet, mid, qos, info)

    #: Size of the MQTT 5 properties of the PUBLISH being handled when they were over
    #: MAX_PROPERTY_BYTES and so not decoded; 0 otherwise.
    dropped_property_bytes = 0
    _decoded_properties: Properties | None = None

    def _handle_publish(self) -> MQTTErrorCode:
        """paho's, with the MQTT 5 properties decoded from their own bytes only, and not at all
        when they are over :data:`MAX_PROPERTY_BYTES`: paho's decoder copies the rest of the
        packet (payload included) for every property, so 100,000 user properties took minutes."""
        self.dropped_property_bytes = 0
        header = self._in_packet["command"]
        packet = self._in_packet["packet"]
        qos = (header & 0x06) >> 1
        v5 = self._protocol == mqtt.MQTTv5
        try:
            (slen,) = struct.unpack_from("!H", packet)
            at = 2 + slen + (2 if qos else 0)
            props_len, vbi_len = _decode_vbi(packet, at) if v5 else (0, 0)
        except (struct.error, ValueError, IndexError):
            return MQTTErrorCode.MQTT_ERR_PROTOCOL
        end = at + vbi_len + props_len
        if end > len(packet) or at > len(packet):
            return MQTTErrorCode.MQTT_ERR_PROTOCOL
        if qos < 2 and not props_len and (slen or v5):
            return self._handle_plain_publish(header, packet, slen, qos, end)
        if not v5:
            return super()._handle_publish()
        properties = Properties(PacketTypes.PUBLISH)
        if props_len > MAX_PROPERTY_BYTES:
            self.dropped_property_bytes = props_len
        elif props_len:
            try:
                properties.unpack(bytes(packet[at:end]))
            except Exception:  # text MQTT forbids (a U+FEFF), a repeated property: ignored
                properties = Properties(PacketTypes.PUBLISH)
        # paho decodes the rest, with an empty property section in place of the original
        self._in_packet["packet"] = bytearray(packet[:at]) + b"\x00" + packet[end:]
        self._decoded_properties = properties
        return super()._handle_publish()

    def _handle_plain_publish(self, header: int, packet: bytearray, slen: int, qos: int, body_at: int) -> MQTTErrorCode:
        """A QoS 0 or 1 PUBLISH without MQTT 5 properties (most requests): the message paho's
        ``_handle_publish`` would make, without its decoder's copies, its ``Properties`` objects
        and the ``threading.Condition`` of a message info nobody waits on."""
        message = MQTTMessage.__new__(MQTTMessage)
        message.timestamp = time.monotonic()
        message.state = mqtt.mqtt_ms_invalid
        message.dup = bool(header & 0x08)
        message.mid = ((packet[2 + slen] << 8) | packet[3 + slen]) if qos else 0
        message._topic = bytes(packet[2 : 2 + slen])
        message.payload = bytes(packet[body_at:])
        message.qos = qos
        message.retain = bool(header & 0x01)
        message.info = _Info(message.mid)
        message.properties = _NO_PUBLISH_PROPERTIES if self._protocol == mqtt.MQTTv5 else None
        self._decoded_properties = None
        self._handle_on_message(message)
        if qos == 1 and not self._manual_ack:
            return self._send_puback(message.mid)
        return MQTTErrorCode.MQTT_ERR_SUCCESS

    def _handle_on_message(self, message: mqtt.MQTTMessage) -> None:
        props = getattr(self, "_decoded_properties", None)
        if props is not None:
            message.properties = props
            self._decoded_properties = None
        super()._handle_on_message(message)

    def _handle_pubackcomp(self, cmd: Literal["PUBACK", "PUBCOMP"]) -> MQTTErrorCode:
        packet = self._in_packet["packet"]
        if cmd == "PUBACK" and self._puback_ok(packet, 0, len(packet)):
            self._acked((packet[0] << 8) | packet[1])
            return MQTTErrorCode.MQTT_ERR_SUCCESS
        return super()._handle_pubackcomp(cmd)


_PUBLISH, _DISCONNECT = 0x30, 0xE0
_WAIT_FOR_PUBACK = mqtt.mqtt_ms_wait_for_puback


class _Info(mqtt.MQTTMessageInfo):
    """paho's message info without its ``threading.Condition`` (one per message): the
    service never waits on one (:meth:`_Client.publish_qos1`)."""

    __slots__ = ()

    def __init__(self, mid: int) -> None:  # noqa: D107 - paho's, without the condition
        self.mid = mid
        self._published = False
        self.rc = MQTTErrorCode.MQTT_ERR_SUCCESS
        self._iterpos = 0

    def _set_as_published(self) -> None:
        self._published = True

    def wait_for_publish(self, timeout: float | None = None) -> None:
        raise RuntimeError("the service's publishes are not waited for")


def _no_op(*_: Any) -> None:
    pass


def _joinable(command: int, qos: int) -> bool:
    """Whether a queued packet may share a write with others: not a DISCONNECT (paho closes the
    socket once it is written) nor a QoS 0 PUBLISH (paho reports it published once written)."""
    kind = command & 0xF0
    return kind != _DISCONNECT and not (kind == _PUBLISH and qos == 0)


def _decode_vbi(buf: bytes | bytearray, at: int) -> tuple[int, int]:
    """An MQTT Variable Byte Integer at ``buf[at:]``: ``(value, bytes used)``; ``ValueError``
    when it is longer than 4 bytes or cut short (MQTT 5.0 section 1.5.5)."""
    value = 0
    for i in range(4):
        byte = buf[at + i]
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            return value, i + 1
    raise ValueError("malformed variable byte integer")


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


def ack_now(client: mqtt.Client) -> None:
    """Have the kernel send the TCP acknowledgement of what ``client`` read now, not up to 40 ms
    later.

    Linux delays the ACK of data it receives on a connection that sends data too, to carry it
    on the next packet sent. A broker with Nagle's algorithm on (mosquitto's default, without
    ``set_tcp_nodelay``) holds its next message for us until that ACK arrives. For the
    service, the PUBACKs of a job's last states are the last thing it reads, and a request that
    came within 40 ms waited about 33 ms (``bench/run.py`` P2, "nagle broker": p50 33.5 ms
    before, 2.35 ms after); for a client, the broker's PUBACK of its request is, and the
    response waited about 44 ms behind it. ``TCP_QUICKACK`` (tcp(7), Linux) sends the pending
    ACK at once; it is not permanent, so it is set after reads. About 0.5 µs a call. A no-op
    where the platform lacks it, before the connection and on paho's WebSocket transport.
    """
    # a plain or TLS socket; paho's WebSocket wrapper has no setsockopt
    setsockopt = getattr(client.socket(), "setsockopt", None)
    if _TCP_QUICKACK is None or setsockopt is None:
        return
    try:
        setsockopt(socket.IPPROTO_TCP, _TCP_QUICKACK, 1)
    except OSError:  # a socket closing under us: its error comes from the next read or write
        pass


class QuickAckClient(mqtt.Client):
    """paho's client that acknowledges (TCP) every read at once (:func:`ack_now`), for a
    client driven by paho's own network thread that publishes requests and waits for their
    responses on the same connection (the command line's)."""

    def _sock_recv(self, bufsize: int) -> bytes:
        data = super()._sock_recv(bufsize)
        ack_now(self)
        return data


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


def _probe(
    s: MqttSettings, client_id: str, protocol: mqtt.MQTTProtocolVersion, timeout_s: float, closed: list[bool]
) -> str | None:
    """Connect once without a Last Will; the CONNACK reason, or None when none came (then
    ``closed`` gets True when the other end closed the connection, False when it said nothing)."""
    answer: dict[str, str] = {}
    done = threading.Event()

    def on_connect(client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        answer["reason"] = str(reason)
        done.set()

    probe = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"{client_id}-probe", protocol=protocol)
    configure_client(probe, s)
    probe.on_connect = on_connect
    probe.on_disconnect = lambda *a: done.set()
    probe.connect_timeout = max(0.5, min(timeout_s, 5.0))
    try:
        probe.connect(s.host, s.port, keepalive=s.keepalive_s)
    except OSError as e:
        raise BrokerUnavailable(f"no MQTT broker at {s.host}:{s.port}: {e}") from e
    probe.loop_start()
    try:
        ended = done.wait(timeout_s)
    finally:
        probe.disconnect()
        probe.loop_stop()
    if "reason" not in answer:
        closed.append(ended)
    return answer.get("reason")


def warn_closed_without_answer(s: MqttSettings, deadline: float) -> None:
    """The one line said while waiting on a port that accepts connections and closes them
    without an MQTT answer (a forwarder before a broker not up yet, or not MQTT at all)."""
    log.warning(
        "%s:%s accepts connections but closes them without an MQTT answer: waiting up to %.0f s "
        "for a broker there (is mqtt.port an MQTT broker?)",
        s.host,
        s.port,
        max(0.0, deadline - time.monotonic()),
    )


def detect_protocol(s: MqttSettings, client_id: str, timeout_s: float, *, wait_refused: bool = True) -> str:
    """``"5"`` or ``"3.1.1"``: what the broker at ``mqtt.host:port`` speaks.

    Tries an MQTT 5 CONNECT without a Last Will. amqtt 0.12 answers it with "Unsupported
    protocol version", or, when the CONNECT carries credentials or a Will it cannot parse,
    closes the connection without a CONNACK; then MQTT 3.1.1 is tried. Raises
    :class:`BrokerUnavailable` when neither gets an answer within ``timeout_s`` seconds, and at
    once for a refused connection when ``wait_refused`` is False (the command line: nothing
    listens there, and a person waits).
    Runs once, before the service serves (its probe clients use their own short-lived thread).
    """
    deadline = time.monotonic() + timeout_s
    last: BrokerUnavailable | None = None
    said = False
    while time.monotonic() < deadline:  # the broker may still be starting (boot order)
        try:
            closed: list[bool] = []
            wait = min(PROBE_S, max(deadline - time.monotonic(), 0.5))
            reason = _probe(s, client_id, mqtt.MQTTv5, wait, closed)
            if reason is not None and reason != "Unsupported protocol version":
                return "5"
            if _probe(s, client_id, mqtt.MQTTv311, wait, closed) is not None:
                return "3.1.1"
            if closed and all(closed):
                # Accepted, then closed without an answer: a TCP forwarder (docker-proxy, an
                # SSH tunnel) before a broker that is not up yet, or a service that is not MQTT.
                if not said:
                    warn_closed_without_answer(s, deadline)
                    said = True
                last = BrokerUnavailable(
                    f"{s.host}:{s.port} accepted TCP connections but closed them without an MQTT answer for "
                    f"{timeout_s:.0f} s: is it an MQTT broker? Check mqtt.host and mqtt.port"
                )
                time.sleep(min(1.0, max(deadline - time.monotonic(), 0)))
                continue
            # Something listens there but says nothing: waiting will not change that.
            raise BrokerUnavailable(
                f"{s.host}:{s.port} accepted a TCP connection but answered no MQTT CONNECT "
                f"(MQTT 5 nor 3.1.1, {PROBE_S:.0f} s each): is it an MQTT broker? Check mqtt.host and mqtt.port "
                "(a broker that is stopped or hung, such as a paused process, answers the same)"
            )
        except BrokerUnavailable as e:
            if "accepted a TCP connection" in e.message:
                raise
            if not wait_refused and isinstance(e.__cause__, ConnectionRefusedError):
                raise
            last = e
            time.sleep(min(1.0, max(deadline - time.monotonic(), 0)))
    raise last or BrokerUnavailable(f"no MQTT broker answered at {s.host}:{s.port} within {timeout_s} s")


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
        self._held: list[_Pub | _Ack] | None = None
        #: payload bytes made inside the current :meth:`held` block
        self.held_bytes = 0
        self._out: deque[_Pub | _Ack] = deque()
        self._out_bytes = 0
        #: our publishes handed to paho and not yet acknowledged: message id -> bytes
        self._inflight: dict[int, int] = {}
        self._inflight_bytes = 0
        self._once: set[int] = set()  # message ids of in-flight publishes not to send again
        self._closing = False
        self._next_reconnect = 0.0
        self._reconnect_delay = RECONNECT_MIN_S
        self._more_to_read = False
        self._client: _Client = self._make_client()
        #: other topics to follow (QoS 0, not our own messages): topic -> called with
        #: ``(payload, retained)`` from :meth:`pump` (another installation's ``<base>/info``,
        #: Home Assistant's ``<prefix>/status``)
        self.watch: dict[str, Callable[[bytes, bool], None]] = {}
        #: the broker closed our connection because another client connected with our client id
        self.taken_over = 0
        self._takeovers: list[float] = []
        self._short: list[float] = []  # ends of connections that lasted under SHORT_CONNECTION_S
        self._copies_sent_on = -1  # the last connection a copy on a client-named topic went out on
        self._connected_at = 0.0

    def set_client_id(self, client_id: str) -> None:
        """Use ``client_id`` (before :meth:`connect`)."""
        self.client_id = client_id
        self._client = self._make_client()

    @property
    def protocol_name(self) -> str:
        return "5" if self.protocol == mqtt.MQTTv5 else "3.1.1"

    def _make_client(self) -> _Client:
        v5 = self.protocol == mqtt.MQTTv5
        client = _Client(
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
        client.on_socket_register_write = _no_op
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
        # PUBACKs still waiting were for the connection that ended: the broker sends those
        # requests again on this one, and they are answered then.
        self._out = deque(m for m in self._out if not isinstance(m, _Ack) or m.connection == self.connection)
        if self.protocol == mqtt.MQTTv5:
            # Retain Handling 1: retained requests are sent only for a new subscription, not again
            # when the session (and its subscription) survived: a retained request published
            # while we were away arrives once, from the session's queue (MQTT 5.0, 3.8.3.1).
            opts = SubscribeOptions(
                qos=1,
                noLocal=True,
                retainAsPublished=True,
                retainHandling=SubscribeOptions.RETAIN_SEND_IF_NEW_SUB,
            )
            client.subscribe(self.topics.requests, options=opts)
            for topic in self.watch:
                client.subscribe(topic, options=SubscribeOptions(qos=0, noLocal=True))
        else:
            client.subscribe(self.topics.requests, 1)
            for topic in self.watch:
                client.subscribe(topic, 0)
        session_present = bool(getattr(flags, "session_present", False))
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
        # A copy on a client-named topic sent on this connection explains its end (the broker
        # refusing it), not another client taking our id
        refused_copy = self._copies_sent_on == self.connection
        if self._once:
            # Copies of responses on topics that clients named: not sent again on the next
            # connection, so that one the broker refuses (and closes our connection for)
            # cannot do it again at every reconnect. The response itself was on our topic.
            for mid in self._once:
                client._out_messages.pop(mid, None)
                self._inflight_bytes -= self._inflight.pop(mid, 0)
            log.warning(
                "%d response copie(s) on client-named reply topics were not acknowledged before the connection "
                "ended; they are not sent again",
                len(self._once),
            )
            self._once.clear()
        now = time.monotonic()
        said = getattr(reason, "value", None) == SESSION_TAKEN_OVER
        if was and not self._closing and not refused_copy and now - self._connected_at < SHORT_CONNECTION_S:
            self._short = [t for t in self._short if now - t < SHORT_WINDOW_S] + [now]
        if not self._closing and (said or len(self._short) >= SHORT_CONNECTIONS):
            # Another client connected with our client id (the broker says so in MQTT 5, or
            # mosquitto 2.0.11 just closes our connection each time it connects): reconnecting
            # at once would take the id back and be taken again, a loop that hides who does it.
            self._takeovers = [t for t in self._takeovers if now - t < TAKEOVER_WINDOW_S] + [now]
            self.taken_over += 1
            self._reconnect_delay = min(TAKEOVER_MAX_S, TAKEOVER_MIN_S * 2 ** (len(self._takeovers) - 1))
            log.error(
                "the broker closed our connection because another client connected with our client id %r (%s): "
                "another edge-queue with the same mqtt.client_id, or a client using it; reconnecting in %.0f s",
                self.client_id,
                "it says so"
                if said
                else f"{len(self._short)} connections ended within {SHORT_CONNECTION_S:.0f} s of their start "
                f"in {SHORT_WINDOW_S / 60:.0f} minutes, the broker up all along",
                self._reconnect_delay,
            )
            self._short.clear()
        elif not self._closing and was:
            log.warning("disconnected from the broker (%s); reconnecting", reason)
        self._next_reconnect = now + self._reconnect_delay

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        watcher = self.watch.get(msg.topic)
        if watcher is not None:
            watcher(bytes(msg.payload), bool(msg.retain))
            return
        parsed = self.topics.parse_request(msg.topic)
        if parsed is None:
            if msg.qos:
                client.ack(msg.mid, msg.qos)
            return
        command, user = parsed
        props = getattr(msg, "properties", None)
        response_topic = getattr(props, "ResponseTopic", None) if props else None
        correlation = getattr(props, "CorrelationData", None) if props else None
        size = len(msg.payload)
        payload = b"" if self.max_payload_bytes and size > self.max_payload_bytes else bytes(msg.payload)
        if correlation is not None and len(correlation) > 1024:
            correlation = None  # echoed back: bounded like a transaction
        self.inbox_bytes += len(payload)
        self.inbox.append(
            Incoming(
                msg.topic,
                command,
                payload,
                bool(msg.retain),
                msg.qos,
                msg.mid,
                response_topic,
                correlation,
                bool(msg.dup),
                self.connection,
                size,
                client.dropped_property_bytes if isinstance(client, _Client) else 0,
                user,
            )
        )

    def _on_publish(self, client: mqtt.Client, userdata: Any, mid: int, reason: Any, properties: Any) -> None:
        self._inflight_bytes -= self._inflight.pop(mid, 0)
        self._once.discard(mid)

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
                    s.host, s.port, keepalive=s.keepalive_s, clean_start=False, properties=self._connect_properties()
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

    def _connect_properties(self) -> Properties | None:
        if self.protocol != mqtt.MQTTv5:
            return None
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = self.settings.session_expiry_s
        props.ReceiveMaximum = RECEIVE_MAXIMUM
        if self.max_packet_bytes:
            props.MaximumPacketSize = self.max_packet_bytes
        return props

    def _reconnect(self, now: float) -> None:
        self._next_reconnect = now + self._reconnect_delay
        self._reconnect_delay = min(RECONNECT_MAX_S, self._reconnect_delay * 2) * (0.75 + random.random() / 4)
        try:
            self._client.reconnect()
        except (OSError, ssl.SSLError) as e:
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
        if self._out and self._window_open() and self.connected:
            return 0.0
        if self._client.socket() is None and not self._closing:
            return max(0.0, self._next_reconnect - now)
        return None

    @property
    def holding(self) -> bool:
        """True while the broker is unreachable and :data:`OFFLINE_HOLD` messages (or
        :data:`OFFLINE_HOLD_BYTES` bytes) wait for it: no new work should start until the
        reconnect (docs/operations.md, "Load and back-pressure")."""
        return not self.connected and (len(self._out) >= OFFLINE_HOLD or self._out_bytes >= OFFLINE_HOLD_BYTES)

    @property
    def backlog(self) -> int:
        """Messages waiting here because the broker has not acknowledged earlier ones."""
        return len(self._out)

    @property
    def backlog_bytes(self) -> int:
        """Payload bytes of the messages waiting here and of those not yet acknowledged."""
        return self._out_bytes + self._inflight_bytes

    @property
    def unacked(self) -> int:
        """Our publishes handed to paho that the broker has not acknowledged yet."""
        return len(self._inflight)

    def backlog_high(self) -> bool:
        """True while :data:`BACKLOG_HIGH` of our messages (or :data:`BACKLOG_BYTES_HIGH` bytes)
        wait for the broker: the service takes no new request until some are acknowledged."""
        return len(self._out) >= BACKLOG_HIGH or self.backlog_bytes >= BACKLOG_BYTES_HIGH

    def _inbox_full(self) -> bool:
        return len(self.inbox) >= INBOX_HIGH or self.inbox_bytes >= INBOX_BYTES_HIGH

    def _may_read(self) -> bool:
        """False while the inbox is full (back-pressure), except while we wait for the broker's
        acknowledgements (:meth:`backlog_high`) or for its CONNACK: the requests left in the
        inbox by a connection that ended are taken only once the new one is acknowledged, and
        that CONNACK arrives through the socket (docs/operations.md, "Load and back-pressure")."""
        return not self.connected or not self._inbox_full() or self.backlog_high()

    def _window_open(self) -> bool:
        return len(self._inflight) < WINDOW and (self._inflight_bytes < WINDOW_BYTES or not self._inflight)

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

        paho's ``loop_read`` reads at most as many packets as it has messages in flight and
        does not say whether the socket ran dry; ``_packet_read`` (what ``loop_read`` calls)
        does, by returning ``MQTT_ERR_AGAIN``.
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
            rc = client._packet_read()
            if rc == MQTTErrorCode.MQTT_ERR_AGAIN:
                return
            if rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
                client._loop_rc_handle(rc)
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
        """Give waiting messages to paho, in order, while the window (:data:`WINDOW` messages,
        :data:`WINDOW_BYTES` bytes) of publishes awaiting a PUBACK is open."""
        client, out = self._client, self._out
        if not self.connected:
            if len(out) > OFFLINE_BACKLOG or self._out_bytes > OFFLINE_BACKLOG_BYTES:
                kept: deque[_Pub | _Ack] = deque(m for m in out if isinstance(m, _Pub) and not m.retain)
                dropped = len(out) - len(kept)
                size = sum(m.size for m in kept if isinstance(m, _Pub))
                while kept and (len(kept) > OFFLINE_BACKLOG or size > OFFLINE_BACKLOG_BYTES):
                    size -= kept.popleft().size  # type: ignore[union-attr]
                    dropped += 1
                self._out, self._out_bytes = kept, size
                log.warning("broker unreachable: dropped %d waiting messages (state is republished)", dropped)
            return
        while out and self._window_open():
            m = out.popleft()
            if isinstance(m, _Ack):
                if m.connection == self.connection:
                    client.ack(m.mid, m.qos)
                continue
            size = m.size
            self._out_bytes -= size
            if m.props is None and not m.once and client.socket() is not None:
                # the usual message (state, event, response): paho's bookkeeping, less work
                payload = m.payload.encode() if isinstance(m.payload, str) else m.payload
                mid = client.publish_qos1(m.topic, payload, m.retain)
                self._inflight[mid] = size
                self._inflight_bytes += size
                if client.socket() is None:
                    break
                continue
            info = client.publish(m.topic, m.payload, qos=1, retain=m.retain, properties=m.props)
            self._inflight[info.mid] = size
            self._inflight_bytes += size
            if m.once:
                self._once.add(info.mid)
                self._copies_sent_on = self.connection
            if info.rc == MQTTErrorCode.MQTT_ERR_NO_CONN:
                break  # paho keeps it and sends it after the reconnect
            if client.socket() is None:
                break

    # -- what the service sends -----------------------------------------------------------

    @contextmanager
    def held(self) -> Iterator[None]:
        """Hold every publish, response and PUBACK made inside; queue them, in order, when the
        block exits normally (after the store's group commit), drop them on an exception."""
        if self._held is not None:
            yield
            return
        self._held = []
        self.held_bytes = 0
        try:
            yield
            self._out.extend(self._held)
            self._out_bytes += self.held_bytes
        finally:
            self._held = None
            self.held_bytes = 0

    def _put(self, m: _Pub | _Ack) -> None:
        size = m.size if isinstance(m, _Pub) else 0
        if self._held is None:
            self._out.append(m)
            self._out_bytes += size
        else:
            self._held.append(m)
            self.held_bytes += size

    def publish(self, topic: str, payload: bytes | str, *, retain: bool = False) -> None:
        """Publish at QoS 1, once the enclosing :meth:`held` block has committed."""
        self._put(_Pub(topic, payload, retain))

    def respond(self, topic: str, payload: bytes, *, correlation_data: bytes | None = None, once: bool = False) -> None:
        """Publish a response (QoS 1, not retained). ``once``: if the connection ends before
        the broker acknowledges it, it is dropped rather than sent again (for topics a client
        named, which the broker may refuse)."""
        props = None
        if correlation_data is not None and self.protocol == mqtt.MQTTv5:
            props = Properties(PacketTypes.PUBLISH)
            props.CorrelationData = correlation_data
        self._put(_Pub(topic, payload, False, props, once))

    def ack(self, msg: Incoming) -> None:
        """Send the PUBACK of a QoS 1 request: call only once its effects are committed."""
        if msg.qos > 0:
            self._put(_Ack(msg.mid, msg.qos, msg.connection))

    def flush(self, timeout_s: float) -> bool:
        """Pump until everything waiting has been acknowledged, at most ``timeout_s`` seconds
        (used when stopping). Returns True when nothing is left."""
        end = time.monotonic() + timeout_s
        while (self._out or self._inflight) and self.connected and time.monotonic() < end:
            sock = self._client.socket()
            if sock is None:
                break
            select.select([sock], [sock] if self._client.want_write() else [], [], 0.05)
            self.pump(time.monotonic(), reconnect=False)
        return not self._out and not self._inflight

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
