"""The loop's wake socket: one byte from another thread (the watch folders', the HTTP API's,
the retained scan's, a signal handler) ends the loop's ``select`` at once."""

from __future__ import annotations

import socket


class WakeSocket:
    """A connected pair of non-blocking sockets: :attr:`reader` goes into the loop's
    ``select``; :attr:`writer` is what other threads write one byte to (:meth:`wake`)."""

    def __init__(self) -> None:
        self.reader, self.writer = socket.socketpair()
        self.reader.setblocking(False)
        self.writer.setblocking(False)

    def wake(self) -> None:
        """Wake the loop (safe in a signal handler; a full or closed socket is ignored: the
        loop is awake already, or gone)."""
        try:
            self.writer.send(b"\0")
        except OSError:
            pass

    def drain(self) -> None:
        """Read every byte written so far, so that the next ``select`` waits again."""
        try:
            while self.reader.recv(4096):
                pass
        except OSError:  # BlockingIOError: nothing more
            pass

    def close(self) -> None:
        for sock in (self.reader, self.writer):
            sock.close()
