"""The machinery of edge-queue's HTTP servers, the HTTP API (:mod:`.api_server`) and the queue
page (:mod:`.page`): uvicorn on a thread of its own (:class:`UvicornThread`), so that no client
ever holds up the service's loop, serving a Starlette application with its h11 protocol and
its WebSocket protocol bounded the same way (:func:`protocols`):

- a deadline for a request's head (:class:`HeaderDeadline`: uvicorn has none of its own, so a
  client sending its headers a byte a minute would hold a connection for ever), from
  connecting and from the end of the previous response: :data:`HEADER_S`;
- at most :attr:`Bounds.at_most` connections at once, and :attr:`Bounds.per_address` from one
  client address (:class:`Connections`), counted until the connection closes, WebSockets too:
  one more is answered (the API's 503 in its error shape, below uvicorn's own limit, whose
  answer is ``text/plain``) or closed unanswered (the page), as :attr:`Bounds.answers` says;
- request heads of at most :data:`MAX_HEADER_BYTES` while incomplete (h11's bound);
- no access log and uvicorn's own lines at WARNING and over only; the start and stop lines are
  the caller's.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

log = logging.getLogger(__name__)

#: Seconds a connection has to send a request's head (its request line and headers): from
#: connecting, and from the end of its previous response.
HEADER_S = 10.0
#: The largest request head (request line and headers), bytes: h11's bound on an incomplete
#: event.
MAX_HEADER_BYTES = 32 * 1024
#: Seconds a refused connection is read (and what it sends dropped) before it is closed, when
#: it was answered.
REFUSED_S = 2.0
#: uvicorn's own limit on connections, this many times :attr:`Bounds.at_most`: never reached,
#: :class:`HeaderDeadline` answers or closes the connections past the bound first.
UVICORN_LIMIT_FACTOR = 4


@dataclass(frozen=True)
class Bounds:
    """One server's bounds.

    ``name`` starts its debug lines (``"HTTP API"``, ``"page"``); ``at_most`` connections at
    once, ``per_address`` of them from one client address; ``keep_alive_s``: seconds an idle
    kept-alive connection stays open; ``answers``: the whole HTTP responses written to a
    connection over its address's share and over ``at_most`` (then read for
    :data:`REFUSED_S` and closed), or None: such a connection is closed at once, unanswered.
    """

    name: str
    at_most: int
    per_address: int
    keep_alive_s: float
    answers: tuple[bytes, bytes] | None = None


class Connections:
    """The open connections of one server, by client address: plain counts, used on the
    server's event loop only (one thread, no locks). A connection is known by its peer
    ``(address, port)``."""

    def __init__(self, at_most: int, per_address: int) -> None:
        self.at_most = at_most
        self.per_address = per_address
        self.by_address: Counter[str] = Counter()
        self.total = 0
        #: connections refused for their address's share, still open (answered, lingering)
        self.refused = 0
        self._open: dict[tuple[str, int], bool | None] = {}  # peer -> counted against its address (None: refused)

    def open(self, peer: tuple[str, int]) -> str | None:
        """Count a new connection from ``peer``; None when it is within the bounds, else
        ``"address"`` (over its address's share: not counted at all, so that the connections
        one address is refused, not closed yet, never take a place of another address's) or
        ``"all"`` (over :attr:`at_most`: counted until :meth:`close`)."""
        if self.by_address[peer[0]] >= self.per_address:
            self._open[peer] = None
            self.refused += 1
            return "address"
        self._open[peer] = True
        self.total += 1
        self.by_address[peer[0]] += 1
        if self.total > self.at_most:
            return "all"
        return None

    def not_by_address(self, peer: tuple[str, int]) -> None:
        """``peer``'s connection stops counting against its address's share (the page's relayed
        WebSockets have bounds of their own); it still counts against :attr:`at_most`."""
        if self._open.get(peer):
            self._open[peer] = False
            self._drop(peer[0])

    def close(self, peer: tuple[str, int]) -> None:
        """``peer``'s connection closed (again: nothing)."""
        if peer not in self._open:
            return
        counted = self._open.pop(peer)
        if counted is None:
            self.refused -= 1
            return
        self.total -= 1
        if counted:
            self._drop(peer[0])

    def _drop(self, address: str) -> None:
        self.by_address[address] -= 1
        if self.by_address[address] <= 0:
            del self.by_address[address]


class HeaderDeadline(H11Protocol):
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request head
    within :data:`HEADER_S` seconds of connecting or of its previous response's end, and
    answering or closing a connection over ``bounds`` (:class:`Connections`). ``cycle`` is
    uvicorn's current request (``None`` until the first head is complete, a new one at each
    head; ``response_complete``), ``client`` its peer: uvicorn's own names, pinned with its
    version and checked by tests/test_http_api.py and tests/test_page.py. Subclassed per server
    by :func:`protocols`, with its own ``bounds`` and ``open_connections``."""

    bounds: ClassVar[Bounds]
    open_connections: ClassVar[Connections]

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._peer = self.client or ("?", 0)
        self._head_deadline: asyncio.TimerHandle | None = None
        over = self.open_connections.open(self._peer)
        self._refused = over is not None
        if over is None:
            self._arm(None)
            return
        if self.bounds.answers is None:
            log.debug("%s: too many connections; closed one from %s", self.bounds.name, self._peer[0])
            transport.close()
            return
        # answered at once, then the request the client sends is read and dropped until it
        # closes (or for REFUSED_S): a close with its request unread would be a reset, which
        # loses the answer on the client's side
        transport.write(self.bounds.answers[0] if over == "address" else self.bounds.answers[1])
        transport.write_eof()
        if self.open_connections.total + self.open_connections.refused > 2 * self.open_connections.at_most:
            transport.close()  # a flood: no lingering, so that uvicorn's own limit is never reached
        else:
            asyncio.get_running_loop().call_later(REFUSED_S, transport.close)

    def data_received(self, data: bytes) -> None:
        if not self._refused:
            super().data_received(data)

    def eof_received(self) -> None:
        if self._refused:
            self.transport.close()

    def _arm(self, cycle: Any) -> None:
        self._head_deadline = asyncio.get_running_loop().call_later(HEADER_S, self._head_late, cycle)

    def _head_late(self, cycle: Any) -> None:
        # still the request of when the deadline was set, and that one answered: no new head came
        idle = self.cycle is cycle and (cycle is None or cycle.response_complete)
        if idle and not self.transport.is_closing():
            log.debug("%s: %s sent no whole request within %g s: closed", self.bounds.name, self._peer[0], HEADER_S)
            self.transport.close()

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._disarm()
            self._arm(self.cycle)

    def handle_websocket_upgrade(self, event: Any) -> None:
        # the head came whole; the WebSocket protocol takes the connection (and closes its count)
        self._disarm()
        super().handle_websocket_upgrade(event)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.open_connections.close(self._peer)
        super().connection_lost(exc)


class BoundedWebSocket(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol (websockets' sans-I/O), taking a connection that
    :class:`HeaderDeadline` counted, and closing its count when it closes. The application
    judges a handshake's ``Origin`` (every one it has is in the scope's headers): websockets'
    own check, which answers 400 to a handshake with two and none of our lines, is left out."""

    open_connections: ClassVar[Connections]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn.process_origin = _origin_of_the_application  # type: ignore[method-assign]

    def connection_lost(self, exc: Exception | None) -> None:
        self.open_connections.close(self.client or ("?", 0))
        super().connection_lost(exc)


def _origin_of_the_application(headers: Any) -> None:
    """websockets' ``ServerProtocol.process_origin`` for :class:`BoundedWebSocket`: no verdict."""
    return None


def protocols(
    bounds: Bounds, http_base: type[HeaderDeadline] = HeaderDeadline
) -> tuple[type[HeaderDeadline], type[BoundedWebSocket], Connections]:
    """The HTTP protocol class (a subclass of ``http_base``) and the WebSocket protocol class of
    one server with ``bounds``, sharing its :class:`Connections` (returned too)."""
    connections = Connections(bounds.at_most, bounds.per_address)
    attrs = {"bounds": bounds, "open_connections": connections}
    http: Any = type(f"{http_base.__name__}_{bounds.name.replace(' ', '_')}", (http_base,), attrs)
    ws: Any = type(f"{BoundedWebSocket.__name__}_{bounds.name.replace(' ', '_')}", (BoundedWebSocket,), attrs)
    return http, ws, connections


class UvicornThread:
    """uvicorn serving the ASGI ``app`` on ``host:port`` within ``bounds``, on a daemon thread
    called ``thread_name``; ``stop_s``: seconds the connections still being answered get when
    it stops; ``http_base``: the server's :class:`HeaderDeadline` (the API answers unreadable
    requests in its error shape). Raises ``OSError`` from the constructor when the address
    cannot be bound."""

    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        bounds: Bounds,
        thread_name: str,
        stop_s: float,
        http_base: type[HeaderDeadline] = HeaderDeadline,
    ) -> None:
        self.sock = socket.create_server((host, port), reuse_port=False)  # OSError: taken
        self.port: int = self.sock.getsockname()[1]
        self.stop_s = stop_s
        http, ws, self.connections = protocols(bounds, http_base)
        config = uvicorn.Config(
            app,
            http=http,
            ws=ws,
            lifespan="off",
            log_config=None,
            log_level="warning",  # its start and stop lines are ours to log
            access_log=False,
            limit_concurrency=UVICORN_LIMIT_FACTOR * bounds.at_most,
            timeout_keep_alive=int(bounds.keep_alive_s),
            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
            server_header=False,
            timeout_graceful_shutdown=int(stop_s),
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, args=(bounds.name,), name=thread_name, daemon=True)

    def _run(self, name: str) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except Exception:  # the server stops; the queue goes on
            log.exception("%s: stopped", name)

    def start(self) -> None:
        self.thread.start()

    def begin_stop(self) -> None:
        """Stop listening and close the idle connections; those being answered get
        ``stop_s``. Returns at once."""
        self.server.should_exit = True

    def stop(self) -> None:
        """:meth:`begin_stop`, wait for the server to be done (``stop_s`` and 5 s at most),
        and close its socket."""
        self.begin_stop()
        if self.thread.is_alive():
            self.thread.join(self.stop_s + 5)
        self.sock.close()
