"""The queue page's ``/mqtt`` relay (``http.websocket_proxy``; docs/operations.md, "Behind a
reverse proxy or Home Assistant's ingress"): a WebSocket route of the page's Starlette
application (:class:`Relay`) that opens its own WebSocket to the broker's listener and carries
every message both ways.

What a relayed connection must pass, in order:

- a WebSocket upgrade (else 400, :mod:`.page`);
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

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from starlette.responses import PlainTextResponse
from starlette.websockets import WebSocket, WebSocketDisconnect
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import WebSocketException
from websockets.typing import Subprotocol

from edge_queue.config.values import canonical_address
from edge_queue.mqtt.origins import PageOrigins, origin_refusal
from edge_queue.rules.rates import RefusalLog

from .server import Connections

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


class Login:
    """Whether a relayed connection logs in in time: the client's first WebSocket message is a
    binary one starting with an MQTT CONNECT, within :data:`CONNECT_S` of ``start``, and the
    broker answers (its first message: the CONNACK) within :data:`ANSWER_S`. Plain: fed the
    messages each way and asked with ``now`` (``time.monotonic()``)."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.connect_seen = False
        self.answered = False

    @property
    def done(self) -> bool:
        """Both seen: the connection is an MQTT session the broker answered."""
        return self.connect_seen and self.answered

    def client_sent(self, data: bytes, binary: bool = True) -> bool:
        """Feed a message from the client (``binary``, or text); False when its first is not a
        binary message starting with an MQTT CONNECT."""
        if self.connect_seen:
            return True
        if not binary or not data or data[0] & 0xF0 != _MQTT_CONNECT:
            return False
        self.connect_seen = True
        return True

    def broker_sent(self) -> None:
        """A message came from the broker."""
        self.answered = True

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


async def pump(client: WebSocket, broker: ClientConnection, idle_s: float, login: Login) -> str | None:
    """Carry every message both ways between the client's WebSocket and the broker's until one
    closes, fails, both stay silent ``idle_s`` seconds, or ``login`` is overdue or refused;
    returns why the relay ended early for ``login``, else None."""
    last = [time.monotonic()]

    async def from_client() -> str | None:
        while True:
            message = await client.receive()
            if message["type"] == "websocket.disconnect":
                return None
            binary = message.get("bytes") is not None
            data: bytes | str = message["bytes"] if binary else message.get("text") or ""
            raw = data if isinstance(data, bytes) else data.encode()
            if not login.client_sent(raw, binary):
                return "its first frame is not an MQTT CONNECT"
            await broker.send(data)
            last[0] = time.monotonic()

    async def from_broker() -> str | None:
        async for message in broker:
            login.broker_sent()
            if isinstance(message, bytes):
                await client.send_bytes(message)
            else:
                await client.send_text(message)
            last[0] = time.monotonic()
        return None

    async def watch() -> str | None:
        while True:
            deadline = login.next_deadline()
            until = last[0] + idle_s if deadline is None else min(last[0] + idle_s, deadline)
            await asyncio.sleep(max(0.0, until - time.monotonic()))
            now = time.monotonic()
            if (why := login.overdue(now)) is not None:
                return why
            if now - last[0] >= idle_s:
                return None

    tasks = [asyncio.ensure_future(f()) for f in (from_client, from_broker, watch)]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    ended = [t for t in done if t.exception() is None]  # a failed send or receive: the relay ends
    return ended[0].result() if ended else None


class RelaySlots:
    """The relay's slots: :data:`MAX_RELAYS` in all, :data:`MAX_RELAYS_PER_ADDRESS` per
    client address except ``trusted`` ones (``http.trusted_proxies``). Thread-safe."""

    def __init__(self, trusted: frozenset[str] = frozenset()) -> None:
        self.trusted = frozenset(canonical_address(a) for a in trusted)
        self._lock = threading.Lock()
        self._per_address: dict[str, int] = {}
        self.taken = 0

    def take(self, address: str) -> str | None:
        """Take a slot for ``address``; None when taken, else why not."""
        with self._lock:
            if self.taken >= MAX_RELAYS:
                return "too many relayed connections"
            held = self._per_address.get(address, 0)
            if held >= MAX_RELAYS_PER_ADDRESS and canonical_address(address) not in self.trusted:
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


class Relay:
    """The ``/mqtt`` endpoint of the page's Starlette application (:meth:`serve`, a
    ``WebSocketRoute``): the checks of the module, in order, each refusal an HTTP answer to the
    handshake; then a WebSocket of its own to the broker's listener ``to`` (without the
    client's ``Origin``), and every message both ways (:func:`pump`).

    ``origins``: the page's (:func:`~edge_queue.mqtt.origins.page_origins`); ``gate``: the
    login check; ``trusted``: ``http.trusted_proxies``. ``connections`` (set by the page's
    server): a relayed WebSocket stops counting against its address's connections, it counts
    as a relay. Refused origins are logged at most once a minute (:class:`RefusalLog`)."""

    def __init__(
        self, to: tuple[str, int], origins: PageOrigins, gate: LoginGate, trusted: frozenset[str] = frozenset()
    ) -> None:
        self.to = to
        self.origins = origins
        self.gate = gate
        self.slots = RelaySlots(trusted)
        self.refusals = RefusalLog()
        self.connections: Connections | None = None

    async def serve(self, ws: WebSocket) -> None:
        peer = (ws.client.host, ws.client.port) if ws.client else ("?", 0)
        address = peer[0]
        sent = ws.headers.getlist("origin")
        server = ws.scope.get("server")
        local = (str(server[0]), int(server[1])) if server else None
        headers = {name: value for name, value in ws.headers.items()}
        why = origin_refusal(self.origins, sent, local=local, remote=address, headers=headers)
        if why is not None:
            shown = sent[0] if len(sent) == 1 else sent
            text = f"page: refused a relayed WebSocket from {address} with Origin {shown!r}: {why}"
            if (line := self.refusals.line(text[:400], time.monotonic())) is not None:
                log.warning("%s", line)
            await refuse(ws, 403, "this page may not connect to the broker")
            return
        allowed = await asyncio.to_thread(self.gate.may_relay)  # may ask the broker: off the loop
        if allowed is False:
            await refuse(ws, 403, "the broker takes clients without a login: not relayed")
            return
        if allowed is None:
            await refuse(ws, 502, "the broker's WebSocket listener does not answer")
            return
        if (why := self.slots.take(address)) is not None:
            await refuse(ws, 503, why)
            return
        if self.connections is not None:
            self.connections.not_by_address(peer)
        try:
            await self._relay(ws, address)
        finally:
            self.slots.give_back(address)

    async def _relay(self, ws: WebSocket, address: str) -> None:
        host, port = self.to
        url = f"ws://{f'[{host}]' if ':' in host else host}:{port}/"
        asked = [Subprotocol(p) for p in ws.scope.get("subprotocols") or []]
        try:
            broker = await connect(
                url, subprotocols=asked or None, open_timeout=5, max_size=None, ping_interval=None, compression=None
            )
        except (OSError, TimeoutError, WebSocketException) as e:
            log.warning("page: the broker's WebSocket listener %s:%d does not answer: %s", host, port, e)
            await refuse(ws, 502, "the broker's WebSocket listener does not answer")
            return
        async with broker:
            await ws.accept(subprotocol=broker.subprotocol)
            why = await pump(ws, broker, RELAY_IDLE_S, Login(time.monotonic()))
            if why is not None:
                log.debug("page: closed a relayed WebSocket from %s: %s", address, why)
            try:
                await ws.close()
            except (WebSocketDisconnect, RuntimeError):  # the client has gone already
                pass


async def refuse(ws: WebSocket, status: int, text: str) -> None:
    """Answer a WebSocket handshake with ``status`` and ``text`` (a line), then close."""
    await ws.send_denial_response(PlainTextResponse(text + "\n", status, headers={"connection": "close"}))
