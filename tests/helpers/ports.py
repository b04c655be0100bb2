"""Free TCP ports for tests' brokers, services and pages: :func:`free_port` hands out a port
no other test process on this machine was given, from below the kernel's ephemeral range."""

from __future__ import annotations

import atexit
import errno
import os
import random
import socket
import tempfile
from pathlib import Path

#: Ports :func:`free_port` handed out in this process.
HANDED_OUT: set[int] = set()
#: One file per port handed out by any test process on this machine (pytest-xdist's workers,
#: other runs at the same time), holding the id of the process it was handed to.
PORTS_DIR = Path(tempfile.gettempdir()) / "edge-queue-test-ports"


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range, or 0 when unknown."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


#: Where :func:`free_port` looks first: below the kernel's ephemeral range, from which it picks
#: the local port of every outgoing connection (and of every bind to port 0). A port handed out
#: from that range was taken by a connection before the test's server bound it (a service's page
#: "cannot listen on 127.0.0.1:<port> (Address already in use)", a browser test of
#: tests/test_page_use.py in a serial run).
PORT_RANGE = range(20000, ephemeral_low()) if ephemeral_low() > 21000 else range(0)
_RANDOM = random.SystemRandom()  # pytest-randomly reseeds the module's generator for each test


def _unused(port: int) -> bool:
    """Nothing listens on nor holds ``port``, on any address (IPv4 and IPv6)."""
    for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family) as s:  # no SO_REUSEADDR: a connection's port, or TIME_WAIT, fails too
                s.bind((host, port))
        except OSError as e:
            if family == socket.AF_INET or e.errno == errno.EADDRINUSE:  # (a box without IPv6 passes)
                return False
    return True


def candidate_port() -> int:
    """A port nothing uses: from :data:`PORT_RANGE` when there is one, else the kernel's pick."""
    for _ in range(200 if PORT_RANGE else 0):
        port = _RANDOM.choice(PORT_RANGE)
        if port not in HANDED_OUT and _unused(port):
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reserve(port: int) -> bool:
    """Take ``port`` for this process among the test processes of this machine: a file named by
    it in :data:`PORTS_DIR` with this process's id, created only if missing (one of a process
    that ended is taken over); False when another live process holds it."""
    PORTS_DIR.mkdir(exist_ok=True)
    path = PORTS_DIR / str(port)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                pid = int(path.read_text())
            except (OSError, ValueError):  # gone, or its process is writing it
                return False
            if pid == os.getpid() or _alive(pid):
                return False
            stale = path.with_name(f"{port}.stale-{os.getpid()}")
            try:
                os.rename(path, stale)  # one process takes it over
            except FileNotFoundError:
                return False
            stale.unlink()
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        RESERVED.append(path)
        return True
    return False


#: The files of :data:`PORTS_DIR` this process made, removed when it ends.
RESERVED: list[Path] = []


@atexit.register
def _release() -> None:
    for path in RESERVED:
        try:
            if int(path.read_text()) == os.getpid():
                path.unlink()
        except (OSError, ValueError):
            pass


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (from :data:`PORT_RANGE`), never one this process or another
    live test process on the machine was given before: the kernel may hand the same port to two
    binds in a row once the first socket is closed, and a broker given it for two listeners
    failed with "Address already in use" (test_page in CI). A port two processes are given can
    also send a browser test to another test's page while its own service runs without one
    ("cannot listen"): on 0.0.0.0, relaying an anonymous broker, that page's /mqtt answers 403."""
    while True:
        port = candidate_port()
        if port not in HANDED_OUT and _reserve(port):
            HANDED_OUT.add(port)
            return port
