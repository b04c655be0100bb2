"""What one request, one user, one loop turn or one fault may cost: the turn budgets, the
bulk limit and the disk guard (docs/configuration.md, "[limits]"; docs/operations.md). The
rates (requests a second, calls a minute, throttled log lines) are :mod:`.rates`'.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

log = logging.getLogger(__name__)

#: Jobs one ``cancel`` (batch or all) or ``purge`` (older_than_s) request, or one retention
#: run, handles at most: one request cannot make one loop turn long. The response says
#: ``"more": true`` when some are left for the next request.
BULK_LIMIT = 5_000
#: Requests executed in one loop turn at most; the rest wait, in order, for the next turns.
TURN_REQUESTS = 500
#: Job changes one turn takes on through requests (jobs created, cancelled, purged) before it
#: stops taking requests: a submit of 1,000 inputs counts 1,000.
TURN_WORK = 2_000
#: A turn stops taking requests once what it is to publish reaches this many bytes (a
#: ``list`` of 500 jobs may answer with a megabyte).
TURN_BYTES = 8 * 2**20
#: How often free disk space is measured for ``limits.min_free_disk_mb`` (seconds).
DISK_CHECK_INTERVAL_S = 2.0
#: What one job takes in the store, at most, while it waits and runs (its row, its events and
#: their indexes, in the database and its write-ahead log), in bytes: measured at about 2 KiB
#: for a short job (docs/operations.md), counted double.
STORE_BYTES_PER_JOB = 4096


class DiskGuard:
    """``limits.min_free_disk_mb``: new work is refused while the disk holding ``data_dir``
    has less free space, or would have once a submit's jobs are stored. Free space is measured
    at most every :data:`DISK_CHECK_INTERVAL_S`; what accepted submits will take meanwhile is
    counted against it (:data:`STORE_BYTES_PER_JOB` per job), so a burst of batches between
    two measurements cannot take it below the limit."""

    def __init__(self, data_dir: Path, min_free_mb: float) -> None:
        self.data_dir, self.min_free_mb = data_dir, min_free_mb
        self.checked = 0.0
        self.free_mb: float | None = None
        self.holding_starts = False

    def why_full(self, jobs: int = 0, payload_bytes: int = 0) -> str | None:
        """Why new work is refused for lack of disk space, or None. ``jobs``, ``payload_bytes``:
        what a submit would store; when it fits, it is counted as spent until the next
        measurement."""
        limit = self.min_free_mb
        if not limit:
            return None
        mono = time.monotonic()
        if self.free_mb is None or mono - self.checked >= DISK_CHECK_INTERVAL_S:
            self.checked = mono
            try:
                self.free_mb = shutil.disk_usage(self.data_dir).free / 2**20
            except OSError:
                self.free_mb = None
                return None
        need_mb = (jobs * STORE_BYTES_PER_JOB + 2 * payload_bytes) / 2**20
        if self.free_mb - need_mb < limit:
            what = f" ({jobs} job(s) take about {need_mb:.1f} MiB)" if jobs > 1 else ""
            return (
                f"only {self.free_mb:.0f} MiB free in {self.data_dir}{what} "
                f"(limits.min_free_disk_mb is {limit}); free space, or purge old jobs and their outputs"
            )
        self.free_mb -= need_mb
        return None

    def allows_starts(self) -> bool:
        """False while free space is below the limit: no new attempt starts (a job writing its
        outputs would take the disk further down and fail); said once when it begins and once
        when it ends."""
        why = self.why_full()
        if why is not None and not self.holding_starts:
            log.warning("jobs wait to start: %s", why)
        elif why is None and self.holding_starts:
            log.info("free space is above limits.min_free_disk_mb again: jobs start")
        self.holding_starts = why is not None
        return why is None
