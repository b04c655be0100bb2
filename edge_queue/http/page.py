"""The queue page's HTTP server: the static files of ``edge_queue/web`` and ``/config.json``.

The page talks to the broker directly, over MQTT over WebSocket; this server hands out only
the page's own files (read once, at start, from the package) and a small configuration built
from the settings (base topic, WebSocket address, version). With ``http.websocket_proxy`` it
also relays the page's WebSocket, byte for byte, to the broker's WebSocket listener on
``/mqtt``: one origin for Home Assistant's ingress and reverse proxies (docs/operations.md,
"Behind a reverse proxy or Home Assistant's ingress"). No job data, no output file and no
other file passes through it, so there is no path to traverse and nothing to log in for: the
broker's passwords and ACL decide what the page may see and do (docs/operations.md, "The
queue page").

A Starlette application (:func:`page_app`) on the same server machinery as the HTTP API
(:mod:`edge_queue.http.server`: uvicorn on a daemon thread, a deadline for a request's head,
bounded connections), so a slow browser never holds up the service's loop.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket

from edge_queue.config.http import HttpSettings
from edge_queue.config.settings import Settings
from edge_queue.config.values import is_loopback
from edge_queue.mqtt.origins import page_origins
from edge_queue.mqtt.probe import anonymous_over_websocket

from .relay import LoginGate, Relay, refuse
from .server import HEADER_S, Bounds, UvicornThread

log = logging.getLogger(__name__)

#: The folder of the page's files inside the package.
WEB_DIR = Path(__file__).resolve().parent.parent / "web"
#: URL path -> (file in :data:`WEB_DIR`, content type). Nothing else is served.
FILES: dict[str, tuple[str, str]] = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/jobs.js": ("jobs.js", "text/javascript; charset=utf-8"),
    "/detail.js": ("detail.js", "text/javascript; charset=utf-8"),
    "/picker.js": ("picker.js", "text/javascript; charset=utf-8"),
    "/style.css": ("style.css", "text/css; charset=utf-8"),
    "/mqtt.min.js": ("mqtt.min.js", "text/javascript; charset=utf-8"),
    "/mqtt.LICENSE.md": ("mqtt.LICENSE.md", "text/markdown; charset=utf-8"),
    "/favicon.svg": ("favicon.svg", "image/svg+xml"),
}
#: index.html's one inline script: a page opened at an address without its trailing slash (an
#: ingress or proxy prefix, ``/api/hassio_ingress/<token>``) would load its relative files from
#: the folder above (404, a blank page), so it goes to the address with the slash first. Not a
#: redirect of the server's: behind a proxy that strips the prefix both addresses arrive as ``/``.
SLASH_SCRIPT = (
    'if(!/(\\/|\\.html)$/.test(location.pathname))location.replace(location.pathname+"/"+location.search+location.hash)'
)
#: Headers of every answer. ``no-cache``: the browser may keep a file but asks (with its ETag)
#: before using it, so an upgrade of edge-queue never mixes old and new files.
HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self' "
        + f"'sha256-{base64.b64encode(hashlib.sha256(SLASH_SCRIPT.encode()).digest()).decode()}'; "
        + "style-src 'self'; img-src 'self' data:; "
        # mqtt.js runs its keepalive timers in a worker made from a blob (worker-timers)
        "connect-src 'self' ws: wss:; worker-src 'self' blob:; "
        + "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
}


def headers(settings: HttpSettings) -> dict[str, str]:
    """The headers of every answer: :data:`HEADERS`, with the origins of
    ``http.frame_ancestors`` (and the page's own) allowed to frame the page, and then no
    ``X-Frame-Options`` (it cannot name an origin; browsers follow ``frame-ancestors``)."""
    if not settings.frame_ancestors:
        return dict(HEADERS)
    out = {k: v for k, v in HEADERS.items() if k != "X-Frame-Options"}
    allowed = " ".join(["'self'", *(o for o in settings.frame_ancestors if o != "'self'")])
    out["Content-Security-Policy"] = out["Content-Security-Policy"].replace(
        "frame-ancestors 'none'", f"frame-ancestors {allowed}"
    )
    return out


def page_config(settings: HttpSettings, base_topic: str, version: str) -> dict[str, Any]:
    """``/config.json``: what the page needs to reach the broker.

    ``{"base_topic", "websocket_url" (a ``ws://`` or ``wss://`` URL, or ``None``: the page
    connects to the host it was loaded from, on ``websocket_port``), "websocket_port", "version"}``.
    """
    return {
        "base_topic": base_topic,
        "websocket_url": settings.websocket_url,
        "websocket_port": settings.websocket_port,
        # relative to the page's own address: the page's server relays it (websocket_proxy)
        "websocket_path": RELAY_PATH.lstrip("/") if settings.websocket_proxy else None,
        "version": version,
    }


#: The path of the relayed WebSocket (``http.websocket_proxy``; :mod:`edge_queue.http.relay`).
RELAY_PATH = "/mqtt"
#: Seconds a client has to send a request line and its headers (the servers' deadline,
#: :data:`~edge_queue.http.server.HEADER_S`), from connecting and from its previous answer.
REQUEST_READ_S = HEADER_S
#: Connections the page serves at once at most; more are closed at once, so that slow or
#: idle connections (a slowloris) cannot take the service's file descriptors.
MAX_CONNECTIONS = 64
#: Connections from one address at once at most (a browser opens about 6): one host's slow
#: connections cannot take the places of the others. A relayed WebSocket counts as a relay
#: instead (:data:`~edge_queue.http.relay.MAX_RELAYS_PER_ADDRESS`).
MAX_CONNECTIONS_PER_ADDRESS = 8
#: Seconds an idle kept-alive connection stays open.
KEEP_ALIVE_S = 5
#: Seconds the answers (and relayed WebSockets) still open get when the page stops.
STOP_S = 2
#: The page's bounds on the servers' machinery: connections past them closed unanswered.
BOUNDS = Bounds("page", MAX_CONNECTIONS, MAX_CONNECTIONS_PER_ADDRESS, KEEP_ALIVE_S)


def page_app(files: dict[str, tuple[bytes, str, str]], headers_out: dict[str, str], relay: Relay | None) -> Starlette:
    """The page's Starlette application: ``files`` (URL path -> body, content type, ETag) for
    GET and HEAD, each answer with ``headers_out``; 404 for any other path, 405 for any other
    method; ``relay``'s WebSocket on :data:`RELAY_PATH` (a plain GET there: 400)."""

    def plain(status: int, text: str, *extra: tuple[str, str]) -> Response:
        headers = {"Content-Type": "text/plain; charset=utf-8", **headers_out, **dict(extra)}
        return Response(text.encode(), status, headers)

    async def answer(request: Request) -> Response:
        path = request.url.path
        if request.method not in ("GET", "HEAD"):
            response = Response(b"", 405, {"Allow": "GET, HEAD"})
        elif relay is not None and path == RELAY_PATH:
            response = plain(400, "WebSocket only\n", ("Connection", "close"))
        elif (found := files.get(path)) is None:
            response = plain(404, "not found\n")
        elif request.headers.get("if-none-match") == found[2]:
            response = Response(None, 304, {"ETag": found[2], **headers_out})
        else:
            response = Response(found[0], 200, {"Content-Type": found[1], "ETag": found[2], **headers_out})
        client = request.client.host if request.client else "?"
        log.debug("page: %s %s %s %d", client, request.method, path, response.status_code)
        return response

    async def no_websocket(ws: WebSocket) -> None:
        await refuse(ws, 404, "not found")

    routes: list[BaseRoute] = [] if relay is None else [WebSocketRoute(RELAY_PATH, relay.serve)]
    routes += [
        WebSocketRoute("/{path:path}", no_websocket),
        Route("/{path:path}", answer, methods=["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE"]),
    ]
    return Starlette(routes=routes)


class PageServer:
    """The queue page on ``settings.host:settings.port``: :func:`page_app` on the servers'
    machinery (:class:`~edge_queue.http.server.UvicornThread`, within :data:`BOUNDS`), on a
    daemon thread.

    Args:
        settings: the ``[http]`` section.
        base_topic: ``mqtt.base_topic``, for ``/config.json``.
        version: the edge-queue version, for ``/config.json``.
        relay_to: ``(host, port)`` of the broker's WebSocket listener, relayed on ``/mqtt``
            (``http.websocket_proxy``); None: no relay.

    Raises ``OSError`` from the constructor when the address cannot be bound (in use, no
    permission) and ``FileNotFoundError`` when a file of the page is missing from the package.
    """

    def __init__(
        self, settings: HttpSettings, base_topic: str, version: str, relay_to: tuple[str, int] | None = None
    ) -> None:
        files: dict[str, tuple[bytes, str, str]] = {}
        for url, (name, ctype) in FILES.items():
            body = (WEB_DIR / name).read_bytes()
            files[url] = (body, ctype, _etag(body))
        config = json.dumps(page_config(settings, base_topic, version)).encode()
        files["/config.json"] = (config, "application/json", _etag(config))
        self.host = settings.host
        self.gate: LoginGate | None = None
        self.relay: Relay | None = None
        if relay_to is not None:
            self.gate = LoginGate(relay_to, not is_loopback(settings.host), anonymous_over_websocket)
            trusted = frozenset(settings.trusted_proxies)
            self.relay = Relay(relay_to, page_origins(settings), self.gate, trusted)
        app = page_app(files, headers(settings), self.relay)
        self.uvicorn = UvicornThread(app, settings.host, settings.port, BOUNDS, "edge-queue-page", STOP_S)
        self.port: int = self.uvicorn.port
        #: the open connections, by address (:class:`~edge_queue.http.server.Connections`)
        self.connections = self.uvicorn.connections
        if self.relay is not None:
            self.relay.origins = replace(self.relay.origins, port=self.port)
            self.relay.connections = self.connections

    def start(self) -> PageServer:
        self.uvicorn.start()
        log.info("queue page on http://%s:%d/", self.host, self.port)
        if self.gate is not None and self.gate.needed:  # the line at start, when it must refuse
            threading.Thread(target=self.gate.may_relay, name="page-login-check", daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop listening, give the open answers and relays :data:`STOP_S`, and close."""
        self.uvicorn.stop()


def _etag(body: bytes) -> str:
    return '"' + hashlib.sha256(body).hexdigest()[:16] + '"'


def start_page(settings: Settings, base_topic: str, version: str) -> PageServer | None:
    """Serve the queue page when ``http.enabled``; returns the running server, or None. An
    address that cannot be bound costs the page, not the queue: logged as an error, and
    ``<base>/info`` says ``"http_port": null``."""
    http = settings.http
    if not http.enabled:
        return None
    relay_to = relay_target(settings)
    try:
        page = PageServer(http, base_topic, version, relay_to).start()
    except OSError as e:
        log.error("queue page: cannot listen on %s:%d (%s); the queue runs without it", http.host, http.port, e)
        return None
    if (why := page_broker_problem(settings)) is not None:
        log.warning("queue page: %s", why)
    return page


def relay_target(settings: Settings) -> tuple[str, int] | None:
    """``(host, port)`` the page's ``/mqtt`` relays to (the broker's WebSocket listener on
    ``mqtt.host``, ``http.websocket_port``), or None without ``http.websocket_proxy``."""
    if not settings.http.websocket_proxy:
        return None
    host = settings.mqtt.host if settings.mqtt.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    return host, settings.http.websocket_port


def page_broker_problem(settings: Settings) -> str | None:
    """Why the queue page cannot reach the broker from this box, or None: without
    ``http.websocket_url`` the page connects to the box's ``http.websocket_port``, and nothing
    accepts connections there (a broker without a WebSocket listener; docs/operations.md,
    "The queue page")."""
    http = settings.http
    if http.websocket_url is not None:
        return None
    from edge_queue.mqtt.embedded_broker import port_open

    host = settings.mqtt.host if settings.mqtt.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    if port_open(host, http.websocket_port, 1.0) or port_open("127.0.0.1", http.websocket_port, 1.0):
        return None
    return (
        f"nothing listens on port {http.websocket_port} (http.websocket_port), where the page looks for the "
        "broker's MQTT over WebSocket listener: the page cannot connect until the broker has one "
        '(broker/mosquitto.conf: listener 9001 with protocol websockets; docs/operations.md, "The queue page")'
    )
