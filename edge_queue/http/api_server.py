"""The HTTP API's server: uvicorn, on a thread of its own, so that no caller ever holds up the
service's loop (docs/http-api.md, "Bounds").

uvicorn runs the Starlette application of :mod:`.api` with its h11 protocol, given a deadline
for a request's headers (:class:`HeaderDeadline`: uvicorn has none of its own, so a client
sending its headers a byte a minute would hold a connection for ever), at most
:func:`max_connections` connections (one more is answered 503 by uvicorn), and requests' header
blocks of at most :data:`MAX_HEADER_BYTES`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from edge_queue.config import Settings

from .api import Api, JobGateway
from .uploads import sweep

log = logging.getLogger(__name__)

#: Seconds a connection has to send its first request's headers.
HEADER_S = 10.0
#: The largest block of request headers, bytes (h11's bound on an incomplete event).
MAX_HEADER_BYTES = 32 * 1024
#: Seconds an idle kept-alive connection stays open.
KEEP_ALIVE_S = 5
#: Seconds between two sweeps of old uploads.
SWEEP_S = 3600.0


def max_connections(uploads_at_once: int) -> int:
    """Connections at once: room for every upload slot, four times over, since a connection
    also waits for its job after its upload (at least 256)."""
    return max(256, 4 * uploads_at_once)


class HeaderDeadline(H11Protocol):
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request head
    within :data:`HEADER_S` seconds of connecting (``cycle`` is uvicorn's current request:
    ``None`` until the first head is complete; checked by tests/test_http_api.py)."""

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline = asyncio.get_running_loop().call_later(HEADER_S, self._head_late)

    def _head_late(self) -> None:
        if self.cycle is None and not self.transport.is_closing():
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_deadline.cancel()
        super().connection_lost(exc)


class ApiServer:
    """uvicorn serving :class:`~.api.Api` on ``api.host:api.port``, on a daemon thread."""

    def __init__(self, settings: Settings, gateway: JobGateway, version: str) -> None:
        self.settings = settings
        api = settings.api
        self.sock = socket.create_server((api.host, api.port), reuse_port=False)  # OSError: taken
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(
            Api(settings, gateway, version).app(),
            http=HeaderDeadline,
            lifespan="off",
            log_config=None,
            log_level="warning",  # its start and stop lines are ours to log
            access_log=False,
            limit_concurrency=max_connections(api.uploads_at_once),
            timeout_keep_alive=KEEP_ALIVE_S,
            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
            server_header=False,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, name="edge-queue-api", daemon=True)
        self.stopped = threading.Event()
        self.sweeper = threading.Thread(target=self._sweep, name="edge-queue-uploads", daemon=True)

    def _sweep(self) -> None:
        """Every :data:`SWEEP_S`: uploads older than ``retention_days`` and a day are deleted."""
        keep_s = (self.settings.retention_days + 1) * 86400
        while True:
            if n := sweep(self.settings.uploads_dir, keep_s, time.time()):
                log.info("HTTP API: deleted %d upload(s) older than retention_days and a day", n)
            if self.stopped.wait(SWEEP_S):
                return

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except Exception:  # the API stops; the queue goes on
            log.exception("HTTP API: stopped")

    def start(self) -> ApiServer:
        self.thread.start()
        self.sweeper.start()
        return self

    def stop(self) -> None:
        """Stop listening and close connections (callers waiting for a job are let go; their
        jobs stay queued)."""
        self.server.should_exit = True
        self.stopped.set()
        self.thread.join(10)
        self.sock.close()


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
        f", callers without a key act as {api.anonymous_user!r}" if api.anonymous_user else ""
    )
    log.info("HTTP API on http://%s:%d/ (%s)", api.host, server.port, who)
    return server
