"""The queue's own switches (docs/topics.md, ``pause``, ``resume``, ``republish``): pause and
resume, kept in the store so that a pause outlives restarts, and a republish of every retained
state."""

from __future__ import annotations

import logging
from collections.abc import Callable

from edge_queue.publish.announce import Announcer
from edge_queue.publish.publisher import Publisher, Republisher
from edge_queue.store import Store
from edge_queue.workers.supervisor import Supervisor

log = logging.getLogger(__name__)


class QueueControl:
    """Pause, resume and republish, for the requests of those names.

    Args:
        store: returns the open store (``meta`` ``paused``).
        supervisor: the local workers, asked back for the jobs handed to them in advance.
        publisher: publishes ``<base>/queue`` (its ``paused``).
        announcer: announces ``status``, ``info`` and the discovery config again.
        republisher: sends every job's and batch's retained state again, in pieces.
        clock: Unix seconds.
    """

    def __init__(
        self,
        store: Callable[[], Store],
        supervisor: Supervisor,
        publisher: Publisher,
        announcer: Announcer,
        republisher: Republisher,
        clock: Callable[[], float],
    ) -> None:
        self.store, self.supervisor, self.publisher = store, supervisor, publisher
        self.announcer, self.republisher, self.clock = announcer, republisher, clock
        self.paused = False

    def restore(self) -> None:
        """At boot: a pause of an earlier run holds (said in the log)."""
        self.paused = bool(self.store().meta("paused"))
        if self.paused:
            log.warning("the queue is paused (since before this start): no job starts until a resume")

    def set_paused(self, paused: bool) -> None:
        """Pause (no job starts; running ones go on) or resume the queue, kept in the store.

        On pause, the jobs handed to workers in advance and not started yet are asked back
        (:meth:`release_waiting`): they go back to ``queued``, their attempt not counted, and
        none starts after the pause is acknowledged (docs/topics.md, ``pause``)."""
        self.store().set_meta("paused", int(paused))
        self.paused = paused
        if paused:
            self.release_waiting()
        self.publisher.publish_queue(self.clock())

    def release_waiting(self) -> None:
        """Ask back the jobs waiting in a worker's own queue behind its running one
        (:meth:`~edge_queue.workers.prefetch.Prefetch.release`)."""
        for slot in self.supervisor.slots:
            if len(slot.jobs) > 1:
                self.supervisor.prefetch.release(slot)

    def republish(self) -> bool:
        """Republish status, info, queue, every job and batch, in pieces; False if one is
        running (it covers this)."""
        if self.republisher.active:
            return False
        self.announcer.announce(forget_conflicts=True)
        self.republisher.start()
        return True
