"""The store's schema: tables, indexes and migrations (``PRAGMA user_version``).

A new table goes into :func:`ensure_tables` (created if missing, cheap when it exists); a change
of an existing table is a migration: bump :data:`SCHEMA_VERSION` and add a step to
:func:`migrate`, in one transaction.
"""

from __future__ import annotations

import logging

from .chunks import create_chunks_table
from .connection import Connection
from .ha_owed import create_ha_owed_table
from .outputs import create_outputs_table

log = logging.getLogger(__name__)

#: 2: ``jobs.lock_key``; ``job_events.id`` never reused (AUTOINCREMENT, the event cursor); ``store_meta``.
SCHEMA_VERSION = 3


def migrate(c: Connection) -> None:
    """Create the schema when missing. Raises ``RuntimeError`` for a newer schema."""
    version = c.conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise RuntimeError(f"database schema {version} is newer than this edge-queue ({SCHEMA_VERSION})")
    if version == SCHEMA_VERSION:
        return
    if version == 1:
        migrate_1_to_2(c)
        version = 2
    if version == 2:
        migrate_2_to_3(c)
        return
    with c.immediate():
        c.db.table("batches").create(
            {"batch_id": str, "total": int, "created_at": str, "updated_at": str},
            pk="batch_id",
            if_not_exists=True,
        )
        c.db.table("jobs").create(
            {
                "job_id": str,
                "seq": int,
                "kind": str,
                "input": str,
                "options": str,
                "batch_id": str,
                "priority": int,
                "state": str,
                "stage": str,
                "progress": float,
                "eta_s": float,
                "attempt": int,
                "max_attempts": int,
                "retry_at": str,
                "error": str,
                "result": str,
                "dedupe_key": str,
                "timeout_s": float,
                "run_at": str,
                "owner": str,
                "crashes": int,
                "created_at": str,
                "started_at": str,
                "finished_at": str,
                "updated_at": str,
                "lock_key": str,
                "submitted_by": str,
            },
            pk="job_id",
            not_null={"seq", "kind", "state", "attempt", "max_attempts", "priority", "created_at"},
            defaults={"seq": 0, "attempt": 0, "priority": 0, "crashes": 0},
            foreign_keys=[("batch_id", "batches", "batch_id")],
            if_not_exists=True,
        )
        create_events_table(c, "job_events")
        c.db.table("idempotency_keys").create(
            {"key": str, "batch_id": str, "job_ids": str, "created_at": str},
            pk="key",
            if_not_exists=True,
        )
        c.db.table("job_events").create_index(["job_id"], if_not_exists=True)
        c.db.table("jobs").create_index(["batch_id"], if_not_exists=True)
        # The claim order; sqlite-utils cannot declare a DESC column.
        c.conn.execute("CREATE INDEX IF NOT EXISTS jobs_claim ON jobs(state, priority DESC, created_at, job_id)")
        # Partial index: dedupe looks only at active jobs, so it stays small at any size.
        c.conn.execute(
            "CREATE INDEX IF NOT EXISTS jobs_active_dedupe ON jobs(dedupe_key) "
            "WHERE state IN ('queued','running','retrying','cancelling')"
        )
        # Partial indexes for Store.next_due: the earliest retry_at / run_at of waiting jobs.
        c.conn.execute("CREATE INDEX IF NOT EXISTS jobs_retry_due ON jobs(retry_at) WHERE state = 'retrying'")
        c.conn.execute(
            "CREATE INDEX IF NOT EXISTS jobs_run_at ON jobs(run_at) WHERE state = 'queued' AND run_at IS NOT NULL"
        )
        c.conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")


def create_events_table(c: Connection, name: str) -> None:
    """The event log: ``id`` is AUTOINCREMENT, so an id is never given twice, even after
    the newest events were deleted (sqlite-utils cannot declare it)."""
    c.conn.execute(
        f"CREATE TABLE IF NOT EXISTS {name} (id INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT, at TEXT, "
        "from_state TEXT, to_state TEXT, attempt INTEGER, detail TEXT)"
    )
    c.db.table("store_meta").create({"key": str, "value": int}, pk="key", if_not_exists=True)
    # the holder and the waiters of each lock key, in submit order (Store.claim_many)
    c.conn.execute(
        "CREATE INDEX IF NOT EXISTS jobs_lock ON jobs(lock_key, created_at, job_id) "
        "WHERE lock_key IS NOT NULL AND state IN ('queued','running','retrying','cancelling')"
    )


def migrate_1_to_2(c: Connection) -> None:
    """Schema 1 -> 2 in one transaction: ``jobs.lock_key``, and the event log copied into
    a table whose ids are never reused (same ids)."""
    with c.immediate():
        c.conn.execute("ALTER TABLE jobs ADD COLUMN lock_key TEXT")
        create_events_table(c, "job_events_v2")  # (and the lock index, on the new column)
        c.conn.execute(
            "INSERT INTO job_events_v2 (id, job_id, at, from_state, to_state, attempt, detail) "
            "SELECT id, job_id, at, from_state, to_state, attempt, detail FROM job_events"
        )
        c.conn.execute("DROP TABLE job_events")
        c.conn.execute("ALTER TABLE job_events_v2 RENAME TO job_events")
        c.conn.execute("CREATE INDEX IF NOT EXISTS idx_job_events_job_id ON job_events(job_id)")
        c.conn.execute("PRAGMA user_version=2")
    log.info("job store %s upgraded to schema %d", c.path, 2)


def migrate_2_to_3(c: Connection) -> None:
    """Schema 2 -> 3: ``jobs.submitted_by``, the broker user who submitted the job (NULL for
    the jobs of before, as for the shared request topics)."""
    with c.immediate():
        c.conn.execute("ALTER TABLE jobs ADD COLUMN submitted_by TEXT")
        c.conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    log.info("job store %s upgraded to schema %d", c.path, SCHEMA_VERSION)


def create_watch_table(c: Connection) -> None:
    """``watch_files``: one row per file a watch took on, holding the version it took
    (size in bytes, modification time in ns, content digest) and what became of it."""
    c.db.table("watch_files").create(
        {
            "path": str,
            "size": int,
            "mtime_ns": int,
            "digest": str,
            "outcome": str,
            "job_id": str,
            "at": str,
        },
        pk="path",
        not_null={"size", "mtime_ns", "digest", "outcome", "at"},
        if_not_exists=True,
    )


def ensure_tables(c: Connection) -> None:
    """:func:`migrate`, then the indexes and tables added after schema 1 (cheap when they exist)."""
    migrate(c)
    c.conn.execute("CREATE INDEX IF NOT EXISTS jobs_finished ON jobs(finished_at) WHERE finished_at IS NOT NULL")
    # the waiting jobs of one sender (Store.waiting_of: limits.max_queued_jobs_per_user)
    c.conn.execute(
        "CREATE INDEX IF NOT EXISTS jobs_waiting_by ON jobs(submitted_by) WHERE state IN ('queued','retrying')"
    )
    c.db.table("instance").create({"instance_id": str, "created_at": str}, pk="instance_id", if_not_exists=True)
    c.db.table("delivered_requests").create(
        {"key": bytes, "response": bytes, "reply_to": str, "at": float, "seq": int},
        pk="key",
        not_null={"response", "at"},
        if_not_exists=True,
    )
    if "seq" not in c.db.table("delivered_requests").columns_dict:
        c.conn.execute("ALTER TABLE delivered_requests ADD COLUMN seq INTEGER NOT NULL DEFAULT 0")
    create_watch_table(c)
    create_chunks_table(c)
    create_outputs_table(c)
    create_ha_owed_table(c)
