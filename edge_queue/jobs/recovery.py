"""Recovery: what a dead run of the service left behind, and what the broker holds that the
store does not know.

- At boot, before any new work is taken, jobs left ``running`` or ``cancelling`` by a dead run
  take the step :func:`~edge_queue.rules.lifecycle.after_service_death` decides
  (:func:`requeue_orphans`).
- After every connect, the retained ``<base>/jobs/<id>`` and ``<base>/batches/<id>`` topics are
  read on a connection of their own (:mod:`.scan`) and those the store does not know are
  cleared, a piece per loop turn (:class:`GhostClearing`; docs/operations.md, "Load and
  back-pressure").
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any

from edge_queue.component import Component
from edge_queue.config.settings import Settings
from edge_queue.mqtt.bridge import Bridge
from edge_queue.mqtt.scan import RetainedScan
from edge_queue.mqtt.topics import Topics
from edge_queue.rules import lifecycle
from edge_queue.store import Store

log = logging.getLogger(__name__)

#: Job ids from the read of retained job topics checked against the store per turn.
SCAN_CHECK_PER_TURN = 5_000


def requeue_orphans(store: Store, run_id: str, now: float) -> list[dict[str, Any]]:
    """Apply :func:`~edge_queue.rules.lifecycle.after_service_death` to every job an earlier run
    (any owner but ``run_id``) left in an attempt; returns the changed jobs, whose events the
    service publishes once connected. ``now``: Unix seconds."""
    changed = []
    for job_id in store.orphans(run_id):
        job = store.get(job_id)
        step = lifecycle.after_service_death(job)
        job = store.transition(job_id, step.state, now, detail=step.detail, **step.changes)
        if step.level:
            log.log(step.level, "%s", step.note)
        changed.append(job)
    return changed


class GhostClearing(Component):
    """Clears the retained job and batch topics of ids the store does not know (a fresh
    ``data_dir``, a purge while the broker was away, a broker save older than a purge).

    Args:
        settings: the MQTT settings for the read's own connection, and ``db_path`` for the log.
        topics: the installation's topic names.
        bridge: where the clearings go; its client id and protocol are the read's too.
        store: returns the open store.
        wake: the service loop's wake-up socket, written once when the read ends.
        store_was_new: the store was created at this start (a replaced store, maybe).
    """

    def __init__(
        self,
        settings: Settings,
        topics: Topics,
        bridge: Bridge,
        store: Callable[[], Store],
        wake: socket.socket,
    ) -> None:
        self.settings, self.topics, self.bridge, self.store, self.wake = settings, topics, bridge, store, wake
        self.store_was_new = False
        self.scan: RetainedScan | None = None
        self.rescan = False  # a connect happened while a read was running: read again after it
        self.ids: list[str] = []  # job ids read, still to check against the store
        self.cleared = 0
        self.read_once = False
        self.first_read_of_new_store = False

    def start(self) -> None:
        """Read the retained job topics on a connection of the scan's own (:mod:`.scan`)."""
        if self.scan is not None:
            self.rescan = True
            return
        self.rescan = False
        self.ids = []
        self.cleared = 0
        # Only the first read of a store made at this start may find state left by a store
        # replaced by mistake; a later read that finds unknown jobs found a broker that
        # restored an older save of its own (a restart of a persistent broker)
        self.first_read_of_new_store = self.store_was_new and not self.read_once
        self.read_once = True
        self.scan = RetainedScan(
            self.settings.mqtt, self.topics, self.bridge.client_id, self.bridge.protocol, self.wake
        )
        self.scan.start()

    def turn(self, now: float) -> None:
        """Take the scan's result when it has ended; check its job ids in pieces, one per turn."""
        scan = self.scan
        if scan is not None and not scan.is_alive():
            self.scan = None
            if scan.result is None:
                log.warning("could not read the retained job topics to clear unknown ones: %s", scan.error)
            else:
                log.debug(
                    "read %d retained job and %d batch topics in %.1f s",
                    len(scan.result),
                    len(scan.batches),
                    scan.seconds,
                )
                self.ids = sorted(scan.result)
                self.on_retained_batches(sorted(scan.batches))
            if self.rescan:
                self.start()
        if self.ids:
            piece, self.ids = self.ids[:SCAN_CHECK_PER_TURN], self.ids[SCAN_CHECK_PER_TURN:]
            self.on_retained_jobs(piece)
            if not self.ids and self.cleared:
                log.info("cleared the retained state of %d job(s) this store does not know", self.cleared)

    def on_retained_batches(self, batch_ids: list[str]) -> None:
        """Retained ``<base>/batches/<id>`` seen after a connect: clear those the store does not
        know (a fresh ``data_dir``, a broker save older than a purge)."""
        store = self.store()
        cleared = 0
        for start in range(0, len(batch_ids), 500):
            chunk = batch_ids[start : start + 500]
            known = store.batches.batch_ids_in(chunk)
            for batch_id in chunk:
                if batch_id not in known:
                    cleared += 1
                    self.bridge.publish(self.topics.batch(batch_id), b"", retain=True)
        if cleared:
            log.info("cleared the retained state of %d batch(es) this store does not know", cleared)

    def on_retained_jobs(self, job_ids: list[str]) -> None:
        """Retained ``<base>/jobs/<id>`` seen after a connect: clear those the store does not
        know. A store created at this start that finds job state on the broker says so first:
        it may be a store replaced by mistake (restore a backup before it is cleared)."""
        store = self.store()
        for start in range(0, len(job_ids), 500):
            chunk = job_ids[start : start + 500]
            known = store.job_ids_in(chunk)
            for job_id in chunk:
                if job_id in known:
                    continue
                if self.cleared == 0:
                    if self.first_read_of_new_store:
                        log.error(
                            "the job store %s was created at this start, but the broker holds job state on %s: "
                            "clearing the retained state of jobs it does not know (if the store was replaced by "
                            "mistake, stop edge-queue and restore a backup; see docs/operations.md)",
                            self.settings.db_path,
                            self.topics.all_jobs,
                        )
                    else:
                        log.warning(
                            "clearing the retained state of jobs this store does not know (a broker that "
                            "restored an older save, or a purge while it was away)"
                        )
                self.cleared += 1
                log.debug("clearing retained state of unknown job %s", job_id)
                self.bridge.publish(self.topics.job(job_id), b"", retain=True)
