"""The ports: the few operations of the service that requests and watch folders need, and the
shape of an intake (:class:`Intake`), the door a request comes in by.

:mod:`.commands` and :mod:`.watch` depend on these Protocols, never on the service itself, so
that each can be read, tested and changed alone (and no import cycle ties them to
:mod:`.service`, which implements both).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from edge_queue.component import Component
from edge_queue.config.settings import Settings
from edge_queue.mqtt.topics import ReplyAreas, Topics
from edge_queue.store import Store

if TYPE_CHECKING:
    from .models import SubmitRequest


class Intake(Component, Protocol):
    """A door into the queue: MQTT dispatch (:class:`~edge_queue.requests.dispatch.Dispatcher`),
    the HTTP API (:class:`~edge_queue.requests.http_intake.HttpIntake`), the watch folders
    (:class:`~edge_queue.watch.folders.WatchFolders`), and the next ones.

    A :class:`~edge_queue.component.Component` of the loop, drained first in each turn, before
    the scheduler, inside the turn's transaction (:meth:`turn`: take what arrived, within the
    intake's own budget for one turn, and run it), so a job from any door is claimed in the turn
    that took it; what an intake answers leaves after the commit (:meth:`committed`), or is
    answered with the error when the commit fails (:meth:`turn_failed`). Each intake calls the
    typed queue (:class:`~edge_queue.requests.queue.Queue`) with typed requests."""


class QueuePort(Protocol):
    """What a request may do to the queue (:class:`~edge_queue.requests.queue.Queue`)."""

    settings: Settings
    #: The largest packet, in bytes, the broker takes from the service: an answer's limit
    #: (``Outbox.packet_limit``).
    packet_limit: Callable[[], int]
    topics: Topics
    #: the users whose reply areas a request on the shared topics may not answer into
    reply_areas: ReplyAreas
    #: the kind registry: name -> kind class
    kinds: dict[str, Any]

    def clock(self) -> float:
        """Unix seconds."""
        ...

    def job_store(self) -> Store:
        """The open store."""
        ...

    def count_work(self, changes: int) -> None:
        """Count ``changes`` job changes against the loop turn's budget (``TURN_WORK``)."""
        ...

    def publish_job(self, job: dict[str, Any], event: str | None = None) -> None:
        """Publish a job's event now and its retained state after the turn's commit."""
        ...

    def cancel_running(self, job_id: str) -> None:
        """Ask the worker running ``job_id`` to stop (``cancel_grace_s``, then it is ended)."""
        ...

    def purge(self, job_ids: list[str]) -> list[str]:
        """Delete terminal jobs with their outputs and retained topics; returns the ids deleted."""
        ...

    def set_paused(self, paused: bool) -> None:
        """Pause or resume the queue (kept in the store)."""
        ...

    def republish(self) -> bool:
        """Start a republish of every retained state; False when one is already under way."""
        ...

    def disk_full(self, jobs: int = 0, payload_bytes: int = 0) -> str | None:
        """Why new work is refused for lack of disk space (now, or once ``jobs`` jobs holding
        ``payload_bytes`` of inputs are stored), or None."""
        ...


class WatchPort(Protocol):
    """What the watch folders need of the service (:class:`~edge_queue.watch.folders.WatchFolders`)."""

    settings: Settings
    kinds: dict[str, Any]

    def job_store(self) -> Store:
        """The open store."""
        ...

    def wake_socket(self) -> socket.socket:
        """A socket whose one byte wakes the service's loop (written from another thread)."""
        ...

    def holding(self) -> bool:
        """True while the broker connection holds back new work (disconnected, backlog)."""
        ...

    def connected(self) -> bool:
        """True while connected to the broker."""
        ...

    def publish_info(self) -> None:
        """Publish ``<base>/info`` again (a watch's state changed)."""
        ...

    def submit_as_service(self, request: SubmitRequest) -> dict[str, Any]:
        """Run ``request`` as the service's own (role ``admin``); returns its response."""
        ...
