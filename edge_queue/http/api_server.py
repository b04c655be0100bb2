"""The HTTP API's server: uvicorn, on a thread of its own, so that no caller ever holds up the
service's loop (docs/http-api.md, "Bounds").

uvicorn runs the Starlette application of :mod:`.api` on the machinery of :mod:`.server`
(shared with the queue page): a deadline for a request's head (:data:`HEADER_S`), at most
:func:`max_connections` connections and :func:`max_connections_per_address` from one address
(one more is answered 503 in the error shape, below uvicorn's own limit, whose answer is
``text/plain``), and requests' heads of at most :data:`MAX_HEADER_BYTES` (:class:`HeadBound`
for a head that came whole; :class:`ApiProtocol` answers an unreadable one in the error shape).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import h11

from edge_queue.config.settings import Settings
from edge_queue.errors import ErrorCode, RequestError

from .api import Api, JobGateway, refusals
from .server import HEADER_S as HEADER_S  # the API's deadline for a request's head
from .server import MAX_HEADER_BYTES, Bounds, HeaderDeadline, UvicornThread
from .statuses import error_response
from .uploads import sweep

log = logging.getLogger(__name__)

#: Seconds an idle kept-alive connection stays open.
KEEP_ALIVE_S = 5
#: Seconds between two sweeps of old uploads.
SWEEP_S = 3600.0
#: Seconds the calls still being received or answered get when the service stops (from the
#: stop's start, while running jobs get their grace); then their connections are closed.
STOP_S = 2


def max_connections(uploads_at_once: int) -> int:
    """Connections at once: room for every upload slot, four times over, since a connection
    also waits for its job after its upload (at least 256)."""
    return max(256, 4 * uploads_at_once)


def max_connections_per_address(uploads_at_once: int) -> int:
    """Connections at once from one client address: a quarter of :func:`max_connections`, so
    that one host cannot take them all."""
    return max_connections(uploads_at_once) // 4


#: A connection over its address's share, or over :func:`max_connections`, answered before it
#: is closed (uvicorn has not read it).
TOO_MANY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 10\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
)
TOO_MANY_BODY = (
    b'{"error": {"message": "too many connections from this address", "type": "server_error", '
    b'"param": null, "code": "busy"}}'
)
ALL_TAKEN_BODY = (
    b'{"error": {"message": "every connection of the HTTP API is taken", "type": "server_error", '
    b'"param": null, "code": "busy"}}'
)
#: The answer to a request h11 cannot read (a broken request line, a head over
#: :data:`MAX_HEADER_BYTES` still incomplete), in the error shape instead of uvicorn's text.
UNREADABLE_BODY = (
    b'{"error": {"message": "the request cannot be read as HTTP/1.1, or its head is over 32 KiB", '
    b'"type": "invalid_request_error", "param": null, "code": "invalid_request"}}'
)


def head_bytes(scope: dict[str, Any]) -> int:
    """The size of a request's head as sent, bytes: the request line and each header line
    (``<name>: <value>\r\n``; h11 keeps neither the spaces around a value nor the head's last
    ``\r\n``, so this is at most a few bytes short)."""
    target = len(scope.get("raw_path", b"")) + (len(scope["query_string"]) + 1 if scope.get("query_string") else 0)
    line = len(scope.get("method", "")) + 1 + target + len(" HTTP/1.1\r\n")
    return line + sum(len(name) + len(value) + 4 for name, value in scope.get("headers", []))


class HeadBound:
    """The ASGI ``app``, refusing a request whose head is over :data:`MAX_HEADER_BYTES` (400
    ``invalid_request``, one INFO line): h11 bounds only a head still incomplete, so a larger
    one written at once would be served."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and (size := head_bytes(scope)) > MAX_HEADER_BYTES:
            client = scope.get("client") or ("?",)
            request_id = scope.get("state", {}).get("request_id", "-")
            refusals.warning(
                "HTTP %s from %s refused: 400 invalid_request: a head of %d bytes (%s)",
                scope["method"],
                client[0],
                size,
                request_id,
            )
            error = RequestError(
                f"the request's head is over {MAX_HEADER_BYTES // 1024} KiB", code=ErrorCode.INVALID_REQUEST
            )
            await error_response(error, openai=scope["path"].startswith("/v1/"))(scope, receive, send)
            return
        await self.app(scope, receive, send)


def with_request_ids(app: Any) -> Any:
    """The ASGI ``app`` answering every request with an ``x-request-id: req_<32 hex>`` header,
    as OpenAI's API does (its clients show it as ``request_id``); the id is in the scope's state
    (``request_id``) for the log lines."""

    async def asgi(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        request_id = f"req_{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        await app(scope, receive, send_with_id)

    return asgi


class ApiProtocol(HeaderDeadline):
    """The API's :class:`~.server.HeaderDeadline`: a request h11 cannot read is answered in the
    error shape."""

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot read (it has logged ``msg`` as a warning),
        in the error shape."""
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        for event in (
            h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
            h11.Data(data=UNREADABLE_BODY),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self.transport.close()


def bounds(uploads_at_once: int) -> Bounds:
    """The API's bounds: :func:`max_connections`, :func:`max_connections_per_address`, 503 in
    the error shape past them."""
    return Bounds(
        "HTTP API",
        max_connections(uploads_at_once),
        max_connections_per_address(uploads_at_once),
        KEEP_ALIVE_S,
        (TOO_MANY % (len(TOO_MANY_BODY), TOO_MANY_BODY), TOO_MANY % (len(ALL_TAKEN_BODY), ALL_TAKEN_BODY)),
    )


class ApiServer:
    """uvicorn serving :class:`~.api.Api` on ``api.host:api.port``, on a daemon thread."""

    def __init__(self, settings: Settings, gateway: JobGateway, version: str) -> None:
        self.settings = settings
        api = settings.api
        self.handler = Api(settings, gateway, version)
        app = with_request_ids(HeadBound(self.handler.app()))
        self.uvicorn = UvicornThread(
            app, api.host, api.port, bounds(api.uploads_at_once), "edge-queue-api", STOP_S, ApiProtocol
        )  # OSError: taken
        self.port = self.uvicorn.port
        self.stopped = threading.Event()
        self.sweeper = threading.Thread(target=self._sweeping, name="edge-queue-uploads", daemon=True)

    def _sweep(self, *, at_start: bool = False) -> None:
        """Uploads older than ``retention_days`` and a day are deleted, and unfinished ones
        (``.part-*``) over an hour old; ``at_start`` (before serving): every unfinished one, left
        by a call that a stop or a crash cut short."""
        keep_s = (self.settings.retention_days + 1) * 86400
        n = sweep(self.settings.uploads_dir, keep_s, time.time(), unfinished_s=None if at_start else 3600.0)
        if n:
            log.info("HTTP API: deleted %d upload(s) older than retention_days and a day, or unfinished", n)

    def _sweeping(self) -> None:
        """Every :data:`SWEEP_S`: :meth:`_sweep`."""
        while not self.stopped.wait(SWEEP_S):
            self._sweep()

    def start(self) -> ApiServer:
        self._sweep(at_start=True)  # before the first call: no upload is being received
        self.uvicorn.start()
        self.sweeper.start()
        return self

    def begin_stop(self) -> None:
        """Stop listening and close the idle connections; the calls being received or answered
        get :data:`STOP_S` seconds (callers waiting for a job were let go first: their jobs
        stay queued). Returns at once."""
        # a call still being received is answered 503 stopping half-way through the grace,
        # before uvicorn ends it (a text/plain 500 and a traceback)
        self.handler.stop_receiving_at = time.monotonic() + STOP_S / 2
        self.uvicorn.begin_stop()
        self.stopped.set()

    def stop(self) -> None:
        """:meth:`begin_stop`, and wait for the server to be done."""
        self.begin_stop()
        self.uvicorn.stop()


def start_api(settings: Settings, gateway: JobGateway, version: str) -> ApiServer | None:
    """Serve the HTTP API when ``api.enabled``; None otherwise, or when its address cannot be
    bound (logged as an error: the queue runs without it)."""
    api = settings.api
    if not api.enabled:
        return None
    try:
        server = ApiServer(settings, gateway, version).start()
    except OSError as e:
        log.error("HTTP API: cannot listen on %s:%d (%s); the queue runs without it", api.host, api.port, e)
        return None
    keys = len(api.keys)
    who = f"{keys} API key(s)" + (
        f", callers without a key (or with one not in [api] keys) act as {api.anonymous_user!r}"
        if api.anonymous_user
        else ""
    )
    log.info("HTTP API on http://%s:%d/ (%s)", api.host, server.port, who)
    return server
