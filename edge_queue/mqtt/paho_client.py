"""paho-mqtt's client with the service's short paths, and small helpers for any paho client.

:class:`FastClient` overrides and calls private names of paho-mqtt's ``Client`` (its read loop,
its PUBLISH and PUBACK handlers, its packet queue, its socket calls) where the service spends its
time under load: one ``recv`` for many packets, one ``send`` for many packets, no objects made
for a plain PUBACK or PUBLISH, MQTT 5 properties decoded from their own bytes only. paho-mqtt
is therefore pinned to one exact version in pyproject.toml; :data:`PAHO_PRIVATE` lists every
private name used here, and tests/test_private_names.py fails, naming the missing one, when
the installed paho no longer has it.

What the private paths buy was measured with bench P1 (``bench/run.py --only P1``; see
bench/profile.md, "What the private paths of the MQTT client buy").
"""

from __future__ import annotations

import socket
import ssl
import struct
import time
from typing import Literal

import paho.mqtt.client as mqtt
from paho.mqtt.client import MQTTMessage
from paho.mqtt.enums import MQTTErrorCode
from paho.mqtt.exception import MalformedPacket
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from edge_queue.config.settings import MqttSettings

#: The paho-mqtt version this module is written against (pyproject.toml pins it).
PAHO_VERSION = "2.2.0"
#: Private names of paho-mqtt's ``Client`` this module overrides (o) or uses (u), checked
#: against the installed paho by tests/test_private_names.py.
PAHO_PRIVATE: dict[str, str] = {
    "Client._packet_read": "o: reads one packet; the short path cuts whole packets out of one recv",
    "Client._packet_handle": "u: dispatches a packet held in _in_packet to its handler",
    "Client._in_packet": "u: the packet being read (dict: command, packet, remaining_length, ...)",
    "Client._msgtime_mutex": "u: guards _last_bytes_received (keepalive)",
    "Client._last_bytes_received": "u: keepalive bookkeeping, updated for each packet read",
    "Client._sock_recv": "o: the socket read; one recv of READ_CHUNK serves many packets",
    "Client._sock_send": "o: the socket write; marks the TCP acknowledgement as carried",
    "Client._sock_close": "o: the socket close; drops the bytes read on the ended connection",
    "Client._packet_queue": "o: joins queued packets into writes of WRITE_CHUNK",
    "Client._out_packet": "u: paho's queue of packets to write",
    "Client._handle_publish": "o: PUBLISH handler; properties decoded from their own bytes",
    "Client._handle_on_message": "o: hands the decoded properties to the message",
    "Client._handle_pubackcomp": "o: PUBACK handler; a plain success PUBACK without new objects",
    "Client._send_puback": "u: the PUBACK of a QoS 1 message (automatic acknowledgement only)",
    "Client._manual_ack": "u: whether PUBACKs are sent by hand (the service's are)",
    "Client._out_messages": "u: our QoS 1 messages awaiting a PUBACK, resent after a reconnect",
    "Client._inflight_messages": "u: paho's count of in-flight messages",
    "Client._mid_generate": "u: the next message id",
    "Client._protocol": "u: the MQTT version of the connection",
    "Client._userdata": "u: passed to on_publish",
    "Client._loop_rc_handle": "u: paho's handling of a read error (disconnect, callbacks)",
    "MQTTMessage._topic": "u: the topic as bytes, set on messages built without paho's constructor",
    "MQTTMessageInfo._published": "u: set by _set_as_published",
    "MQTTMessageInfo._iterpos": "u: paho's iteration state of a message info",
    "MQTTMessageInfo._set_as_published": "o: without paho's threading.Condition",
}


#: Bytes asked of the socket per read: one ``recv`` brings many packets, which paho then takes
#: from memory (paho asks the socket for each packet's first byte, its length and its body).
READ_CHUNK = 64 * 1024
#: Packets queued for the socket are joined into writes of at most this many bytes (paho sends
#: each packet with its own ``send``).
WRITE_CHUNK = 64 * 1024
#: A request's MQTT 5 properties (Response Topic, Correlation Data, user properties) may take
#: this many bytes; a request with more is answered ``invalid_request`` without them being
#: decoded (paho's decoder copies the rest of the packet for every property it reads).
MAX_PROPERTY_BYTES = 8 * 1024


_PUBACK_OK = ReasonCode(PacketTypes.PUBACK)
#: the success reason codes of a PUBACK (MQTT 5.0, 3.4.2.1), one shared, read-only object each,
#: handed to ``on_publish``: 0, and 16 "no matching subscribers" (which the broker sends for
#: every message nobody reads)
_PUBACK_REASONS = {0: _PUBACK_OK, 16: ReasonCode(PacketTypes.PUBACK, identifier=16)}
_NO_PROPERTIES = Properties(PacketTypes.PUBACK)
#: the (empty, shared, never changed) properties of a PUBLISH that came without any
_NO_PUBLISH_PROPERTIES = Properties(PacketTypes.PUBLISH)
#: Linux's ``TCP_QUICKACK`` (tcp(7)); ``None`` where the platform has none (see :func:`ack_now`).
_TCP_QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)


class FastClient(mqtt.Client):
    """paho's client, with shorter paths where the service spends its time at load:

    - reads: one ``recv`` of up to :data:`READ_CHUNK` bytes serves many packets (paho reads a
      packet's first byte, each byte of its length and its body with a ``recv`` each);
    - writes: packets queued in one loop turn are joined and sent with one ``send`` per
      :data:`WRITE_CHUNK` bytes, when the loop calls ``loop_write`` (paho sends each at once);
    - PUBACKs: paho decodes every PUBACK into a new ``ReasonCode`` and ``Properties`` object,
      even one that holds nothing but its message id (a success without properties, which is
      what brokers send). Such a PUBACK is handled here with shared, read-only success values;
      any other goes to paho.

    The client must be driven by ``Bridge.pump`` (``loop_write`` after each turn's
    publishes); it has no network thread.
    """

    _rbuf: bytes = b""
    _rpos = 0
    #: Bytes were read since the last send: their TCP acknowledgement may be delayed
    #: (``Bridge.settle``).
    read_since_send = False

    def buffered(self) -> bool:
        """True when bytes already read from the socket wait to be handled."""
        return self._rpos < len(self._rbuf)

    def read_packet(self) -> MQTTErrorCode:
        """Read and handle one packet: ``MQTT_ERR_AGAIN`` when the socket has none whole.
        (paho's ``loop_read`` reads at most as many packets as it has messages in flight and
        does not say whether the socket ran dry; its ``_packet_read`` does.)"""
        return self._packet_read()

    def read_failed(self, rc: MQTTErrorCode) -> None:
        """What paho does after a failed read (``rc``): close the socket, call on_disconnect."""
        self._loop_rc_handle(rc)

    def forget_message(self, mid: int) -> None:
        """Drop our QoS 1 message ``mid`` from paho's messages to send again after a reconnect."""
        self._out_messages.pop(mid, None)

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
                self._acked((buf[at] << 8) | buf[at + 1], buf[at + 2] if length > 2 else 0)
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

    def _acked(self, mid: int, code: int = 0) -> None:
        """Our QoS 1 publish ``mid`` was acknowledged with success (paho's bookkeeping); ``code``,
        its reason code (0, or 16 "no matching subscribers"), goes to ``on_publish``."""
        msg = self._out_messages.pop(mid, None)
        if msg is not None:
            self._inflight_messages -= 1
            on_publish = self.on_publish
            if on_publish is not None:
                reason = _PUBACK_REASONS.get(code)
                if reason is None:
                    reason = ReasonCode(PacketTypes.PUBACK, identifier=code)
                on_publish(self, self._userdata, mid, reason, _NO_PROPERTIES)  # type: ignore[call-arg]
            msg.info._set_as_published()

    def publish_qos1(
        self,
        topic: str,
        payload: bytes,
        retain: bool,
        properties: Properties | None = None,
        packed: bytes | None = None,
    ) -> int:
        """paho's ``publish(topic, payload, qos=1, retain=retain, properties=properties)``,
        connected, on a topic the service built: the same message kept in ``_out_messages``
        (sent again, with DUP and its ``properties``, after a reconnect, by paho), the packet
        built here, and a :class:`PlainMessageInfo` without paho's per-message
        ``threading.Condition``. ``packed``: ``properties.pack()``, made once by the caller for
        properties it sends many times (a finished job's Message Expiry); both or neither, and
        only under MQTT 5. Returns the message id. Raises ``ValueError`` for a topic paho would
        refuse (empty, wildcards, NUL)."""
        topic_bytes = topic.encode()
        if not topic_bytes or b"+" in topic_bytes or b"#" in topic_bytes or b"\x00" in topic_bytes:
            raise ValueError("Invalid topic.")
        mid = self._mid_generate()
        if mid in self._out_messages:  # paho refuses it too (16-bit ids all in flight)
            return self.publish(topic, payload, qos=1, retain=retain, properties=properties).mid
        v5 = self._protocol == mqtt.MQTTv5
        if not v5 or packed is None:
            properties, packed = None, b"\x00"  # MQTT 5: an empty property section
        message = MQTTMessage.__new__(MQTTMessage)
        message.timestamp = time.monotonic()
        message.dup = False
        message.mid = mid
        message._topic = topic_bytes
        message.payload = payload
        message.qos = 1
        message.retain = retain
        message.info = info = PlainMessageInfo(mid)
        message.properties = properties
        message.state = _WAIT_FOR_PUBACK
        self._out_messages[mid] = message
        self._inflight_messages += 1
        # PUBLISH, QoS 1: fixed header, remaining length, topic, message id, (MQTT 5) the
        # property section, payload (MQTT 5.0 section 3.3)
        size = 2 + len(topic_bytes) + 2 + (len(packed) if v5 else 0) + len(payload)
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
            packet += packed
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
        message.info = PlainMessageInfo(message.mid)
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
            self._acked((packet[0] << 8) | packet[1], packet[2] if len(packet) > 2 else 0)
            return MQTTErrorCode.MQTT_ERR_SUCCESS
        return super()._handle_pubackcomp(cmd)


_PUBLISH, _DISCONNECT = 0x30, 0xE0
_WAIT_FOR_PUBACK = mqtt.mqtt_ms_wait_for_puback


class PlainMessageInfo(mqtt.MQTTMessageInfo):
    """paho's message info without its ``threading.Condition`` (one per message): the
    service never waits on one (:meth:`FastClient.publish_qos1`)."""

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


def subscribe(
    client: mqtt.Client,
    protocol: mqtt.MQTTProtocolVersion,
    requests: str | None,
    watched: list[str],
    nodes: str | None = None,
) -> None:
    """Subscribe to the requests (QoS 1; None: not) and to the topics followed (QoS 0), not to
    our own messages (MQTT 5 No Local); with ``nodes`` (``<base>/nodes/``), to the worker
    nodes' announcements and ``up`` topics (QoS 1, docs/nodes.md)."""
    if nodes is not None:
        client.subscribe([(nodes + "+", 1), (nodes + "+/up", 1)])
    if protocol == mqtt.MQTTv5:
        # Retain Handling 1: retained requests are sent only for a new subscription, not again
        # when the session (and its subscription) survived: a retained request published
        # while we were away arrives once, from the session's queue (MQTT 5.0, 3.8.3.1).
        opts = SubscribeOptions(
            qos=1,
            noLocal=True,
            retainAsPublished=True,
            retainHandling=SubscribeOptions.RETAIN_SEND_IF_NEW_SUB,
        )
        if requests is not None:
            client.subscribe(requests, options=opts)
        for topic in watched:
            client.subscribe(topic, options=SubscribeOptions(qos=0, noLocal=True))
    else:
        if requests is not None:
            client.subscribe(requests, 1)
        for topic in watched:
            client.subscribe(topic, 0)
