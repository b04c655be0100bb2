"""Calls handed from another thread to the loop's: the HTTP API's (:mod:`.http_intake`) and the
Wyoming listener's (:mod:`edge_queue.voice.intake`).

The other thread only appends to a deque and writes one byte to the loop's wake socket; the
loop takes the calls in its turn. Once the service stops, every call waiting and every call
handed over after is let go: its futures are cancelled, and the other thread answers
``stopping``.
"""

from __future__ import annotations

import socket
from collections import deque
from concurrent.futures import Future
from typing import Any, Generic, Protocol, TypeVar


class HandedCall(Protocol):
    """A call's answer, and the end of the job it made when it waits for one."""

    @property
    def answered(self) -> Future[Any]: ...

    @property
    def ended(self) -> Future[Any] | None: ...


C = TypeVar("C", bound=HandedCall)


class Handoff(Generic[C]):
    """The calls handed to the loop, oldest first (thread-safe: ``deque`` appends and pops are).

    Args:
        wake: the loop's wake socket (non-blocking; a full buffer means the loop is awake).
    """

    def __init__(self, wake: socket.socket) -> None:
        self._wake = wake
        self._calls: deque[C] = deque()
        self._stopped = False

    def put(self, call: C) -> None:
        """Hand ``call`` over (from the other thread) and wake the loop; let it go at once
        once :meth:`stop` ran."""
        self._calls.append(call)
        if self._stopped:  # after stop() took the calls waiting: let this one go too
            let_go(call)
            return
        try:
            self._wake.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # the socket's buffer is full: the loop is awake already

    def __bool__(self) -> bool:
        return bool(self._calls)

    def take(self, most: int) -> list[C]:
        """Up to ``most`` calls, oldest first (the loop's thread)."""
        return [self._calls.popleft() for _ in range(min(most, len(self._calls)))]

    def stop(self) -> None:
        """Let every waiting call go, and every call handed over from now on."""
        self._stopped = True  # before taking the waiting calls: none is missed by both
        while self._calls:
            let_go(self._calls.popleft())


def let_go(call: HandedCall) -> None:
    """Cancel the call's futures: its caller is answered ``stopping``, its job goes on."""
    call.answered.cancel()
    if call.ended is not None:
        call.ended.cancel()
