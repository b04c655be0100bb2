"""systemd service notifications (``sd_notify``): READY, WATCHDOG, STATUS, STOPPING.

The protocol is one datagram per notification to the Unix socket in ``$NOTIFY_SOCKET``
(systemd.exec(5), sd_notify(3)); outside systemd the variable is unset and every call is a
no-op. ``$WATCHDOG_USEC`` (microseconds) asks for ``WATCHDOG=1`` more often than that.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger(__name__)


class Notifier:
    """Sends notifications to ``$NOTIFY_SOCKET`` (read once, at construction)."""

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET") or None
        if address and address.startswith("@"):  # abstract namespace
            address = "\0" + address[1:]
        self.address = address
        usec = env.get("WATCHDOG_USEC")
        self.watchdog_s: float | None = int(usec) / 1_000_000 if usec and usec.isdigit() else None
        self._last_ping = 0.0
        self._sock: socket.socket | None = None
        if self.address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    def send(self, *fields: str) -> None:
        """Send ``KEY=value`` lines, e.g. ``send("READY=1", "STATUS=serving")``."""
        if self._sock is None or self.address is None:
            return
        try:
            self._sock.sendto("\n".join(fields).encode(), self.address)
        except OSError as e:
            log.warning("sd_notify to %s failed: %s", self.address, e)

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def tick(self) -> None:
        """``WATCHDOG=1`` at half the watchdog interval; call it from the main loop."""
        if self.watchdog_s is None:
            return
        now = time.monotonic()
        if now - self._last_ping >= self.watchdog_s / 2:
            self._last_ping = now
            self.send("WATCHDOG=1")

    def stopping(self) -> None:
        self.send("STOPPING=1", "STATUS=stopping")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
