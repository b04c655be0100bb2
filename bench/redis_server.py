"""A private redis-server for the Dramatiq and Celery references of P1 and P2: Debian's
/usr/bin/redis-server on a free loopback port, its data in a temporary folder, started and
stopped here (never the shared Redis on 6379).

Two persistence settings, named as the table names them:

- ``rdb``: Redis's default persistence, RDB snapshots with the default ``save`` points
  (``3600 1 300 100 60 10000``: after 1 hour and 1 change, 5 minutes and 100, 1 minute and
  10,000) and no append-only file. A job acknowledged by Redis may be lost in a crash until the
  next snapshot.
- ``aof-always``: the same plus ``appendonly yes`` and ``appendfsync always``: every write is in
  the append-only file and fsynced before Redis answers it, durable as edge-queue's
  ``durability = "full"`` (the informative second row).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

REDIS_SERVER = "/usr/bin/redis-server"
HOST = "127.0.0.1"
#: Redis's own default RDB snapshot points (redis.conf of Redis 7: ``save 3600 1 300 100 60 10000``).
DEFAULT_SAVE = "3600 1 300 100 60 10000"
PERSISTENCE = {
    "rdb": ["--save", DEFAULT_SAVE, "--appendonly", "no"],
    "aof-always": ["--save", DEFAULT_SAVE, "--appendonly", "yes", "--appendfsync", "always"],
}


def version() -> str:
    """:data:`REDIS_SERVER`'s version (``7.0.15``, from ``Redis server v=7.0.15 sha=...``), or
    ``not installed``."""
    try:
        out = subprocess.run([REDIS_SERVER, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "not installed"
    words = [w[2:] for w in out.stdout.split() if w.startswith("v=")]
    return words[0] if words else out.stdout.strip() or "unknown"


class RedisServer:
    """One redis-server process with the persistence ``persistence`` (a key of
    :data:`PERSISTENCE`), on a free port of 127.0.0.1, data in its own temporary folder.
    ``url`` is its ``redis://`` address (database 0). Raises RuntimeError when it does not
    answer PING within 10 s (its log's tail in the message); :meth:`stop` ends it and removes
    the folder. Usable as a context manager."""

    def __init__(self, persistence: str = "rdb") -> None:
        with socket.socket() as s:
            s.bind((HOST, 0))
            self.port = s.getsockname()[1]
        self.persistence = persistence
        self.dir = Path(tempfile.mkdtemp(prefix="eqredis-"))
        self.url = f"redis://{HOST}:{self.port}/0"
        argv = [
            REDIS_SERVER,
            "--port", str(self.port),
            "--bind", HOST,
            "--dir", str(self.dir),
            "--logfile", str(self.dir / "redis.log"),
            "--daemonize", "no",
            "--protected-mode", "yes",
            *PERSISTENCE[persistence],
        ]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + 10
        while time.monotonic() < end:
            if self.proc.poll() is None and self.command("PING") == "+PONG":
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}: {self._log_tail()}")

    def command(self, *words: str) -> str:
        """One inline command; the first line of the answer (``+PONG``, ``*2`` ...), or "" when
        Redis does not answer."""
        try:
            with socket.create_connection((HOST, self.port), 0.5) as s:
                s.sendall((" ".join(words) + "\r\n").encode())
                return s.recv(4096).decode(errors="replace").split("\r\n")[0]
        except OSError:
            return ""

    def _log_tail(self) -> str:
        try:
            return (self.dir / "redis.log").read_text()[-1500:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
