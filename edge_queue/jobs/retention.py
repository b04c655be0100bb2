"""Purging finished jobs: on request (``purge``) and after ``retention_days``, with their output
folders under ``data_dir`` and their retained topics (docs/topics.md, "`purge`";
docs/configuration.md, ``retention_days``).
"""

from __future__ import annotations

import logging
import shutil
import sqlite3
import time
from collections.abc import Callable

from edge_queue.component import Component
from edge_queue.config.settings import Settings
from edge_queue.publish.publisher import Publisher
from edge_queue.rules.limits import BULK_LIMIT
from edge_queue.store import WAL_LIMIT_BYTES, Store

log = logging.getLogger(__name__)

#: How often terminal jobs past ``retention_days`` are purged (seconds).
RETENTION_INTERVAL_S = 600.0
#: The record of an executed request is kept this long (seconds): a broker redelivers only
#: within the service's session, which expires after ``mqtt.session_expiry_s`` (default a day).
DELIVERED_KEEP_S = 7 * 86400.0
#: How often, after a commit, the write-ahead log is looked at and truncated when over its
#: limit (monotonic seconds; a stat of one file when it is not).
WAL_CHECK_S = 5.0


class Retention(Component):
    """Deletes terminal jobs from the store, the broker and ``data_dir``.

    Args:
        settings: ``retention_days``, ``outputs_dir``, ``mqtt.session_expiry_s``.
        store: returns the open store.
        publisher: clears the retained topics of what is deleted.
    """

    def __init__(
        self,
        settings: Settings,
        store: Callable[[], Store],
        publisher: Publisher,
        holding: Callable[[], bool] = lambda: False,
    ) -> None:
        self.settings, self.store, self.publisher, self.holding = settings, store, publisher, holding
        self.next_run = 0.0
        self.turn_purged: list[str] = []  # jobs purged this turn: their folders go after the commit
        self.next_wal_check = 0.0
        self.wal_over = False  # the last look found the log over its limit and held by a reader

    def purge(self, job_ids: list[str]) -> list[str]:
        """Delete terminal jobs, their output folders under ``data_dir`` (outputs written beside
        the input are the user's and are kept), and clear their retained topics (and those of
        batches left empty; a batch that keeps some jobs is published again without them).
        Returns the ids deleted."""
        gone, batches, shrunk = self.store().delete(job_ids)
        self.publisher.cleared(gone, batches, shrunk)
        self.turn_purged.extend(gone)  # their output folders go once this is committed
        if gone:
            log.info("purged %d job(s)", len(gone))
        return gone

    def turn(self, now: float) -> None:
        """Every :data:`RETENTION_INTERVAL_S` (Unix seconds ``now``): forget old request
        records, and purge up to :data:`BULK_LIMIT` jobs finished more than ``retention_days``
        ago (the rest in the next turns); not while the broker's messages are held."""
        if now < self.next_run or self.holding():
            return
        self.next_run = now + RETENTION_INTERVAL_S
        store = self.store()
        store.requests.forget_requests(now - max(DELIVERED_KEEP_S, self.settings.mqtt.session_expiry_s))
        expired = store.finished_before(now - self.settings.retention_days * 86400, limit=BULK_LIMIT)
        if len(expired) == BULK_LIMIT:
            self.next_run = now + 1.0  # more to purge: the rest in later turns
        if expired:
            log.info(
                "retention: purging %d job(s) finished more than %g days ago",
                len(expired),
                self.settings.retention_days,
            )
            self.purge(expired)

    def committed(self) -> None:
        """The turn's commit succeeded: delete the output folders of the jobs it purged."""
        for job_id in self.turn_purged:
            out_dir = self.settings.outputs_dir / job_id
            if out_dir.is_dir():
                shutil.rmtree(out_dir, ignore_errors=True)
        self.turn_purged.clear()
        now = time.monotonic()
        if now >= self.next_wal_check:
            self.next_wal_check = now + WAL_CHECK_S
            self.keep_wal_small()

    def keep_wal_small(self) -> None:
        """Give back free pages of the store (:meth:`~edge_queue.store.Store.give_back_space`),
        and truncate the write-ahead log when it grew past its limit (the pages just moved, or
        an outside reader held an old snapshot meanwhile): at most :data:`WAL_CHECK_S` after
        that reader lets go. Said once in the log while a reader holds it."""
        try:
            store = self.store()
            # the space of deleted rows (ended jobs' chunks, purges), a bounded piece per look
            store.give_back_space()
            small = store.shrink_wal()
        except (OSError, sqlite3.Error) as e:
            log.debug("the write-ahead log could not be checkpointed: %s", e)
            return
        if not small and not self.wal_over:
            log.info(
                "the store's write-ahead log is over %d MiB: another program (a backup, the sqlite3 shell) "
                "holds a read of the database open; it is truncated once that ends",
                WAL_LIMIT_BYTES // 2**20,
            )
        self.wal_over = not small

    def turn_failed(self, *, disk_full: bool = False) -> None:
        """The turn's commit failed: its purges did not happen."""
        self.turn_purged.clear()
