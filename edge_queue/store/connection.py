"""The store's one SQLite connection, shared by every room of the store: the group commit,
write transactions (``BEGIN IMMEDIATE``, or a savepoint inside a group), the rows a group
defers, and the job counts per state.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlite_utils

from edge_queue.rules.states import JobState

from .rows import INSERT_DEFERRED_EVENT, INSERT_JOB, REMEMBER_REQUEST, SET_META, decode_row

#: The write-ahead log's size once no outside reader holds a snapshot: SQLite's automatic
#: checkpoint runs at 1,000 pages (4 MiB), and a reset log is cut back to this.
WAL_LIMIT_BYTES = 8 * 2**20


class Connection:
    """One SQLite connection and its transactions. Not thread-safe: the service's main loop
    is its only user.

    Args:
        path: the database file; created with its parent folder when missing.
        durability: ``"full"`` (``synchronous=FULL``, survives power loss) or ``"normal"``
            (``synchronous=NORMAL``: a power cut may lose the last commits, a crash does not).
    """

    def __init__(self, path: Path | str, durability: str = "full") -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        # a new file gives back the space of deleted rows a piece at a time (store/space.py);
        # on an existing file this takes effect only with a VACUUM (space.convert)
        conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={'FULL' if durability == 'full' else 'NORMAL'}")
        conn.execute("PRAGMA busy_timeout=5000")
        conn.execute("PRAGMA foreign_keys=ON")
        # Savepoints (one per request inside a turn's group commit) keep their statement
        # journal in memory, not in a temporary file: Store.submit 99 -> 72 us. It holds the
        # pages one savepoint changes: 7 MB for the largest, a purge of 5,000 jobs
        # (limits.BULK_LIMIT). No query of the store sorts or groups into a temporary table
        # that grows with its size (every ORDER BY follows an index).
        conn.execute("PRAGMA temp_store=MEMORY")
        # The write-ahead log is cut back to this size whenever a checkpoint resets it; it
        # grows past it only while an outside reader (a backup, the sqlite3 shell) holds an
        # old snapshot, and is truncated once that reader lets go (:meth:`shrink_wal`).
        conn.execute(f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")
        #: the sqlite3 connection itself: statements on it do not write the deferred rows first
        self.raw = conn
        self.group_depth = 0
        self.utils = sqlite_utils.Database(conn)
        #: rows of the group's plain submits, written by one ``executemany`` each before any
        #: other statement runs (:meth:`write_deferred`): ``jobs`` rows (the columns of
        #: :data:`~edge_queue.store.rows.INSERT_JOB`), their event rows, the
        #: ``delivered_requests`` rows, and the jobs by ``(dedupe_key, submitted_by)``
        self.deferred_jobs: list[tuple[Any, ...]] = []
        self.deferred_events: list[tuple[int, str, str, str | None, str, int]] = []
        self.deferred_requests: list[tuple[bytes, bytes, str | None, float, int]] = []
        self.deferred_dedupe: dict[tuple[str, str | None], dict[str, Any]] = {}
        #: ``store_meta`` values set inside the group (``Meta.set_meta``), by key: the last one
        #: of each key written with the deferred rows (one statement per turn, not per request)
        self.deferred_meta: dict[str, int | str] = {}
        #: rows of the group's other deferred writes, by statement (``HaOwed.owe``: a row per
        #: job that ended), written after the rows above: one ``executemany`` per statement
        self.deferred_rows: dict[str, list[Sequence[Any]]] = {}
        #: the ``job_events`` id the next deferred ``queued`` event gets (read once per group)
        self.next_event_id = 0
        #: jobs per state, kept up to date by every write (loaded by the store once its schema is there)
        self.counts: dict[str, int] = {s.value: 0 for s in JobState}

    @property
    def wal_path(self) -> Path:
        """The write-ahead log file beside the database."""
        return self.path.with_name(self.path.name + "-wal")

    def shrink_wal(self) -> bool:
        """Checkpoint the whole write-ahead log and truncate it to zero bytes, when it is over
        :data:`WAL_LIMIT_BYTES` (outside a transaction). It never waits: while another
        connection reads an old snapshot the log cannot be reset, and this returns False
        (part of it may still be checkpointed). True when the log is at most the limit."""
        try:
            if self.wal_path.stat().st_size <= WAL_LIMIT_BYTES:
                return True
        except FileNotFoundError:
            return True
        self.raw.execute("PRAGMA busy_timeout=0")
        try:
            busy, _, _ = self.raw.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        except sqlite3.OperationalError:
            busy = 1
        finally:
            self.raw.execute("PRAGMA busy_timeout=5000")
        return not busy

    @property
    def conn(self) -> sqlite3.Connection:
        """The connection, with the group's deferred rows written first: every statement
        that is not a plain submit sees them (``Store.submit``)."""
        if self.deferred_jobs or self.deferred_requests or self.deferred_meta or self.deferred_rows:
            self.write_deferred()
        return self.raw

    @property
    def db(self) -> sqlite_utils.Database:
        """sqlite-utils on :attr:`conn` (the deferred rows written first)."""
        if self.deferred_jobs or self.deferred_requests or self.deferred_meta or self.deferred_rows:
            self.write_deferred()
        return self.utils

    def write_deferred(self) -> None:
        """Write the rows deferred by ``Store.submit``, ``RequestRecords.remember_request``,
        ``Meta.set_meta`` and :meth:`defer`: one ``executemany`` per table, inside the group's
        transaction. A failure fails the group (it is rolled back whole, these rows with it)."""
        jobs, events, requests = self.deferred_jobs, self.deferred_events, self.deferred_requests
        meta, rows = self.deferred_meta, self.deferred_rows
        self.deferred_jobs, self.deferred_events, self.deferred_requests = [], [], []
        self.deferred_dedupe, self.deferred_meta, self.deferred_rows = {}, {}, {}
        conn = self.raw
        try:
            if jobs:
                conn.executemany(INSERT_JOB, jobs)
                conn.executemany(INSERT_DEFERRED_EVENT, events)
            if requests:
                conn.executemany(REMEMBER_REQUEST, requests)
            if meta:
                conn.executemany(SET_META, meta.items())
            for sql, params in rows.items():
                conn.executemany(sql, params)
        except sqlite3.Error:
            raise
        except Exception as e:  # a value SQLite cannot take: the group fails as one, as for SQLite's errors
            raise sqlite3.DatabaseError(f"writing the deferred submits: {type(e).__name__}: {e}") from e

    def defer(self, sql: str, row: Sequence[Any]) -> None:
        """Run ``sql`` with ``row`` later in the group (directly inside :meth:`group`, not in a
        savepoint): with the group's other deferred rows, before any other statement and
        before the commit, one ``executemany`` for all the rows of ``sql``. For a statement of
        one row that cannot fail but with the group's transaction."""
        self.deferred_rows.setdefault(sql, []).append(row)

    def drop_deferred(self) -> None:
        self.deferred_jobs, self.deferred_events, self.deferred_requests = [], [], []
        self.deferred_dedupe, self.deferred_meta, self.deferred_rows = {}, {}, {}

    def load_counts(self) -> dict[str, int]:
        counts = {s.value: 0 for s in JobState}
        for state, n in self.conn.execute("SELECT state, count(*) FROM jobs GROUP BY state"):
            counts[state] = n
        return counts

    def row(self, sql: str, args: Sequence[Any]) -> dict[str, Any] | None:
        """One row of ``sql`` as a dict with the JSON columns decoded, or ``None``."""
        cur = self.conn.execute(sql, args)
        row = cur.fetchone()
        if row is None:
            return None
        return decode_row(dict(zip([d[0] for d in cur.description], row, strict=True)))

    def close(self) -> None:
        self.drop_deferred()
        self.raw.close()

    @contextmanager
    def immediate(self) -> Iterator[None]:
        """One write transaction that takes the write lock at once (``BEGIN IMMEDIATE``);
        inside :meth:`group`, a savepoint, so a failed operation undoes only itself."""
        if self.group_depth:
            name = f"op{self.group_depth}"
            self.group_depth += 1
            self.conn.execute(f"SAVEPOINT {name}")
            try:
                yield
            except BaseException:
                # SQLite may have rolled back the whole transaction itself (SQLITE_FULL, IOERR):
                # then there is no savepoint left, and the caller's error is what matters.
                if self.conn.in_transaction:
                    try:
                        self.conn.execute(f"ROLLBACK TO {name}")
                        self.conn.execute(f"RELEASE {name}")
                    except sqlite3.Error:
                        pass
                raise
            finally:
                self.group_depth -= 1
            self.conn.execute(f"RELEASE {name}")
            return
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    @contextmanager
    def group(self) -> Iterator[None]:
        """Group commit: every write inside is one transaction, one fsync at the end.

        The caller must not make any of the writes visible (responses, PUBACKs, state
        publishes) before the block has exited without an exception.
        """
        if self.group_depth:
            yield
            return
        self.conn.execute("BEGIN IMMEDIATE")
        self.group_depth = 1
        try:
            yield
            self.group_depth = 0
            self.conn.execute("COMMIT")
        except BaseException:
            self.group_depth = 0
            self.drop_deferred()
            if self.raw.in_transaction:
                self.raw.execute("ROLLBACK")
            self.counts = self.load_counts()
            raise

    def event(
        self, job_id: str, at: str, src: JobState | None, dst: JobState, attempt: int, detail: dict[str, Any] | None
    ) -> int:
        """Append one event to the log; its ``event_id``."""
        cur = self.conn.execute(
            "INSERT INTO job_events (job_id, at, from_state, to_state, attempt, detail) VALUES (?, ?, ?, ?, ?, ?)",
            [job_id, at, src.value if src else None, dst.value, attempt, json.dumps(detail) if detail else None],
        )
        assert cur.lastrowid is not None
        return cur.lastrowid

    def last_event_ids(self, n: int) -> range:
        """The ids of the ``n`` events just inserted by one ``executemany`` (AUTOINCREMENT ids
        are consecutive inside one write transaction)."""
        last = self.conn.execute("SELECT last_insert_rowid()").fetchone()[0]
        return range(last - n + 1, last + 1)
