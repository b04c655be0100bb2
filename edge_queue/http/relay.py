"""The queue page's ``/mqtt`` relay (``http.websocket_proxy``; docs/operations.md, "Behind a
reverse proxy or Home Assistant's ingress"): the page's WebSocket handshake sent on to the
broker's WebSocket listener, then every byte both ways.

What a relayed connection must pass, in order:

- a WebSocket upgrade (else 400);
- an ``Origin`` of the queue page's, or none (:mod:`edge_queue.mqtt.origins`; else 403): a web
  site open in a browser cannot reach the broker through the page;
- a broker that asks for a login, when the page listens beyond this box (``http.host`` not a
  loopback address; else 403): an anonymous broker is never handed to the LAN
  (:class:`LoginGate`, an anonymous CONNECT tried on the broker's listener);
- a free relay slot: :data:`MAX_RELAYS` in all, :data:`MAX_RELAYS_PER_ADDRESS` per client
  address except ``http.trusted_proxies`` (else 503);
- then the client's MQTT CONNECT within :data:`CONNECT_S` and the broker's answer within
  :data:`ANSWER_S` (:class:`Login`), else the connection is closed: a slot is held by a login,
  not by a socket that sent a handshake.
"""

from __future__ import annotations

import ipaddress
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

#: Relayed WebSockets at once at most (each holds a connection of the page's 64).
MAX_RELAYS = 32
#: Relayed WebSockets of one client address at most (a quarter), unless it is one of
#: ``http.trusted_proxies``: behind Home Assistant's ingress every page comes from one address.
MAX_RELAYS_PER_ADDRESS = MAX_RELAYS // 4
#: Seconds a relayed WebSocket may carry nothing either way (the page's MQTT keepalive is 30 s).
RELAY_IDLE_S = 300.0
#: Seconds from the handshake to the client's MQTT CONNECT (the page sends it at once).
CONNECT_S = 5.0
#: Seconds from the handshake to the broker's answer to it (CONNACK; a broker checking a
#: password hash, or asking an authentication plug-in, takes up to a second).
ANSWER_S = 10.0
#: Seconds a login check's verdict holds before the broker is asked again.
LOGIN_CHECK_S = 60.0
#: MQTT's CONNECT packet type (first byte, MQTT 3.1.1 and 5 section 3.1.1).
_MQTT_CONNECT = 0x10
#: WebSocket opcodes of data frames: continuation, text, binary (RFC 6455 section 5.2).
_BINARY = 0x2


def is_loopback(host: str) -> bool:
    """``host`` (an address or ``localhost``) reaches this box only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def first_frame(data: bytes) -> tuple[int, int | None] | None:
    """The opcode and the first payload byte (unmasked; None for an empty payload) of the
    WebSocket frame at the start of ``data`` (RFC 6455 section 5.2), or None while ``data``
    is too short to tell."""
    if len(data) < 2:
        return None
    opcode, masked, length = data[0] & 0x0F, bool(data[1] & 0x80), data[1] & 0x7F
    at = 2 + {126: 2, 127: 8}.get(length, 0)
    if length >= 126:
        if len(data) < at:
            return None
        length = int.from_bytes(data[2:at], "big")
    mask = data[at : at + 4] if masked else b"\0"
    at += 4 if masked else 0
    if length == 0:
        return (opcode, None) if len(data) >= at else None
    if len(data) <= at or len(mask) < (4 if masked else 1):
        return None
    return opcode, data[at] ^ mask[0]


class Login:
    """Whether a relayed connection logs in in time: the client's first WebSocket frame is a
    binary frame holding an MQTT CONNECT, within :data:`CONNECT_S` of ``start``, and the
    broker answers (anything after its ``101`` head: the CONNACK) within :data:`ANSWER_S`.
    Plain: fed the bytes each way and asked with ``now`` (``time.monotonic()``)."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.connect_seen = False
        self.answered = False
        self._from_client = b""
        self._from_broker = b""

    @property
    def done(self) -> bool:
        """Both seen: the connection is an MQTT session the broker answered."""
        return self.connect_seen and self.answered

    def client_sent(self, data: bytes) -> bool:
        """Feed bytes from the client; False when its first frame is not an MQTT CONNECT."""
        if self.connect_seen:
            return True
        self._from_client = (self._from_client + data)[:16]
        frame = first_frame(self._from_client)
        if frame is None:
            return True
        opcode, first = frame
        if opcode != _BINARY or first is None or first & 0xF0 != _MQTT_CONNECT:
            return False
        self.connect_seen = True
        return True

    def broker_sent(self, data: bytes) -> None:
        """Feed bytes from the broker (its handshake answer first)."""
        if self.answered:
            return
        self._from_broker = (self._from_broker + data)[-65536:]
        head_end = self._from_broker.find(b"\r\n\r\n")
        self.answered = head_end >= 0 and len(self._from_broker) > head_end + 4

    def overdue(self, now: float) -> str | None:
        """What did not come in time, or None."""
        if not self.connect_seen and now - self.start >= CONNECT_S:
            return f"no MQTT CONNECT within {CONNECT_S:g} s"
        if not self.answered and now - self.start >= ANSWER_S:
            return f"no answer from the broker within {ANSWER_S:g} s"
        return None

    def next_deadline(self) -> float | None:
        """When :meth:`overdue` may next say something, or None once logged in."""
        if not self.connect_seen:
            return self.start + CONNECT_S
        if not self.answered:
            return self.start + ANSWER_S
        return None


def pump(a: socket.socket, b: socket.socket, idle_s: float, login: Login | None = None) -> str | None:
    """Copy bytes both ways between the client's socket ``a`` and the broker's ``b`` until one
    closes, fails, both stay silent ``idle_s`` seconds, or ``login`` (when given) is overdue or
    refused; returns why the relay ended early for ``login``, else None. A send waits at most
    30 s for a slow reader."""
    a.settimeout(30)
    b.settimeout(30)
    with selectors.DefaultSelector() as sel:
        sel.register(a, selectors.EVENT_READ, b)
        sel.register(b, selectors.EVENT_READ, a)
        while True:
            deadline = login.next_deadline() if login is not None else None
            wait = idle_s if deadline is None else max(0.0, min(idle_s, deadline - time.monotonic()))
            ready = sel.select(wait)
            if login is not None and (why := login.overdue(time.monotonic())) is not None:
                return why
            if not ready:
                if deadline is None or wait >= idle_s:
                    return None
                continue
            for key, _ in ready:
                try:
                    data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                    if not data:
                        return None
                    if login is not None and not login.done:
                        if key.fileobj is a and not login.client_sent(data):
                            return "its first frame is not an MQTT CONNECT"
                        if key.fileobj is b:
                            login.broker_sent(data)
                    key.data.sendall(data)
                except OSError:
                    return None


class RelaySlots:
    """The relay's slots: :data:`MAX_RELAYS` in all, :data:`MAX_RELAYS_PER_ADDRESS` per
    client address except ``trusted`` ones (``http.trusted_proxies``). Thread-safe."""

    def __init__(self, trusted: frozenset[str] = frozenset()) -> None:
        self.trusted = trusted
        self._lock = threading.Lock()
        self._per_address: dict[str, int] = {}
        self.taken = 0

    def take(self, address: str) -> str | None:
        """Take a slot for ``address``; None when taken, else why not."""
        with self._lock:
            if self.taken >= MAX_RELAYS:
                return "too many relayed connections"
            held = self._per_address.get(address, 0)
            if held >= MAX_RELAYS_PER_ADDRESS and address not in self.trusted:
                return "too many relayed connections from this address"
            self.taken += 1
            self._per_address[address] = held + 1
            return None

    def give_back(self, address: str) -> None:
        with self._lock:
            self.taken -= 1
            left = self._per_address.get(address, 1) - 1
            if left > 0:
                self._per_address[address] = left
            else:
                self._per_address.pop(address, None)


class LoginGate:
    """Whether the relay may hand the broker to its client: when the page listens beyond this
    box (``needed``), only a broker that refuses an anonymous CONNECT on its WebSocket listener
    (``check``: :func:`~edge_queue.mqtt.probe.anonymous_over_websocket`). A verdict holds
    :data:`LOGIN_CHECK_S`; a broker that did not answer is asked again next time. Thread-safe;
    the check runs on the caller's thread."""

    def __init__(
        self,
        to: tuple[str, int],
        needed: bool,
        check: Callable[[str, int], bool | None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.to = to
        self.needed = needed
        self._check = check
        self._clock = clock
        self._lock = threading.Lock()
        self._anonymous: bool | None = None
        self._at = 0.0

    def may_relay(self) -> bool | None:
        """True: relay. False: the broker takes clients without a login and the page listens
        beyond this box (refuse; the first time, an ERROR line says so). None: the broker's
        listener did not answer the check (nothing to relay to)."""
        if not self.needed:
            return True
        with self._lock:
            now = self._clock()
            if self._anonymous is None or now - self._at >= LOGIN_CHECK_S:
                anonymous = self._check(*self.to)
                if anonymous is True and self._anonymous is not True:
                    log.error("queue page: %s", anonymous_line(self.to))
                self._anonymous, self._at = anonymous, now
            return None if self._anonymous is None else not self._anonymous


def anonymous_line(to: tuple[str, int]) -> str:
    """The one line said when the relay refuses an anonymous broker."""
    return (
        f"/mqtt is not relayed: the broker's WebSocket listener at {to[0]}:{to[1]} takes clients without a login, "
        "and the page listens beyond this box (http.host); give the broker passwords "
        '(docs/operations.md, "Behind a reverse proxy or Home Assistant\'s ingress") or set http.host = "127.0.0.1"'
    )
