"""The embedded broker's MQTT over WebSocket listeners, served by the websockets library with
the queue page's origins only (:mod:`edge_queue.mqtt.origins`; docs/operations.md, "Which pages
may connect to the broker").

amqtt 0.12 opens its ``ws`` listeners with ``websockets.serve`` and no ``Origin`` check: any web
site open in a browser on the box could connect as an anonymous client. The embedded broker
turns each ``ws`` listener into one of amqtt's ``external`` listeners and serves it here: the
same websockets server (subprotocol ``mqtt``, TLS when the listener has ``ssl``), with a
handshake check (websockets' public ``process_request`` hook) before the connection is handed to
amqtt's public ``Broker.ws_connected``. A listener's ``max_connections`` is kept: connections over
it are answered 503. Nothing here imports amqtt. Also: which port the embedded broker's listener
for the page takes (:func:`page_listener_port`).

The websockets library logs a line per connection at INFO (``connection open``, ``connection
rejected (403 Forbidden)``) on ``websockets.server``: any client on the LAN could fill the journal
with them. That logger is set to show them only when edge-queue logs at DEBUG
(:func:`library_log_level`); refused handshakes are logged here, at most one line a minute.
"""

from __future__ import annotations

import logging
import socket
import ssl as tls
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from http import HTTPStatus
from pathlib import Path
from typing import Any

from edge_queue.config.settings import Settings
from edge_queue.rules.rates import RefusalLog

from .origins import PageOrigins, origin_refusal

log = logging.getLogger(__name__)


@dataclass
class WsListener:
    """One ``ws`` listener of the broker's configuration: its name, address, TLS settings and
    connection bound (0: none), as amqtt's ``ListenerConfig`` gives them."""

    name: str
    bind: str
    max_connections: int = 0
    ssl: bool = False
    cafile: str | Path | None = None
    capath: str | Path | None = None
    cadata: str | Path | None = None
    certfile: str | Path | None = None
    keyfile: str | Path | None = None

    def address(self) -> tuple[str | None, int]:
        """``(host, port)`` of ``bind`` (``"127.0.0.1:9001"``, ``"[::1]:9001"``, ``":9001"``)."""
        host, _, port = self.bind.rpartition(":")
        return (host.strip("[]") or None), int(port)

    def ssl_context(self) -> tls.SSLContext | None:
        """The listener's TLS context, as amqtt builds it for its own listeners."""
        if not self.ssl:
            return None
        context = tls.create_default_context(
            tls.Purpose.CLIENT_AUTH,
            cafile=self.cafile,
            capath=self.capath,
            cadata=str(self.cadata) if self.cadata is not None else None,
        )
        context.load_cert_chain(str(self.certfile), str(self.keyfile) if self.keyfile else None)
        context.verify_mode = tls.CERT_OPTIONAL
        return context


class _Gate:
    """The handshake check of one listener: the page's origins, and ``max_connections``."""

    def __init__(self, listener: WsListener, origins: PageOrigins) -> None:
        self.listener = listener
        self.origins = origins
        self.open = 0
        self.refusals = RefusalLog()

    def check(self, connection: Any, request: Any) -> Any:
        headers = {k.lower(): v for k, v in request.headers.raw_items()}
        local = connection.local_address[:2] if connection.local_address else None
        remote = connection.remote_address[0] if connection.remote_address else None
        sent = request.headers.get_all("Origin")
        why = origin_refusal(self.origins, sent, local=local, remote=remote, headers=headers)
        if why is not None:
            shown = sent[0] if len(sent) == 1 else sent
            text = f"embedded broker: refused a WebSocket from {remote or '?'} with Origin {shown!r}: {why}"
            if (line := self.refusals.line(text[:400], time.monotonic())) is not None:
                log.warning("%s", line)
            return connection.respond(HTTPStatus.FORBIDDEN, "this page may not connect to the broker\n")
        if self.listener.max_connections > 0 and self.open >= self.listener.max_connections:
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "too many connections\n")
        return None

    async def handle(self, connected: Callable[..., Awaitable[None]], connection: Any) -> None:
        self.open += 1
        try:
            await connected(connection, listener_name=self.listener.name)
        finally:
            self.open -= 1


def library_log_level(level: int) -> int:
    """The level of the ``websockets.server`` logger when edge-queue logs at ``level``: its
    per-connection lines at DEBUG only, its warnings and errors always."""
    return logging.DEBUG if level <= logging.DEBUG else logging.WARNING


async def serve_listeners(
    listeners: list[WsListener], connected: Callable[..., Awaitable[None]], origins: PageOrigins
) -> list[Any]:
    """Start a websockets server for each of ``listeners``, handing each accepted connection to
    ``connected(connection, listener_name=...)`` (amqtt's ``Broker.ws_connected``); the servers
    (close each with ``close()`` and ``await wait_closed()``). Raises ``OSError`` when an
    address cannot be bound."""
    from websockets.asyncio.server import serve
    from websockets.typing import Subprotocol

    logging.getLogger("websockets.server").setLevel(library_log_level(logging.getLogger().getEffectiveLevel()))
    servers = []
    for listener in listeners:
        gate = _Gate(listener, origins)
        host, port = listener.address()
        server = await serve(
            partial(gate.handle, connected),
            host,
            port,
            ssl=listener.ssl_context(),
            subprotocols=[Subprotocol("mqtt")],
            process_request=gate.check,
        )
        servers.append(server)
    return servers


def page_listener_port(settings: Settings) -> int | None:
    """The embedded broker's MQTT over WebSocket port for the queue page (``http.websocket_port``),
    or ``None`` when the page is off or the port is taken (then the broker runs without it: the
    page is worth less than the queue)."""
    http = settings.http
    if not http.enabled:
        return None
    try:
        with socket.create_connection((settings.mqtt.host, http.websocket_port), timeout=1.0):
            pass
    except OSError:
        return http.websocket_port
    logging.getLogger("edge_queue").warning(
        "%s:%d is in use: the embedded broker runs without its WebSocket listener (http.websocket_port)",
        settings.mqtt.host,
        http.websocket_port,
    )
    return None
