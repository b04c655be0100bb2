"""The store: one SQLite database, the single source of truth.

Every SQL statement of edge-queue lives here. sqlite-utils creates the schema and serves the
rest of the reads; the hot path (submit, claim, transition, progress: several statements per
job) uses plain ``sqlite3`` statements, prepared once per connection by its statement cache,
because sqlite-utils introspects the table on every ``insert``/``update``. Each write runs in
one ``BEGIN IMMEDIATE`` transaction, or a savepoint inside :meth:`Store.group`, so a job, its
batch, its idempotency key and its event log row are committed together or not at all.

All ``now`` arguments are Unix times in seconds (float); the store writes them as RFC 3339
UTC strings with milliseconds, which sort in time order as text.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import secrets
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import sqlite_utils

from .errors import NotFoundError, TransitionError
from .states import ACTIVE, JobState, can_transition, is_terminal

log = logging.getLogger(__name__)

#: 2: ``jobs.lock_key``; ``job_events.id`` never reused (AUTOINCREMENT, the event cursor); ``store_meta``.
SCHEMA_VERSION = 3
_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"
_JSON_COLUMNS = ("options", "error", "result")
#: SQL condition on a row of ``jobs``: it has no lock key, or it is the oldest active job of its
#: key and sender (the one that may run; the others wait for it, in submit order). A lock key
#: belongs to its sender, as an idempotency key does (docs/topics.md, "Lock keys").
_LOCK_HEAD = (
    "(jobs.lock_key IS NULL OR jobs.job_id = (SELECT l.job_id FROM jobs AS l INDEXED BY jobs_lock "
    "WHERE l.lock_key = jobs.lock_key AND l.submitted_by IS jobs.submitted_by "
    "AND l.state IN ('queued','running','retrying','cancelling') "
    "ORDER BY l.created_at, l.job_id LIMIT 1))"
)


def _json_text(value: Any) -> str:
    """``value`` as JSON text for a column (orjson: once per job on the hot path). What orjson
    does not take (lone surrogates, integers over 64 bits) is written by ``json`` instead."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return json.dumps(value)


def _queued_row(
    spec: JobSpec,
    job_id: str,
    key: str,
    batch_id: str | None,
    at: str,
    *,
    options: str | None = None,
    run_at: str | None = None,
) -> dict[str, Any]:
    """The ``jobs`` row of a new job, every column (JSON columns as text): ``queued``, seq 1,
    attempt 0, made at ``at`` (RFC 3339). ``options``/``run_at``: their text when the caller
    already made it."""
    return {
        "job_id": job_id,
        "seq": 1,
        "kind": spec.kind,
        "input": spec.input,
        "options": options if options is not None else _json_text(spec.options),
        "batch_id": batch_id,
        "priority": spec.priority,
        "state": JobState.QUEUED.value,
        "stage": None,
        "progress": 0.0,
        "eta_s": None,
        "attempt": 0,
        "max_attempts": spec.max_attempts,
        "retry_at": None,
        "error": None,
        "result": None,
        "dedupe_key": key,
        "timeout_s": spec.timeout_s,
        "run_at": run_at if run_at is not None else (iso(spec.run_at) if spec.run_at else None),
        "lock_key": spec.lock_key,
        "submitted_by": spec.submitted_by,
        "owner": None,
        "crashes": 0,
        "created_at": at,
        "started_at": None,
        "finished_at": None,
        "updated_at": at,
    }


def _deferred_job_row(job: dict[str, Any]) -> tuple[Any, ...]:
    """The parameters of :data:`_INSERT_JOB` for the row ``job`` (every column, JSON as text)."""
    return (
        job["job_id"],
        job["seq"],
        job["kind"],
        job["input"],
        job["options"],
        job["priority"],
        job["state"],
        job["attempt"],
        job["max_attempts"],
        job["dedupe_key"],
        job["timeout_s"],
        job["run_at"],
        job["submitted_by"],
        job["owner"],
        job["created_at"],
        job["started_at"],
        job["updated_at"],
    )


def _bindable(text: str | None) -> bool:
    """True when SQLite can store ``text`` (UTF-8: no lone surrogates)."""
    if text is None or text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


#: a new plain job's row (Store._submit_deferred: the columns that are not their defaults;
#: ``queued`` with seq 1 and attempt 0, or ``running`` when claimed before it was written,
#: Store._claim_deferred)
_INSERT_JOB = (
    "INSERT INTO jobs (job_id, seq, kind, input, options, batch_id, priority, state, stage, progress, eta_s, "
    "attempt, max_attempts, retry_at, error, result, dedupe_key, timeout_s, run_at, lock_key, submitted_by, owner, "
    "crashes, created_at, started_at, finished_at, updated_at) "
    "VALUES (?, ?, ?, ?, ?, NULL, ?, ?, NULL, 0.0, NULL, ?, ?, NULL, NULL, NULL, ?, ?, ?, NULL, ?, ?, "
    "0, ?, ?, NULL, ?)"
)
#: the event rows of the group's plain submits: ``(id, job_id, at, from_state, to_state, attempt)``
_INSERT_DEFERRED_EVENT = (
    "INSERT INTO job_events (id, job_id, at, from_state, to_state, attempt, detail) VALUES (?, ?, ?, ?, ?, ?, NULL)"
)
_REMEMBER_REQUEST = (
    "INSERT OR REPLACE INTO delivered_requests (key, response, reply_to, at, seq) VALUES (?, ?, ?, ?, ?)"
)

_iso_second: tuple[int, str] = (-1, "")


def iso(ts: float) -> str:
    """Unix seconds -> ``2026-11-29T07:40:12.345Z`` (RFC 3339, UTC, milliseconds, truncated
    after rounding to microseconds, as ``datetime.fromtimestamp`` rounds). The text of the
    second is kept from the call before: a busy service stamps many changes per second."""
    global _iso_second
    frac, whole = math.modf(ts)
    us = round(frac * 1e6)
    second = int(whole)
    if us >= 1_000_000:
        second, us = second + 1, us - 1_000_000
    elif us < 0:  # before 1970
        second, us = second - 1, us + 1_000_000
    if _iso_second[0] != second:
        _iso_second = (second, datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S."))
    return f"{_iso_second[1]}{us // 1000:03d}Z"


def parse_iso(text: str) -> float:
    """Inverse of :func:`iso`. Raises ``ValueError`` for text that is not RFC 3339."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


_last_ms = 0
_pool = b""
_pool_at = 0


def _random64() -> int:
    """64 bits from the operating system's random source (``secrets``), drawn 4 KiB at a time:
    one system call per 512 ids instead of one per id."""
    global _pool, _pool_at
    if _pool_at >= len(_pool):
        _pool, _pool_at = secrets.token_bytes(4096), 0
    at = _pool_at
    _pool_at = at + 8
    return int.from_bytes(_pool[at : at + 8])


def _drop_pool() -> None:
    global _pool, _pool_at
    _pool, _pool_at = b"", 0


os.register_at_fork(after_in_child=_drop_pool)  # a forked child never reuses the parent's bits


def new_id(now: float | None = None) -> str:
    """A 16-character ``[a-z0-9]`` id: 9 characters of milliseconds + 7 random. Ids made by
    one process sort in the order they were made: within one millisecond the time part steps
    on by one (the monotonic rule of ULID)."""
    global _last_ms, _head
    ms = max(int((time.time() if now is None else now) * 1000), _last_ms + 1)
    _last_ms = ms
    high, low = divmod(ms, 1296)  # the first 7 digits change once every 1.296 s
    if _head[0] != high:
        _head = (high, _base36(high, 7))
    r = _random64()  # 64 random bits for 7 base-36 digits, the least significant first
    return (
        _head[1]
        + _B36_2[low]
        + _B36_2_REV[r % 1296]
        + _B36_2_REV[(r // 1296) % 1296]
        + _B36_2_REV[(r // 1679616) % 1296]
        + _ALPHABET[(r // 2176782336) % 36]
    )


def _sender_key(idempotency_key: str, submitted_by: str | None) -> str:
    """The stored form of a sender's key: a user's keys live apart from the shared topics' and
    from every other user's (a NUL cannot be in a key that came in JSON: payloads refuse it)."""
    return idempotency_key if submitted_by is None else f"\x00{submitted_by}\x00{idempotency_key}"


def ids_after(newest: str | None) -> None:
    """Make the ids of this process sort after ``newest``, an id made by an earlier process
    (read from the store at start). The time part of an id runs ahead of the clock by 1 ms per
    id beyond 1,000 a second, so after a burst a restarted process would otherwise make ids
    that sort before the burst's (docs/topics.md: ids sort in creation order). Text that is
    not an id is ignored."""
    global _last_ms
    if newest is None or len(newest) != 16:
        return
    try:
        ms = int(newest[:9], 36)
    except ValueError:
        return
    _last_ms = max(_last_ms, ms)


def _base36(n: int, width: int) -> str:
    """The last ``width`` base-36 digits of ``n``, most significant first."""
    out = ""
    for _ in range(width):
        n, r = divmod(n, 36)
        out = _ALPHABET[r] + out
    return out


#: every 2-digit base-36 string, most significant digit first, and reversed
_B36_2 = [_base36(i, 2) for i in range(1296)]
_B36_2_REV = [d[::-1] for d in _B36_2]
_head: tuple[int, str] = (-1, "")


#: json.dumps(..., sort_keys=True, separators=(",", ":")) with one encoder for every call
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"))


def dedupe_key(kind: str, input_: str | None, options: dict[str, Any]) -> str:
    """sha256 of kind, input and canonical options: equal active jobs share it (docs/topics.md, "`submit`")."""
    canon = _CANONICAL.encode([kind, input_, options])
    return hashlib.sha256(canon.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class JobSpec:
    """One job to create; ``options`` are already validated by the kind."""

    kind: str
    input: str | None
    options: dict[str, Any]
    priority: int = 0
    max_attempts: int = 3
    timeout_s: float | None = None
    run_at: float | None = None
    #: jobs with one lock key run one at a time, in submit order (docs/topics.md, "Lock keys")
    lock_key: str | None = None
    #: with a lock key: refuse the job (:class:`LockHeld`) while another job holds the key
    reject_when_locked: bool = False
    #: the broker user whose own request topic the submit came on; None: the shared topic
    #: (docs/topics.md, "Who sent a request")
    submitted_by: str | None = None


class LockHeld(Exception):
    """A submit with ``on_lock: reject`` met an active job holding its lock key."""

    def __init__(self, lock_key: str, holder: str) -> None:
        super().__init__(f"lock key {lock_key!r} is held by job {holder}")
        self.lock_key, self.holder = lock_key, holder


@dataclass(frozen=True, slots=True)
class Created:
    """Outcome of :meth:`Store.submit`: the job row and whether it existed before."""

    job: dict[str, Any]
    duplicate: bool


class Store:
    """The job store. Not thread-safe: the service's main loop is its only user.

    Args:
        path: the database file; created with its parent folder when missing.
        durability: ``"full"`` (``synchronous=FULL``, survives power loss) or ``"normal"``
            (``synchronous=NORMAL``: a power cut may lose the last commits, a crash does not).
    """

    def __init__(self, path: Path | str, durability: str = "full") -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={'FULL' if durability == 'full' else 'NORMAL'}")
        conn.execute("PRAGMA busy_timeout=5000")
        conn.execute("PRAGMA foreign_keys=ON")
        # Savepoints (one per request inside a turn's group commit) keep their statement
        # journal in memory, not in a temporary file: Store.submit 99 -> 72 us. It holds the
        # pages one savepoint changes: 7 MB for the largest, a purge of 5,000 jobs
        # (commands.BULK_LIMIT). No query of the store sorts or groups into a temporary table
        # that grows with its size (every ORDER BY follows an index).
        conn.execute("PRAGMA temp_store=MEMORY")
        self._conn = conn
        self._group_depth = 0
        self._db = sqlite_utils.Database(conn)
        #: rows of the group's plain submits, written by one ``executemany`` each before any
        #: other statement runs (:meth:`_write_deferred`): ``jobs`` rows (the columns of
        #: :data:`_INSERT_JOB`), their event rows (:data:`_INSERT_DEFERRED_EVENT`), the
        #: ``delivered_requests`` rows, and the jobs by ``(dedupe_key, submitted_by)``
        self._deferred_jobs: list[tuple[Any, ...]] = []
        self._deferred_events: list[tuple[int, str, str, str | None, str, int]] = []
        self._deferred_requests: list[tuple[bytes, bytes, str | None, float, int]] = []
        self._deferred_dedupe: dict[tuple[str, str | None], dict[str, Any]] = {}
        #: the ``job_events`` id the next deferred ``queued`` event gets (read once per group)
        self._next_event_id = 0
        self.migrate()
        # Indexes and tables added after schema 1 (cheap when they exist).
        self.conn.execute("CREATE INDEX IF NOT EXISTS jobs_finished ON jobs(finished_at) WHERE finished_at IS NOT NULL")
        # the waiting jobs of one sender (Store.waiting_of: limits.max_queued_jobs_per_user)
        self.conn.execute(
            "CREATE INDEX IF NOT EXISTS jobs_waiting_by ON jobs(submitted_by) WHERE state IN ('queued','retrying')"
        )
        self.db.table("instance").create({"instance_id": str, "created_at": str}, pk="instance_id", if_not_exists=True)
        self.db.table("delivered_requests").create(
            {"key": bytes, "response": bytes, "reply_to": str, "at": float, "seq": int},
            pk="key",
            not_null={"response", "at"},
            if_not_exists=True,
        )
        if "seq" not in self.db.table("delivered_requests").columns_dict:
            self.conn.execute("ALTER TABLE delivered_requests ADD COLUMN seq INTEGER NOT NULL DEFAULT 0")
        self._create_watch_table()
        self._counts = self._load_counts()
        # the newest ids (primary keys: two index look-ups) bound the ids made from now on
        for table, column in (("jobs", "job_id"), ("batches", "batch_id")):
            ids_after(self.conn.execute(f"SELECT max({column}) FROM {table}").fetchone()[0])

    @property
    def conn(self) -> sqlite3.Connection:
        """The connection, with the group's deferred rows written first: every statement
        that is not a plain submit sees them (:meth:`submit`)."""
        if self._deferred_jobs or self._deferred_requests:
            self._write_deferred()
        return self._conn

    @property
    def db(self) -> sqlite_utils.Database:
        """sqlite-utils on :attr:`conn` (the deferred rows written first)."""
        if self._deferred_jobs or self._deferred_requests:
            self._write_deferred()
        return self._db

    def _write_deferred(self) -> None:
        """Write the rows deferred by :meth:`submit` and :meth:`remember_request`: one
        ``executemany`` per table, inside the group's transaction. A failure fails the group
        (it is rolled back whole, these rows with it)."""
        jobs, events, requests = self._deferred_jobs, self._deferred_events, self._deferred_requests
        self._deferred_jobs, self._deferred_events, self._deferred_requests = [], [], []
        self._deferred_dedupe = {}
        conn = self._conn
        try:
            if jobs:
                conn.executemany(_INSERT_JOB, jobs)
                conn.executemany(_INSERT_DEFERRED_EVENT, events)
            if requests:
                conn.executemany(_REMEMBER_REQUEST, requests)
        except sqlite3.Error:
            raise
        except Exception as e:  # a value SQLite cannot take: the group fails as one, as for SQLite's errors
            raise sqlite3.DatabaseError(f"writing the deferred submits: {type(e).__name__}: {e}") from e

    def _drop_deferred(self) -> None:
        self._deferred_jobs, self._deferred_events, self._deferred_requests = [], [], []
        self._deferred_dedupe = {}

    def _load_counts(self) -> dict[str, int]:
        counts = {s.value: 0 for s in JobState}
        for state, n in self.conn.execute("SELECT state, count(*) FROM jobs GROUP BY state"):
            counts[state] = n
        return counts

    def _row(self, sql: str, args: Sequence[Any]) -> dict[str, Any] | None:
        """One row of ``sql`` as a dict with the JSON columns decoded, or ``None``."""
        cur = self.conn.execute(sql, args)
        row = cur.fetchone()
        if row is None:
            return None
        return self._decode(dict(zip([d[0] for d in cur.description], row, strict=True)))

    def close(self) -> None:
        self._drop_deferred()
        self._conn.close()

    # -- schema -------------------------------------------------------------------------

    def migrate(self) -> None:
        """Create the schema when missing. Raises ``RuntimeError`` for a newer schema."""
        version = self.conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise RuntimeError(f"database schema {version} is newer than this edge-queue ({SCHEMA_VERSION})")
        if version == SCHEMA_VERSION:
            return
        if version == 1:
            self._migrate_1_to_2()
            version = 2
        if version == 2:
            self._migrate_2_to_3()
            return
        with self._immediate():
            self.db.table("batches").create(
                {"batch_id": str, "total": int, "created_at": str, "updated_at": str},
                pk="batch_id",
                if_not_exists=True,
            )
            self.db.table("jobs").create(
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
            self._create_events_table("job_events")
            self.db.table("idempotency_keys").create(
                {"key": str, "batch_id": str, "job_ids": str, "created_at": str},
                pk="key",
                if_not_exists=True,
            )
            self.db.table("job_events").create_index(["job_id"], if_not_exists=True)
            self.db.table("jobs").create_index(["batch_id"], if_not_exists=True)
            # The claim order; sqlite-utils cannot declare a DESC column.
            self.conn.execute("CREATE INDEX IF NOT EXISTS jobs_claim ON jobs(state, priority DESC, created_at, job_id)")
            # Partial index: dedupe looks only at active jobs, so it stays small at any size.
            self.conn.execute(
                "CREATE INDEX IF NOT EXISTS jobs_active_dedupe ON jobs(dedupe_key) "
                "WHERE state IN ('queued','running','retrying','cancelling')"
            )
            # Partial indexes for Store.next_due: the earliest retry_at / run_at of waiting jobs.
            self.conn.execute("CREATE INDEX IF NOT EXISTS jobs_retry_due ON jobs(retry_at) WHERE state = 'retrying'")
            self.conn.execute(
                "CREATE INDEX IF NOT EXISTS jobs_run_at ON jobs(run_at) WHERE state = 'queued' AND run_at IS NOT NULL"
            )
            self.conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def _create_events_table(self, name: str) -> None:
        """The event log: ``id`` is AUTOINCREMENT, so an id is never given twice, even after
        the newest events were deleted (sqlite-utils cannot declare it)."""
        self.conn.execute(
            f"CREATE TABLE IF NOT EXISTS {name} (id INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT, at TEXT, "
            "from_state TEXT, to_state TEXT, attempt INTEGER, detail TEXT)"
        )
        self.db.table("store_meta").create({"key": str, "value": int}, pk="key", if_not_exists=True)
        # the holder and the waiters of each lock key, in submit order (Store.claim_many)
        self.conn.execute(
            "CREATE INDEX IF NOT EXISTS jobs_lock ON jobs(lock_key, created_at, job_id) "
            "WHERE lock_key IS NOT NULL AND state IN ('queued','running','retrying','cancelling')"
        )

    def _migrate_1_to_2(self) -> None:
        """Schema 1 -> 2 in one transaction: ``jobs.lock_key``, and the event log copied into
        a table whose ids are never reused (same ids)."""
        with self._immediate():
            self.conn.execute("ALTER TABLE jobs ADD COLUMN lock_key TEXT")
            self._create_events_table("job_events_v2")  # (and the lock index, on the new column)
            self.conn.execute(
                "INSERT INTO job_events_v2 (id, job_id, at, from_state, to_state, attempt, detail) "
                "SELECT id, job_id, at, from_state, to_state, attempt, detail FROM job_events"
            )
            self.conn.execute("DROP TABLE job_events")
            self.conn.execute("ALTER TABLE job_events_v2 RENAME TO job_events")
            self.conn.execute("CREATE INDEX IF NOT EXISTS idx_job_events_job_id ON job_events(job_id)")
            self.conn.execute("PRAGMA user_version=2")
        log.info("job store %s upgraded to schema %d", self.path, 2)

    def _migrate_2_to_3(self) -> None:
        """Schema 2 -> 3: ``jobs.submitted_by``, the broker user who submitted the job (NULL for
        the jobs of before, as for the shared request topics)."""
        with self._immediate():
            self.conn.execute("ALTER TABLE jobs ADD COLUMN submitted_by TEXT")
            self.conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        log.info("job store %s upgraded to schema %d", self.path, SCHEMA_VERSION)

    @contextmanager
    def _immediate(self) -> Iterator[None]:
        """One write transaction that takes the write lock at once (``BEGIN IMMEDIATE``);
        inside :meth:`group`, a savepoint, so a failed operation undoes only itself."""
        if self._group_depth:
            name = f"op{self._group_depth}"
            self._group_depth += 1
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
                self._group_depth -= 1
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
        if self._group_depth:
            yield
            return
        self.conn.execute("BEGIN IMMEDIATE")
        self._group_depth = 1
        try:
            yield
            self._group_depth = 0
            self.conn.execute("COMMIT")
        except BaseException:
            self._group_depth = 0
            self._drop_deferred()
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            self._counts = self._load_counts()
            raise

    # -- reading ------------------------------------------------------------------------

    @staticmethod
    def _decode(row: dict[str, Any]) -> dict[str, Any]:
        for col in _JSON_COLUMNS:
            text = row.get(col)
            if text is not None:
                try:
                    row[col] = orjson.loads(text)
                except orjson.JSONDecodeError:  # lone surrogate escapes (non-UTF-8 file names)
                    row[col] = json.loads(text)
        return row

    def get(self, job_id: str) -> dict[str, Any]:
        """The job row (JSON columns decoded). Raises :class:`NotFoundError`."""
        row = self._row("SELECT * FROM jobs WHERE job_id = ?", [job_id])
        if row is None:
            raise NotFoundError(f"no job {job_id!r}")
        return row

    def list_jobs(
        self,
        *,
        state: str | None = None,
        kind: str | None = None,
        batch_id: str | None = None,
        before: str | None = None,
        limit: int = 50,
        lock_key: str | None = None,
        submitted_by: tuple[str | None] | None = None,
    ) -> list[dict[str, Any]]:
        """Jobs newest first, filtered; ``before`` is a job id to page past (exclusive);
        ``submitted_by=(user,)`` keeps the jobs of that sender only (``(None,)``: of the shared
        request topics)."""
        where: list[str] = []
        args: list[Any] = []
        if submitted_by is not None:
            where.append("submitted_by IS ?")
            args.append(submitted_by[0])
        for col, val in (("state", state), ("kind", kind), ("batch_id", batch_id), ("lock_key", lock_key)):
            if val is not None:
                where.append(f"{col} = ?")
                args.append(val)
        if before is not None:
            where.append("job_id < ?")
            args.append(before)
        sql = "SELECT * FROM jobs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY job_id DESC LIMIT ?"
        args.append(limit)
        return [self._decode(r) for r in self.db.query(sql, args)]

    def iter_jobs(self) -> Iterator[dict[str, Any]]:
        """Every job, oldest first (for republish)."""
        for row in self.db.query("SELECT * FROM jobs ORDER BY job_id"):
            yield self._decode(row)

    def job_ids_in(self, job_ids: list[str]) -> set[str]:
        """The subset of ``job_ids`` that the store knows."""
        marks = ",".join("?" * len(job_ids))
        return {r[0] for r in self.conn.execute(f"SELECT job_id FROM jobs WHERE job_id IN ({marks})", job_ids)}

    def meta(self, key: str) -> int | None:
        """A number the service keeps in the store (``paused``), or None when unset."""
        row = self.conn.execute("SELECT value FROM store_meta WHERE key = ?", [key]).fetchone()
        return None if row is None else int(row[0])

    def set_meta(self, key: str, value: int) -> None:
        """Set a number the service keeps in the store (one statement: atomic by itself,
        so inside :meth:`group` it needs no savepoint of its own)."""
        sql = "INSERT INTO store_meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value"
        if self._group_depth:
            self.conn.execute(sql, [key, value])
            return
        with self._immediate():
            self.conn.execute(sql, [key, value])

    def instance_id(self) -> str:
        """The installation's id: 12 hex digits made with the store, the same for its whole life
        (restarts, upgrades); a new ``data_dir`` makes a new one (docs/topics.md, ``info``)."""
        row = self.conn.execute("SELECT instance_id FROM instance LIMIT 1").fetchone()
        if row is not None:
            return str(row[0])
        made = secrets.token_hex(6)
        with self._immediate():
            self.conn.execute("INSERT INTO instance (instance_id, created_at) VALUES (?, ?)", [made, iso(time.time())])
        return made

    def client_id_secret(self) -> str:
        """16 hex digits made at random with the store and never published: the end of the
        service's default MQTT client id (docs/configuration.md, ``mqtt.client_id``), so that no
        other client can guess the id and take over its session."""
        value = self.meta("client_id_secret")
        if value is None:
            value = secrets.randbits(63)
            self.set_meta("client_id_secret", value)
        return f"{value:016x}"

    # -- requests delivered again (docs/topics.md, "Requests delivered twice") ------------

    def remember_request(self, key: bytes, response: bytes, reply_to: str | None, now: float, seq: int) -> None:
        """Record the response to an executed request, in the transaction of its effect, so
        that the same request delivered again (``key``: :func:`edge_queue.service.request_key`)
        is answered with it instead of taking effect twice. ``seq``: how many requests the
        service had received when this one came (the window of :meth:`recall_request`).

        Inside :meth:`group`, the row is written with the group's other deferred rows, before
        any other statement (:meth:`recall_request` included) and before the commit."""
        row = (key, response, reply_to, now, seq)
        if self._group_depth == 1:
            self._deferred_requests.append(row)
        else:
            self.conn.execute(_REMEMBER_REQUEST, row)

    def recall_request(self, key: bytes) -> tuple[bytes, str | None, int] | None:
        """``(response, reply_to, seq)`` recorded for ``key``, or None."""
        row = self.conn.execute(
            "SELECT response, reply_to, seq FROM delivered_requests WHERE key = ?", [key]
        ).fetchone()
        return None if row is None else (bytes(row[0]), row[1], int(row[2]))

    def forget_all_requests(self) -> None:
        """Drop every record: the broker lost our session, so nothing it sends is a redelivery."""
        with self._immediate():
            self.conn.execute("DELETE FROM delivered_requests")

    def forget_requests(self, before: float) -> int:
        """Drop the records of requests executed before ``before`` (Unix seconds); their count."""
        with self._immediate():
            return self.conn.execute("DELETE FROM delivered_requests WHERE at < ?", [before]).rowcount

    def batch_ids_in(self, batch_ids: list[str]) -> set[str]:
        """The subset of ``batch_ids`` that the store knows."""
        marks = ",".join("?" * len(batch_ids))
        return {r[0] for r in self.conn.execute(f"SELECT batch_id FROM batches WHERE batch_id IN ({marks})", batch_ids)}

    def batch(self, batch_id: str) -> dict[str, Any]:
        """The batch with ``counts`` per state, ``job_ids`` and ``done``. Raises NotFoundError."""
        rows = list(self.db.query("SELECT * FROM batches WHERE batch_id = ?", [batch_id]))
        if not rows:
            raise NotFoundError(f"no batch {batch_id!r}")
        batch = rows[0]
        counts = {s.value: 0 for s in JobState}
        ids = []
        for job_id, state, updated_at in self.conn.execute(
            "SELECT job_id, state, updated_at FROM jobs WHERE batch_id = ? ORDER BY job_id", [batch_id]
        ):
            counts[state] += 1
            ids.append(job_id)
            batch["updated_at"] = max(batch["updated_at"], updated_at)
        batch["counts"] = counts
        batch["job_ids"] = ids
        batch["done"] = all(is_terminal(s) for s in counts if counts[s]) and bool(ids)
        return batch

    def batch_ids(self) -> list[str]:
        return [r[0] for r in self.conn.execute("SELECT batch_id FROM batches ORDER BY batch_id")]

    def counts(self) -> dict[str, int]:
        """Number of jobs per state (every state present, zero when none); kept up to date by
        every write, so reading it costs nothing."""
        return dict(self._counts)

    def waiting(self) -> int:
        """Jobs waiting to run: ``queued`` + ``retrying``."""
        return self._counts["queued"] + self._counts["retrying"]

    def waiting_of(self, submitted_by: str | None) -> int:
        """Jobs of one sender waiting to run (``queued`` + ``retrying``)."""
        return int(
            self.conn.execute(
                "SELECT count(*) FROM jobs INDEXED BY jobs_waiting_by WHERE submitted_by IS ? "
                "AND state IN ('queued','retrying')",
                [submitted_by],
            ).fetchone()[0]
        )

    def iter_job_page(self, after: str, limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` jobs with ``job_id > after``, oldest first (a republish in pieces)."""
        cur = self.conn.execute("SELECT * FROM jobs WHERE job_id > ? ORDER BY job_id LIMIT ?", [after, limit])
        names = [d[0] for d in cur.description]
        return [self._decode(dict(zip(names, r, strict=True))) for r in cur]

    def batch_id_page(self, after: str, limit: int) -> list[str]:
        """Up to ``limit`` batch ids greater than ``after``, in order."""
        return [
            r[0]
            for r in self.conn.execute(
                "SELECT batch_id FROM batches WHERE batch_id > ? ORDER BY batch_id LIMIT ?", [after, limit]
            )
        ]

    def running(self) -> list[dict[str, Any]]:
        return [
            self._decode(r)
            for r in self.db.query("SELECT * FROM jobs WHERE state IN ('running','cancelling') ORDER BY started_at")
        ]

    def last_finished(self) -> dict[str, Any] | None:
        rows = list(self.db.query("SELECT * FROM jobs WHERE finished_at IS NOT NULL ORDER BY finished_at DESC LIMIT 1"))
        return self._decode(rows[0]) if rows else None

    def lock_holder(self, lock_key: str, submitted_by: str | None = None) -> str | None:
        """The job that holds ``lock_key`` of sender ``submitted_by``: the oldest active job with
        both, or None."""
        row = self.conn.execute(
            "SELECT job_id FROM jobs INDEXED BY jobs_lock WHERE lock_key = ? AND submitted_by IS ? "
            "AND state IN ('queued','running','retrying','cancelling') ORDER BY created_at, job_id LIMIT 1",
            [lock_key, submitted_by],
        ).fetchone()
        return None if row is None else str(row[0])

    def next_due(self, after: float | None = None) -> float | None:
        """Earliest ``retry_at`` / ``run_at`` of a waiting job, as Unix seconds; with ``after``
        (Unix seconds), the earliest later than it: a job already due that waits for a worker
        is not a time to wake up for (its worker's end is)."""
        # Each MIN reads one entry of its partial index, however long the backlog; a state
        # with no job is not asked (an idle service's every loop turn).
        floor = iso(after) if after is not None else ""
        heads = [
            self.conn.execute(sql, [floor]).fetchone()
            for state, sql in (
                (
                    "retrying",
                    "SELECT retry_at FROM jobs INDEXED BY jobs_retry_due WHERE state = 'retrying' AND retry_at > ? "
                    "ORDER BY retry_at LIMIT 1",
                ),
                (
                    "queued",
                    "SELECT run_at FROM jobs INDEXED BY jobs_run_at WHERE state = 'queued' AND run_at IS NOT NULL "
                    f"AND run_at > ? AND {_LOCK_HEAD} ORDER BY run_at LIMIT 1",
                ),
            )
            if self._counts[state]
        ]
        due = min((h[0] for h in heads if h and h[0]), default=None)
        return parse_iso(due) if due else None

    def events(self, job_id: str) -> list[dict[str, Any]]:
        """The event log of one job, oldest first."""
        return list(self.db.query("SELECT * FROM job_events WHERE job_id = ? ORDER BY id", [job_id]))

    def events_after(
        self,
        after: int,
        limit: int,
        *,
        job_id: str | None = None,
        types: Iterable[str] | None = None,
        submitted_by: tuple[str | None] | None = None,
    ) -> tuple[list[dict[str, Any]], int | None, bool]:
        """The event cursor (docs/topics.md, ``events``): at most ``limit`` events with an id
        above ``after``, oldest first, each ``{"event_id", "type", "job_id", "state",
        "from_state", "attempt", "at", "detail"}`` (``type``: ``new`` when the job was created,
        ``end`` when it reached a terminal state, else ``update``).

        ``submitted_by=(user,)`` keeps the events of that sender's jobs only.

        Returns ``(events, oldest event id kept or None, dropped)``: ``dropped`` is True when an
        event with an id above ``after`` was deleted (with its purged job) before it was read."""
        where: list[str] = ["id > ?"]
        args: list[Any] = [after]
        if submitted_by is not None:
            where.append("job_id IN (SELECT job_id FROM jobs WHERE submitted_by IS ?)")
            args.append(submitted_by[0])
        if job_id is not None:
            where.append("job_id = ?")
            args.append(job_id)
        if types is not None:
            kinds = set(types)
            terms = []
            if "new" in kinds:
                terms.append("from_state IS NULL")
            if "end" in kinds:
                terms.append("(from_state IS NOT NULL AND to_state IN ('succeeded','failed','cancelled'))")
            if "update" in kinds:
                terms.append("(from_state IS NOT NULL AND to_state NOT IN ('succeeded','failed','cancelled'))")
            where.append("(" + (" OR ".join(terms) or "0") + ")")
        rows = self.conn.execute(
            "SELECT id, job_id, at, from_state, to_state, attempt, detail FROM job_events "
            f"WHERE {' AND '.join(where)} ORDER BY id LIMIT ?",
            [*args, limit],
        ).fetchall()
        events = [
            {
                "event_id": r[0],
                "type": "new" if r[3] is None else "end" if is_terminal(JobState(r[4])) else "update",
                "job_id": r[1],
                "state": r[4],
                "from_state": r[3],
                "attempt": r[5],
                "at": r[2],
                "detail": json.loads(r[6]) if r[6] else None,
            }
            for r in rows
        ]
        oldest = self.conn.execute("SELECT min(id) FROM job_events").fetchone()[0]
        deleted = self.conn.execute("SELECT value FROM store_meta WHERE key = 'events_deleted_upto'").fetchone()
        return events, oldest, bool(deleted and deleted[0] > after)

    @staticmethod
    def backup(src: Path | str, dest: Path | str) -> None:
        """Copy the database ``src`` to ``dest`` with SQLite's online backup API: consistent
        while the service keeps writing; ``src`` is opened read-only and not migrated.
        Raises ``FileExistsError`` when ``dest`` exists, ``FileNotFoundError`` when its folder
        does not, ``sqlite3.Error`` when ``src`` is not a readable database."""
        dest = Path(dest)
        if dest.exists():
            raise FileExistsError(f"{dest} exists")
        if not dest.parent.is_dir():
            raise FileNotFoundError(f"folder {dest.parent} does not exist")
        source = sqlite3.connect(f"file:{src}?mode=ro", uri=True, timeout=30)
        try:
            with sqlite3.connect(str(dest)) as target:
                source.backup(target)
            target.close()
        finally:
            source.close()

    def integrity_check(self) -> str:
        """``PRAGMA integrity_check``: ``"ok"`` for a healthy file."""
        return str(self.conn.execute("PRAGMA integrity_check").fetchone()[0])

    # -- writing ------------------------------------------------------------------------

    def submit(
        self,
        specs: Sequence[JobSpec],
        now: float,
        *,
        idempotency_key: str | None = None,
        as_batch: bool = False,
    ) -> tuple[str | None, list[Created]]:
        """Create jobs (one transaction), or find the ones this request created before.

        With ``idempotency_key`` seen before, returns that submit's batch id and jobs, each
        ``duplicate=True``. Without a key, a spec equal to an active job (same kind, input and
        options) returns that job as a duplicate instead of a new one. ``as_batch`` makes a
        batch of the new jobs.

        Returns ``(batch_id | None, [Created, ...])`` in the order of ``specs``.

        An idempotency key belongs to its sender (``specs[0].submitted_by``): the same key sent
        by another user is another key (docs/topics.md, "Idempotent submits").
        """
        if (
            self._group_depth == 1
            and idempotency_key is None
            and not as_batch
            and all(spec.lock_key is None and _bindable(spec.input) for spec in specs)
        ):
            return None, [self._submit_deferred(spec, now) for spec in specs]
        if idempotency_key is not None and specs:
            idempotency_key = _sender_key(idempotency_key, specs[0].submitted_by)
        with self._immediate():
            if idempotency_key is not None:
                found = self._idempotent(idempotency_key)
                if found is not None:
                    return found
                # its jobs were purged (or it was never used): the key is free
                self.conn.execute("DELETE FROM idempotency_keys WHERE key = ?", [idempotency_key])
            at = iso(now)
            batch_id = new_id(now) if as_batch else None
            if batch_id:
                self.conn.execute(
                    "INSERT INTO batches (batch_id, total, created_at, updated_at) VALUES (?, ?, ?, ?)",
                    [batch_id, len(specs), at, at],
                )
            out: list[Created] = []
            fresh: list[Created] = []
            new_jobs: list[dict[str, Any]] = []
            for spec in specs:
                key = dedupe_key(spec.kind, spec.input, spec.options)
                if idempotency_key is None and not as_batch:
                    found = self.conn.execute(
                        "SELECT job_id FROM jobs WHERE dedupe_key = ? AND state IN "
                        "('queued','running','retrying','cancelling') AND submitted_by IS ? LIMIT 1",
                        [key, spec.submitted_by],
                    ).fetchone()
                    if found:
                        out.append(Created(self.get(found[0]), True))
                        continue
                if spec.lock_key is not None and spec.reject_when_locked:
                    holder = self.lock_holder(spec.lock_key, spec.submitted_by)
                    if holder is not None:
                        raise LockHeld(spec.lock_key, holder)
                job_id = new_id(now)
                job = _queued_row(spec, job_id, key, batch_id, at)
                new_jobs.append(job)
                out.append(Created(self._decode(dict(job)), False))
                fresh.append(out[-1])
            # Prepared once per connection (sqlite3's statement cache); one executemany each.
            if new_jobs:
                # every row has the same keys: the columns of the table
                columns = list(new_jobs[0])
                self.conn.executemany(
                    f"INSERT INTO jobs ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
                    [tuple(j.values()) for j in new_jobs],
                )
                self.conn.executemany(
                    "INSERT INTO job_events (job_id, at, from_state, to_state, attempt, detail) "
                    "VALUES (?, ?, NULL, 'queued', 0, NULL)",
                    [(j["job_id"], at) for j in new_jobs],
                )
                for created, event_id in zip(fresh, self._last_event_ids(len(new_jobs)), strict=True):
                    created.job["event_id"] = event_id
            if idempotency_key is not None:
                self.conn.execute(
                    "INSERT INTO idempotency_keys (key, batch_id, job_ids, created_at) VALUES (?, ?, ?, ?)",
                    [idempotency_key, batch_id, json.dumps([c.job["job_id"] for c in out]), at],
                )
            self._counts["queued"] += len(new_jobs)
        return batch_id, out

    def _submit_deferred(self, spec: JobSpec, now: float) -> Created:
        """:meth:`submit` of one plain job (no batch, idempotency key or lock key) directly
        inside :meth:`group`: its rows are kept for :meth:`_write_deferred`, which writes the
        group's plain submits with one ``executemany`` per table before any other statement
        runs and before the commit (a savepoint and two inserts per request cost 2x as much).

        Nothing can fail between here and that write but the group's transaction itself, which
        then rolls back whole: the effect is the one of :meth:`submit`. Its ``queued`` event
        gets the id its row will have: ids are taken in order from the highest ``job_events``
        id (AUTOINCREMENT), and every other insert of an event waits for these rows."""
        key = dedupe_key(spec.kind, spec.input, spec.options)
        pending = self._deferred_dedupe.get((key, spec.submitted_by))
        if pending is not None:
            return Created(self._decode(dict(pending)), True)
        found = self._conn.execute(
            "SELECT job_id FROM jobs WHERE dedupe_key = ? AND state IN "
            "('queued','running','retrying','cancelling') AND submitted_by IS ? LIMIT 1",
            [key, spec.submitted_by],
        ).fetchone()
        if found:
            return Created(self.get(found[0]), True)
        if not self._deferred_jobs:
            self._next_event_id = (
                1
                + self._conn.execute(
                    "SELECT max(coalesce((SELECT seq FROM sqlite_sequence WHERE name = 'job_events'), 0), "
                    "coalesce((SELECT max(id) FROM job_events), 0))"
                ).fetchone()[0]
            )
        at = iso(now)
        job_id = new_id(now)
        options = _json_text(spec.options)
        run_at = iso(spec.run_at) if spec.run_at else None
        job = _queued_row(spec, job_id, key, None, at, options=options, run_at=run_at)
        self._deferred_jobs.append(_deferred_job_row(job))
        event_id = self._next_event_id
        self._next_event_id += 1
        self._deferred_events.append((event_id, job_id, at, None, JobState.QUEUED.value, 0))
        self._deferred_dedupe[(key, spec.submitted_by)] = job
        self._counts["queued"] += 1
        created = Created(self._decode(dict(job)), False)
        created.job["event_id"] = event_id
        return created

    def _claim_deferred(self, now: float, kinds: Sequence[str], owner: str) -> dict[str, Any] | None:
        """:meth:`claim` of a job submitted in this group and not written yet (an idle service's
        new job): its row and its ``running`` event are changed before they are written, instead
        of being written ``queued`` and then found and updated (P2's idle submit).

        Taken only when every waiting job of the store is one of the group's deferred submits
        (none has a lock key; ``retrying`` is empty): then the head of the claim order among
        them is the head of the store, and the result is the one of :meth:`claim_many`: the
        same order (highest ``priority``, then oldest, then ``job_id``), the same due rule,
        the same row and event. ``None``: not taken here (no deferred job is the head, or none
        is due); the caller then claims with :meth:`claim_many`."""
        if not self._deferred_jobs:
            return None
        counts = self._counts
        if counts["retrying"] or counts["queued"] != sum(1 for row in self._deferred_jobs if row[6] == "queued"):
            return None
        at = iso(now)
        head: tuple[int, str, str] | None = None
        pick = -1
        for i, row in enumerate(self._deferred_jobs):
            # columns of _INSERT_JOB: job_id 0, kind 2, priority 5, state 6, run_at 11, created_at 14
            if row[6] != "queued" or row[2] not in kinds or (row[11] or "") > at:
                continue
            rank = (-row[5], row[14], row[0])
            if head is None or rank < head:
                head, pick = rank, i
        if head is None:
            return None
        row = self._deferred_jobs[pick]
        key = (row[9], row[12])
        job = dict(self._deferred_dedupe[key])
        job.update(
            state=JobState.RUNNING.value,
            attempt=job["attempt"] + 1,
            seq=job["seq"] + 1,
            owner=owner,
            started_at=at,
            updated_at=at,
            retry_at=None,
            stage=None,
            progress=0.0,
            eta_s=None,
        )
        self._deferred_jobs[pick] = _deferred_job_row(job)
        self._deferred_dedupe[key] = job
        event_id = self._next_event_id
        self._next_event_id += 1
        self._deferred_events.append((event_id, job["job_id"], at, JobState.QUEUED.value, job["state"], job["attempt"]))
        counts["queued"] -= 1
        counts["running"] += 1
        claimed = self._decode(dict(job))
        claimed["event_id"] = event_id
        return claimed

    def submitted_with(self, idempotency_key: str, submitted_by: str | None) -> tuple[str | None, list[Created]] | None:
        """The batch id and jobs (each ``duplicate=True``) of the submit that used
        ``idempotency_key`` for the sender ``submitted_by``, or None when the key is free: never
        used, or one of its jobs is no longer in the store (docs/topics.md, "Duplicates")."""
        return self._idempotent(_sender_key(idempotency_key, submitted_by))

    def _idempotent(self, key: str) -> tuple[str | None, list[Created]] | None:
        row = self.conn.execute("SELECT batch_id, job_ids FROM idempotency_keys WHERE key = ?", [key]).fetchone()
        ids = json.loads(row[1]) if row else []
        if not ids or len(self.job_ids_in(ids)) != len(ids):
            return None
        return row[0], [Created(self.get(i), True) for i in ids]

    def _event(
        self, job_id: str, at: str, src: JobState | None, dst: JobState, attempt: int, detail: dict[str, Any] | None
    ) -> int:
        """Append one event to the log; its ``event_id``."""
        cur = self.conn.execute(
            "INSERT INTO job_events (job_id, at, from_state, to_state, attempt, detail) VALUES (?, ?, ?, ?, ?, ?)",
            [job_id, at, src.value if src else None, dst.value, attempt, json.dumps(detail) if detail else None],
        )
        assert cur.lastrowid is not None
        return cur.lastrowid

    def _last_event_ids(self, n: int) -> range:
        """The ids of the ``n`` events just inserted by one ``executemany`` (AUTOINCREMENT ids
        are consecutive inside one write transaction)."""
        last = self.conn.execute("SELECT last_insert_rowid()").fetchone()[0]
        return range(last - n + 1, last + 1)

    def claim(self, now: float, kinds: Iterable[str], owner: str) -> dict[str, Any] | None:
        """Move the next due job of one of ``kinds`` to ``running`` and return it, or ``None``.

        Order: highest ``priority``, then oldest. Due: ``queued`` with ``run_at`` unset or
        past, or ``retrying`` with ``retry_at`` past. ``attempt`` is incremented; ``owner``
        (the service's per-start run id) marks whose attempt it is.
        """
        kinds = list(kinds)
        job = self._claim_deferred(now, kinds, owner)
        if job is not None:
            return job
        jobs = self.claim_many(now, kinds, owner, 1)
        return jobs[0] if jobs else None

    def claim_many(
        self, now: float, kinds: Iterable[str], owner: str, n: int, *, started: bool = True
    ) -> list[dict[str, Any]]:
        """:meth:`claim` up to ``n`` jobs at once, in claim order (one query per state).

        ``started=False`` claims jobs for a worker's queue: ``started_at`` stays null until
        :meth:`mark_started_many`, so that a service death before the worker got to them does not
        count their attempt (:meth:`orphans`)."""
        kinds = list(kinds)
        if not kinds or n < 1:
            return []
        at = iso(now)
        marks = ",".join("?" * len(kinds))
        with self._immediate():
            # One query per state that has jobs, each walking the claim index in priority
            # order; the better heads of the two win.
            heads = [
                h
                for state, due in (("queued", "coalesce(run_at, '') <= ?"), ("retrying", "retry_at <= ?"))
                if self._counts[state]
                for h in self.conn.execute(
                    f"SELECT job_id, state, priority, created_at FROM jobs INDEXED BY jobs_claim "
                    f"WHERE state = ? AND kind IN ({marks}) AND {due} AND {_LOCK_HEAD} "
                    "ORDER BY priority DESC, created_at, job_id LIMIT ?",
                    [state, *kinds, at, n],
                )
            ]
            heads.sort(key=lambda h: (-h[2], h[3], h[0]))
            heads = heads[:n]
            if not heads:
                return []
            # one statement for all of them; RETURNING gives no order, so rows are put back in
            # claim order
            cur = self.conn.execute(
                "UPDATE jobs SET state = 'running', attempt = attempt + 1, seq = seq + 1, "
                "owner = ?, started_at = ?, updated_at = ?, retry_at = NULL, stage = NULL, "
                f"progress = 0, eta_s = NULL WHERE job_id IN ({','.join('?' * len(heads))}) RETURNING *",
                [owner, at if started else None, at, *(h[0] for h in heads)],
            )
            names = [d[0] for d in cur.description]
            by_id = {r["job_id"]: r for r in (dict(zip(names, row, strict=True)) for row in cur.fetchall())}
            jobs = [self._decode(by_id[h[0]]) for h in heads]
            for _, src, _, _ in heads:
                self._counts[src] -= 1
                self._counts["running"] += 1
            rows = [(j["job_id"], at, src, j["attempt"]) for j, (_, src, _, _) in zip(jobs, heads, strict=False)]
            sql = (
                "INSERT INTO job_events (job_id, at, from_state, to_state, attempt, detail) "
                "VALUES (?, ?, ?, 'running', ?, NULL)"
            )
            event_ids: Iterable[int | None]
            if len(rows) == 1:  # one job (an idle service's claim): its id without another query
                event_ids = [self.conn.execute(sql, rows[0]).lastrowid]
            else:
                self.conn.executemany(sql, rows)
                event_ids = self._last_event_ids(len(rows))
            for job, event_id in zip(jobs, event_ids, strict=True):
                job["event_id"] = event_id
        return jobs

    def transition(
        self,
        job_id: str,
        dst: JobState,
        now: float,
        *,
        expect_attempt: int | None = None,
        detail: dict[str, Any] | None = None,
        current: dict[str, Any] | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        """Move a job to ``dst``, checked against the transition table; returns the new row.

        ``expect_attempt``, when given, fences the change: it applies only if the job is still on
        that attempt (a late report from a superseded attempt is refused). ``fields`` are
        other columns to set (``error``, ``result``, ``retry_at`` as Unix seconds, ...).
        ``seq`` and ``updated_at`` advance; reaching a terminal state sets ``finished_at``.
        ``current`` is the job's row as just read in this transaction, to save reading it again.

        Raises :class:`NotFoundError` for an unknown job and :class:`TransitionError` for a
        move the table forbids or a stale ``attempt``.
        """
        at = iso(now)
        with self._immediate():
            job = current if current is not None and current["job_id"] == job_id else self.get(job_id)
            src = JobState(job["state"])
            if expect_attempt is not None and job["attempt"] != expect_attempt:
                raise TransitionError(f"job {job_id} is on attempt {job['attempt']}, not {expect_attempt}")
            if not can_transition(src, dst):
                raise TransitionError(f"job {job_id}: {src.value} -> {dst.value} is not allowed")
            values: dict[str, Any] = {"state": dst.value, "seq": job["seq"] + 1, "updated_at": at}
            if is_terminal(dst) or dst in (JobState.QUEUED, JobState.RETRYING):
                values["stage"] = None
                values["eta_s"] = None
            if is_terminal(dst):
                values["finished_at"] = at
            elif dst in (JobState.QUEUED, JobState.RETRYING):
                values["progress"] = 0.0
            elif dst in ACTIVE:
                values["finished_at"] = None
            for key, val in fields.items():
                if key in _JSON_COLUMNS:
                    val = json.dumps(val) if val is not None else None
                elif key == "retry_at" and val is not None:
                    val = iso(val)
                values[key] = val
            sets = ", ".join(f"{k} = ?" for k in values)
            row = self._row(f"UPDATE jobs SET {sets} WHERE job_id = ? RETURNING *", [*values.values(), job_id])
            assert row is not None
            row["event_id"] = self._event(job_id, at, src, dst, values.get("attempt", job["attempt"]), detail)
            self._counts[src.value] -= 1
            self._counts[dst.value] += 1
            return row

    def succeed_many(
        self, reports: Sequence[tuple[str, int, Any]], now: float, *, started: Iterable[str] = ()
    ) -> dict[str, dict[str, Any]]:
        """Workers' success reports ``(job_id, attempt, result)`` for jobs ``running`` on that
        attempt: the change ``transition(job_id, SUCCEEDED, now, expect_attempt=attempt,
        result=result, progress=100.0, error=None, crashes=0)`` makes, for all of them in one
        fenced ``UPDATE ... FROM (VALUES ...)`` per 500 reports and one ``executemany`` of
        their event rows, in the order given (the usual end of a job, on the hot path).
        ``started`` names jobs among them that their worker started in this same turn: their
        ``started_at`` is set here, if still unset (what :meth:`mark_started_many` would have
        done just before). Returns job id -> new row, with its ``event_id``, for the reports
        that applied; the others (cancelling, superseded, deleted) are left to the caller's
        general path, which decides and explains."""
        at = iso(now)
        done: dict[str, dict[str, Any]] = {}
        started = set(started)
        with self._immediate():
            for i in range(0, len(reports), 500):
                part = reports[i : i + 500]
                args: list[Any] = [at, at, at]
                for job_id, attempt, result in part:
                    args += (job_id, attempt, _json_text(result) if result is not None else None, job_id in started)
                cur = self.conn.execute(
                    "UPDATE jobs SET state = 'succeeded', seq = seq + 1, updated_at = ?, stage = NULL, "
                    "eta_s = NULL, finished_at = ?, result = v.column3, progress = 100.0, error = NULL, "
                    "crashes = 0, started_at = CASE WHEN v.column4 THEN coalesce(started_at, ?) ELSE started_at END "
                    f"FROM (VALUES {','.join(['(?,?,?,?)'] * len(part))}) AS v "
                    "WHERE jobs.job_id = v.column1 AND jobs.attempt = v.column2 AND jobs.state = 'running' "
                    "RETURNING *",
                    args,
                )
                names = [d[0] for d in cur.description]
                for row in cur.fetchall():
                    job = self._decode(dict(zip(names, row, strict=True)))
                    done[job["job_id"]] = job
            if done:
                ordered = [(job_id, attempt) for job_id, attempt, _ in reports if job_id in done]
                self.conn.executemany(
                    "INSERT INTO job_events (job_id, at, from_state, to_state, attempt, detail) "
                    "VALUES (?, ?, 'running', 'succeeded', ?, NULL)",
                    [(job_id, at, attempt) for job_id, attempt in ordered],
                )
                for (job_id, _), event_id in zip(ordered, self._last_event_ids(len(ordered)), strict=True):
                    done[job_id]["event_id"] = event_id
                self._counts["running"] -= len(done)
                self._counts["succeeded"] += len(done)
        return done

    def mark_started_many(self, starts: Sequence[tuple[str, int]], now: float) -> None:
        """Record that workers started these ``(job_id, attempt)`` from their queues (jobs
        claimed with ``started=False``): ``started_at`` is set where still unset."""
        if starts:
            at = iso(now)
            self.conn.executemany(
                "UPDATE jobs SET started_at = ? WHERE job_id = ? AND attempt = ? AND started_at IS NULL",
                [(at, job_id, attempt) for job_id, attempt in starts],
            )

    def progress(
        self, job_id: str, now: float, *, progress: float, stage: str | None, eta_s: float | None
    ) -> dict[str, Any]:
        """Record progress (percent 0-100) of a running job; ``seq`` advances. Returns the row."""
        at = iso(now)
        with self._immediate():
            row = self._row(
                "UPDATE jobs SET progress = ?, stage = ?, eta_s = ?, seq = seq + 1, updated_at = ? "
                "WHERE job_id = ? AND state IN ('running','cancelling') RETURNING *",
                [progress, stage, eta_s, at, job_id],
            )
        return row if row is not None else self.get(job_id)

    def orphans(self, owner: str) -> list[str]:
        """Ids of jobs left ``running``/``cancelling`` by another run of the service."""
        return [
            r[0]
            for r in self.conn.execute(
                "SELECT job_id FROM jobs WHERE state IN ('running','cancelling') AND (owner IS NULL OR owner != ?)",
                [owner],
            )
        ]

    def delete(self, job_ids: Iterable[str]) -> tuple[list[str], list[str], list[str]]:
        """Delete terminal jobs (and their events), and batches left without jobs.

        Returns ``(job ids deleted, batch ids deleted, batch ids that lost jobs but remain)``;
        non-terminal or unknown ids are skipped.
        """
        gone: list[str] = []
        batches: set[str] = set()
        with self._immediate():
            for job_id in job_ids:
                row = self.conn.execute("SELECT state, batch_id FROM jobs WHERE job_id = ?", [job_id]).fetchone()
                if row and is_terminal(row[0]):
                    (newest,) = self.conn.execute(
                        "SELECT max(id) FROM job_events WHERE job_id = ?", [job_id]
                    ).fetchone()
                    if newest is not None:  # the event cursor reports events deleted unread (events_after)
                        self.conn.execute(
                            "INSERT INTO store_meta (key, value) VALUES ('events_deleted_upto', ?) "
                            "ON CONFLICT (key) DO UPDATE SET value = max(value, excluded.value)",
                            [newest],
                        )
                    self.conn.execute("DELETE FROM job_events WHERE job_id = ?", [job_id])
                    self.conn.execute("DELETE FROM jobs WHERE job_id = ?", [job_id])
                    gone.append(job_id)
                    self._counts[row[0]] -= 1
                    if row[1]:
                        batches.add(row[1])
            empty = [
                b
                for b in sorted(batches)
                if self.conn.execute("SELECT 1 FROM jobs WHERE batch_id = ? LIMIT 1", [b]).fetchone() is None
            ]
            for b in empty:
                self.conn.execute("DELETE FROM batches WHERE batch_id = ?", [b])
        return gone, empty, sorted(batches.difference(empty))

    def finished_before(
        self, cutoff: float, states: Iterable[str] = ("succeeded", "failed", "cancelled"), limit: int = 10_000
    ) -> list[str]:
        """Ids of terminal jobs in ``states`` that finished before ``cutoff`` (Unix seconds)."""
        states = list(states)
        marks = ",".join("?" * len(states))
        return [
            r[0]
            for r in self.conn.execute(
                f"SELECT job_id FROM jobs WHERE state IN ({marks}) AND finished_at < ? LIMIT ?",
                [*states, iso(cutoff), limit],
            )
        ]

    # -- watch folders (docs/configuration.md, "[[watch]]") -------------------------------

    def _create_watch_table(self) -> None:
        """``watch_files``: one row per file a watch took on, holding the version it took
        (size in bytes, modification time in ns, content digest) and what became of it."""
        self.db.table("watch_files").create(
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

    def watched_files(self, folders: Sequence[str]) -> dict[str, tuple[int, int, str]]:
        """The file versions taken on under ``folders`` (absolute paths without a trailing
        ``/``): path -> ``(size, mtime_ns, digest)``."""
        out: dict[str, tuple[int, int, str]] = {}
        for folder in folders:
            # '0' sorts right after '/': the range is every path under "<folder>/"
            for path, size, mtime_ns, digest in self.conn.execute(
                "SELECT path, size, mtime_ns, digest FROM watch_files WHERE path >= ? AND path < ?",
                [folder + "/", folder + "0"],
            ):
                out[path] = (size, mtime_ns, digest)
        return out

    def record_watched(
        self, path: str, size: int, mtime_ns: int, digest: str, outcome: str, job_id: str | None, now: float
    ) -> None:
        """Record the version of ``path`` a watch took on and its ``outcome`` (``job``,
        ``output``, ``refused:<code>``), in the caller's transaction (the job's,
        so that a job and its record are committed together)."""
        self.conn.execute(
            "INSERT INTO watch_files (path, size, mtime_ns, digest, outcome, job_id, at) VALUES (?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (path) DO UPDATE SET size = excluded.size, mtime_ns = excluded.mtime_ns, "
            "digest = excluded.digest, outcome = excluded.outcome, at = excluded.at, "
            "job_id = coalesce(excluded.job_id, watch_files.job_id)",
            [path, size, mtime_ns, digest, outcome, job_id, iso(now)],
        )

    def touch_watched(self, path: str, mtime_ns: int, now: float) -> None:
        """A file taken on before was touched: same content, a new modification time."""
        self.conn.execute("UPDATE watch_files SET mtime_ns = ?, at = ? WHERE path = ?", [mtime_ns, iso(now), path])

    def watch_counts(self, folder: str) -> dict[str, int]:
        """How many files under ``folder`` the watch took on, by outcome (``job``, ...)."""
        counts: dict[str, int] = {}
        for outcome, n in self.conn.execute(
            "SELECT outcome, count(*) FROM watch_files WHERE path >= ? AND path < ? GROUP BY outcome",
            [folder + "/", folder + "0"],
        ):
            counts[outcome] = n
        return counts

    def beside_jobs(self, folder: str) -> list[tuple[str, str, float]]:
        """Jobs that write their outputs beside an input in ``folder`` (option ``output:
        beside``): ``(job_id, input, created_at in Unix seconds)``, inputs directly in
        ``folder`` only."""
        rows = self.conn.execute(
            "SELECT job_id, input, created_at FROM jobs WHERE input >= ? AND input < ? "
            "AND json_extract(options, '$.output') = 'beside'",
            [folder + "/", folder + "0"],
        )
        return [(j, i, parse_iso(c)) for j, i, c in rows if "/" not in i[len(folder) + 1 :]]
