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

Standard library only: :class:`http.server.ThreadingHTTPServer` on a daemon thread, so a slow
browser never holds up the service's loop.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import socket
import threading
import time
from dataclasses import replace
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from edge_queue.config.http import HttpSettings
from edge_queue.config.settings import Settings
from edge_queue.mqtt.origins import PageOrigins, origin_refusal, page_origins
from edge_queue.mqtt.probe import anonymous_over_websocket
from edge_queue.rules.rates import RefusalLog

from .relay import RELAY_IDLE_S, Login, LoginGate, RelaySlots, is_loopback, pump

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


#: Seconds a client has to send a whole request line and its headers.
REQUEST_READ_S = 10.0
#: The path of the relayed WebSocket (``http.websocket_proxy``; :mod:`edge_queue.http.relay`).
RELAY_PATH = "/mqtt"


class _Handler(BaseHTTPRequestHandler):
    server_version = "edge-queue"
    sys_version = ""
    #: Seconds a connection may stay silent: a client that opens connections and sends nothing
    #: holds a thread each only this long.
    timeout = 30
    files: dict[str, tuple[bytes, str, str]] = {}  # set per server: path -> (body, type, etag)
    headers_out: dict[str, str] = HEADERS  # set per server: :func:`headers`
    relay_to: tuple[str, int] | None = None  # set per server: the broker's WebSocket listener
    origins: PageOrigins | None = None  # set per server with relay_to: the page's origins
    gate: LoginGate | None = None  # set per server with relay_to

    def handle_one_request(self) -> None:
        # The request line and headers must arrive within REQUEST_READ_S in all: a client that
        # sends a header line every few seconds never meets the per-read timeout, and would
        # otherwise hold its connection (and thread) for ever.
        timer = threading.Timer(REQUEST_READ_S, self._too_slow)
        timer.daemon = True
        self._read_deadline = timer
        timer.start()
        try:
            super().handle_one_request()
        finally:
            timer.cancel()

    def parse_request(self) -> bool:
        ok = super().parse_request()  # reads the headers
        self._read_deadline.cancel()
        return ok

    def _too_slow(self) -> None:
        log.debug("page: %s did not send its request within %g s: closed", self.client_address[0], REQUEST_READ_S)
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.relay_to is not None and self.path.split("?", 1)[0] == RELAY_PATH:
            self._relay(self.relay_to)
            return
        self._answer(with_body=True)

    def _relay(self, to: tuple[str, int]) -> None:
        """``/mqtt``: the page's WebSocket handshake sent on to the broker's WebSocket listener,
        then every byte both ways (:mod:`edge_queue.http.relay` says what it must pass)."""
        self.close_connection = True
        if self.headers.get("Upgrade", "").lower() != "websocket":
            self._plain(HTTPStatus.BAD_REQUEST, b"WebSocket only\n", True)
            return
        server: Any = self.server
        address = self.client_address[0]
        sent = self.headers.get_all("Origin") or []
        headers = {k.lower(): v for k, v in self.headers.items()}
        assert self.origins is not None and self.gate is not None  # set with relay_to
        local = self.connection.getsockname()[:2]
        why = origin_refusal(self.origins, sent, local=local, remote=address, headers=headers)
        if why is not None:
            shown = sent[0] if len(sent) == 1 else sent
            text = f"page: refused a relayed WebSocket from {address} with Origin {shown!r}: {why}"
            if (line := server.refusals.line(text[:400], time.monotonic())) is not None:
                log.warning("%s", line)
            self._refuse_relay(HTTPStatus.FORBIDDEN, b"this page may not connect to the broker\n")
            return
        allowed = self.gate.may_relay()
        if allowed is False:
            self._refuse_relay(HTTPStatus.FORBIDDEN, b"the broker takes clients without a login: not relayed\n")
            return
        if allowed is None:
            self._refuse_relay(HTTPStatus.BAD_GATEWAY, b"the broker's WebSocket listener does not answer\n")
            return
        if (why := server.relay_begin(address)) is not None:
            self._refuse_relay(HTTPStatus.SERVICE_UNAVAILABLE, why.encode() + b"\n")
            return
        try:
            self._relay_to(to, address)
        finally:
            server.relay_end(address)

    def _refuse_relay(self, status: HTTPStatus, body: bytes) -> None:
        # HTTP/1.1, as the handshake's answer must be (RFC 6455 section 4.1), then closed
        self.protocol_version = "HTTP/1.1"
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _relay_to(self, to: tuple[str, int], address: str) -> None:
        try:
            upstream = socket.create_connection(to, timeout=5)
        except OSError as e:
            log.warning("page: the broker's WebSocket listener %s:%d does not answer: %s", to[0], to[1], e)
            self._refuse_relay(HTTPStatus.BAD_GATEWAY, b"the broker's WebSocket listener does not answer\n")
            return
        with upstream:
            # The Origin was checked here: the broker gets the handshake as from a client that
            # is no browser (its own listener would not know the page's origins behind a proxy).
            head = ["GET / HTTP/1.1", f"Host: {to[0]}:{to[1]}"]
            head += [f"{k}: {v}" for k, v in self.headers.items() if k.lower() not in ("host", "origin")]
            upstream.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
            why = pump(self.connection, upstream, RELAY_IDLE_S, Login(time.monotonic()))
            if why is not None:
                log.debug("page: closed a relayed WebSocket from %s: %s", address, why)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(with_body=False)

    def _answer(self, *, with_body: bool) -> None:
        path = self.path.split("?", 1)[0].split("#", 1)[0]
        found = self.files.get(path)
        if found is None:
            self._plain(HTTPStatus.NOT_FOUND, b"not found\n", with_body)
            return
        body, ctype, etag = found
        if self.headers.get("If-None-Match") == etag:
            self.send_response(HTTPStatus.NOT_MODIFIED)
            self._common(etag)
            self.end_headers()
            return
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self._common(etag)
        self.end_headers()
        if with_body:
            self.wfile.write(body)

    def _common(self, etag: str) -> None:
        self.send_header("ETag", etag)
        for name, value in self.headers_out.items():
            self.send_header(name, value)

    def _plain(self, status: HTTPStatus, body: bytes, with_body: bool) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        for name, value in self.headers_out.items():
            self.send_header(name, value)
        self.end_headers()
        if with_body:
            self.wfile.write(body)

    def _refuse(self) -> None:
        self.send_response(HTTPStatus.METHOD_NOT_ALLOWED)
        self.send_header("Allow", "GET, HEAD")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse  # noqa: N815

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
        log.debug("page: %s %s", self.address_string(), format % args)


#: Connections the page serves at once at most; more are closed at once, so that slow or
#: idle connections (a slowloris) cannot take the service's file descriptors and threads.
MAX_CONNECTIONS = 64
#: Connections from one address at once at most (a browser opens about 6): one host's slow
#: connections cannot take the places of the others.
MAX_CONNECTIONS_PER_ADDRESS = 8


class _BoundedServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` with at most :data:`MAX_CONNECTIONS` connections (threads) at
    once; a connection over it is closed unanswered and counted in the debug log."""

    daemon_threads = True

    def __init__(self, *args: Any, trusted: frozenset[str] = frozenset(), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = threading.Lock()
        self._per_address: dict[str, int] = {}
        self.relays = RelaySlots(trusted)
        self.refusals = RefusalLog()

    def relay_begin(self, address: str) -> str | None:
        """A connection from ``address`` becomes a relayed WebSocket: why not when no relay
        slot is free for it (:class:`~edge_queue.http.relay.RelaySlots`); else it stops counting
        against its address's :data:`MAX_CONNECTIONS_PER_ADDRESS` (it counts as a relay)."""
        if (why := self.relays.take(address)) is not None:
            return why
        with self._lock:
            left = self._per_address.get(address, 1) - 1
            if left > 0:
                self._per_address[address] = left
            else:
                self._per_address.pop(address, None)
        return None

    def relay_end(self, address: str) -> None:
        """The relayed WebSocket ended (its connection is given back as any other's)."""
        self.relays.give_back(address)
        with self._lock:
            self._per_address[address] = self._per_address.get(address, 0) + 1

    def _take(self, address: str) -> bool:
        with self._lock:
            if self._per_address.get(address, 0) >= MAX_CONNECTIONS_PER_ADDRESS:
                return False
            if not self._slots.acquire(blocking=False):
                return False
            self._per_address[address] = self._per_address.get(address, 0) + 1
            return True

    def _give_back(self, address: str) -> None:
        with self._lock:
            left = self._per_address.get(address, 1) - 1
            if left > 0:
                self._per_address[address] = left
            else:
                self._per_address.pop(address, None)
            self._slots.release()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._take(client_address[0]):
            log.debug("page: too many connections; closed one from %s", client_address[0])
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._give_back(client_address[0])
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._give_back(client_address[0])

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client that went away mid-answer (BrokenPipeError) is routine: one debug line
        log.debug("page: connection from %s ended with an error", client_address[0], exc_info=True)


class PageServer:
    """The queue page on ``settings.host:settings.port``, on a daemon thread.

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
        attrs: dict[str, Any] = {"files": files, "headers_out": headers(settings), "relay_to": relay_to}
        handler: Any = type("PageHandler", (_Handler,), attrs)
        self.httpd = _BoundedServer(
            (settings.host, settings.port), handler, trusted=frozenset(settings.trusted_proxies)
        )
        self.port: int = self.httpd.server_address[1]
        self.host = settings.host
        self.gate: LoginGate | None = None
        if relay_to is not None:
            self.gate = LoginGate(relay_to, not is_loopback(settings.host), anonymous_over_websocket)
            handler.gate = self.gate
            handler.origins = replace(page_origins(settings), port=self.port)
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="page", daemon=True)

    def start(self) -> PageServer:
        self._thread.start()
        log.info("queue page on http://%s:%d/", self.host, self.port)
        if self.gate is not None and self.gate.needed:  # the line at start, when it must refuse
            threading.Thread(target=self.gate.may_relay, name="page-login-check", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self.httpd.shutdown()
        self.httpd.server_close()


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
