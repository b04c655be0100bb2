"""The store: one SQLite database, the single source of truth.

Every SQL statement of edge-queue lives in this package, split by what it stores:

- :mod:`.connection`: the one connection, the group commit, write transactions, deferred rows;
- :mod:`.schema`: tables, indexes, migrations;
- :mod:`.jobs`: reading jobs, transitions, progress, orphans, deletion;
- :mod:`.submits` and :mod:`.claims`: new jobs, claims, and the hot path's outcomes;
- :mod:`.events`: the event log; :mod:`.requests`: records of executed requests;
- :mod:`.batches`, :mod:`.watched`, :mod:`.meta`: batches, watched files, the store's own values;
- :mod:`.chunks`: the kept chunks of long jobs, from which their next attempt resumes;
- :mod:`.outputs`: the files each job's workers wrote, and what identifies each one;
- :mod:`.ids` and :mod:`.rows`: ids, timestamps and the rows as written.

sqlite-utils creates the schema and serves the rest of the reads; the hot path (submit, claim,
transition, progress: several statements per job) uses plain ``sqlite3`` statements, prepared
once per connection by its statement cache, because sqlite-utils introspects the table on every
``insert``/``update``. Each write runs in one ``BEGIN IMMEDIATE`` transaction, or a savepoint
inside :meth:`Store.group`, so a job, its batch, its idempotency key and its event log row are
committed together or not at all.

All ``now`` arguments are Unix times in seconds (float); the store writes them as RFC 3339
UTC strings with milliseconds, which sort in time order as text.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import sqlite_utils

from edge_queue.rules.lifecycle import keeps_chunks
from edge_queue.rules.states import JobState

from . import space
from .batches import Batches
from .chunks import Chunks
from .claims import Claims
from .connection import WAL_LIMIT_BYTES, Connection
from .events import EventLog
from .ha_owed import HaOwed
from .ids import dedupe_key, ids_after, iso, new_id, parse_iso
from .jobs import Jobs
from .meta import Meta, backup
from .outputs import OutputFiles
from .requests import RequestRecords
from .rows import Created, JobSpec, LockHeld
from .schema import SCHEMA_VERSION, ensure_tables, migrate
from .submits import Submits
from .watched import BesideJob, WatchedFiles

__all__ = [
    "SCHEMA_VERSION",
    "WAL_LIMIT_BYTES",
    "BesideJob",
    "Created",
    "JobSpec",
    "LockHeld",
    "Store",
    "dedupe_key",
    "ids_after",
    "iso",
    "new_id",
    "parse_iso",
]


class Store:
    """The job store: one connection and the rooms over it, behind one interface; the request
    records (:attr:`requests`), the batches' pages (:attr:`batches`) and the watched files
    (:attr:`watched`) are used through the rooms it holds. Not thread-safe: the service's main
    loop is its only user.

    Args:
        path: the database file; created with its parent folder when missing.
        durability: ``"full"`` (``synchronous=FULL``, survives power loss) or ``"normal"``
            (``synchronous=NORMAL``: a power cut may lose the last commits, a crash does not).
    """

    def __init__(self, path: Path | str, durability: str = "full") -> None:
        self.connection = c = Connection(path, durability)
        self.path = c.path
        ensure_tables(c)
        space.convert(c)
        c.counts = c.load_counts()
        # the newest ids (primary keys: two index look-ups) bound the ids made from now on
        for table, column in (("jobs", "job_id"), ("batches", "batch_id")):
            ids_after(c.conn.execute(f"SELECT max({column}) FROM {table}").fetchone()[0])
        self.jobs = Jobs(c)
        self.submits = Submits(c, self.jobs)
        self.claims = Claims(c)
        self.event_log = EventLog(c)
        self.requests = RequestRecords(c)
        self.batches = Batches(c)
        self.watched = WatchedFiles(c)
        self.meta_ = Meta(c)
        self.chunks = Chunks(c)
        self.outputs = OutputFiles(c)
        self.ha_owed = HaOwed(c)  # finished runs not yet known notified to Home Assistant

    @property
    def conn(self) -> sqlite3.Connection:
        """The connection, with the group's deferred rows written first."""
        return self.connection.conn

    @property
    def db(self) -> sqlite_utils.Database:
        """sqlite-utils on :attr:`conn` (the deferred rows written first)."""
        return self.connection.db

    def group(self) -> AbstractContextManager[None]:
        """Group commit: every write inside is one transaction, one fsync at the end
        (:meth:`Connection.group`). The caller must not make any of the writes visible
        (responses, PUBACKs, state publishes) before the block has exited without an exception."""
        return self.connection.group()

    def close(self) -> None:
        self.connection.close()

    def shrink_wal(self) -> bool:
        """:meth:`.Connection.shrink_wal` (outside a group)."""
        return self.connection.shrink_wal()

    def give_back_space(self) -> int:
        """:func:`.space.give_back` (outside a group): free pages returned to the file system."""
        return space.give_back(self.connection)

    def migrate(self) -> None:
        """:func:`.schema.migrate`: create the schema when missing. Raises ``RuntimeError`` for
        a newer schema. Opening the store has done it already."""
        migrate(self.connection)

    def counts(self) -> dict[str, int]:
        """Number of jobs per state (every state present, zero when none); kept up to date by
        every write, so reading it costs nothing."""
        return dict(self.connection.counts)

    def waiting(self) -> int:
        """Jobs waiting to run: ``queued`` + ``retrying``."""
        counts = self.connection.counts
        return counts["queued"] + counts["retrying"]

    def newest_event_id(self) -> int:
        """:meth:`EventLog.newest_event_id`."""
        return self.event_log.newest_event_id()

    @staticmethod
    def backup(src: Path | str, dest: Path | str) -> None:
        """:func:`.meta.backup`: an online copy of the database ``src`` to ``dest``."""
        backup(src, dest)

    def get(self, job_id: str) -> dict[str, Any]:
        """:meth:`.Jobs.get`."""
        return self.jobs.get(job_id)

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
        input_contains: str | None = None,
    ) -> list[dict[str, Any]]:
        """:meth:`.Jobs.list_jobs`."""
        return self.jobs.list_jobs(
            state=state,
            kind=kind,
            batch_id=batch_id,
            before=before,
            limit=limit,
            lock_key=lock_key,
            submitted_by=submitted_by,
            input_contains=input_contains,
        )

    def count_jobs(
        self,
        *,
        state: str | None = None,
        kind: str | None = None,
        batch_id: str | None = None,
        lock_key: str | None = None,
        submitted_by: tuple[str | None] | None = None,
        input_contains: str | None = None,
    ) -> int:
        """:meth:`.Jobs.count_jobs`."""
        return self.jobs.count_jobs(
            state=state,
            kind=kind,
            batch_id=batch_id,
            lock_key=lock_key,
            submitted_by=submitted_by,
            input_contains=input_contains,
        )

    def iter_jobs(self) -> Iterator[dict[str, Any]]:
        """:meth:`.Jobs.iter_jobs`."""
        return self.jobs.iter_jobs()

    def job_ids_in(self, job_ids: list[str]) -> set[str]:
        """:meth:`.Jobs.job_ids_in`."""
        return self.jobs.job_ids_in(job_ids)

    def meta(self, key: str) -> int | None:
        """:meth:`.Meta.meta`."""
        return self.meta_.meta(key)

    def set_meta(self, key: str, value: int) -> None:
        """:meth:`.Meta.set_meta`."""
        return self.meta_.set_meta(key, value)

    def meta_text(self, key: str) -> str | None:
        """:meth:`.Meta.meta_text`."""
        return self.meta_.meta_text(key)

    def set_meta_text(self, key: str, value: str) -> None:
        """:meth:`.Meta.set_meta_text`."""
        self.meta_.set_meta_text(key, value)

    def instance_id(self) -> str:
        """:meth:`.Meta.instance_id`."""
        return self.meta_.instance_id()

    def client_id_secret(self) -> str:
        """:meth:`.Meta.client_id_secret`."""
        return self.meta_.client_id_secret()

    def batch(self, batch_id: str) -> dict[str, Any]:
        """:meth:`.Batches.batch`."""
        return self.batches.batch(batch_id)

    def submitters(self, limit: int) -> list[str]:
        """:meth:`.Jobs.submitters`."""
        return self.jobs.submitters(limit)

    def waiting_of(self, submitted_by: str | None) -> int:
        """:meth:`.Jobs.waiting_of`."""
        return self.jobs.waiting_of(submitted_by)

    def iter_job_page(self, after: str, limit: int) -> list[dict[str, Any]]:
        """:meth:`.Jobs.iter_job_page`."""
        return self.jobs.iter_job_page(after, limit)

    def running(self) -> list[dict[str, Any]]:
        """:meth:`.Jobs.running`."""
        return self.jobs.running()

    def last_finished(self) -> dict[str, Any] | None:
        """:meth:`.Jobs.last_finished`."""
        return self.jobs.last_finished()

    def lock_holder(self, lock_key: str, submitted_by: str | None = None) -> str | None:
        """:meth:`.Jobs.lock_holder`."""
        return self.jobs.lock_holder(lock_key, submitted_by)

    def next_due(self, after: float | None = None) -> float | None:
        """:meth:`.Jobs.next_due`."""
        return self.jobs.next_due(after)

    def events(self, job_id: str) -> list[dict[str, Any]]:
        """:meth:`.EventLog.events`."""
        return self.event_log.events(job_id)

    def events_after(
        self,
        after: int,
        limit: int,
        *,
        job_id: str | None = None,
        types: Iterable[str] | None = None,
        submitted_by: tuple[str | None] | None = None,
    ) -> tuple[list[dict[str, Any]], int | None, bool]:
        """:meth:`.EventLog.events_after`."""
        return self.event_log.events_after(after, limit, job_id=job_id, types=types, submitted_by=submitted_by)

    def integrity_check(self) -> str:
        """:meth:`.Meta.integrity_check`."""
        return self.meta_.integrity_check()

    def submit(
        self, specs: Sequence[JobSpec], now: float, *, idempotency_key: str | None = None, as_batch: bool = False
    ) -> tuple[str | None, list[Created]]:
        """:meth:`.Submits.submit`."""
        return self.submits.submit(specs, now, idempotency_key=idempotency_key, as_batch=as_batch)

    def submitted_with(self, idempotency_key: str, submitted_by: str | None) -> tuple[str | None, list[Created]] | None:
        """:meth:`.Submits.submitted_with`."""
        return self.submits.submitted_with(idempotency_key, submitted_by)

    def claim(
        self, now: float, kinds: Iterable[str], owner: str, *, exclude: Sequence[str] = ()
    ) -> dict[str, Any] | None:
        """:meth:`.Claims.claim`."""
        return self.claims.claim(now, kinds, owner, exclude=exclude)

    def claim_many(
        self, now: float, kinds: Iterable[str], owner: str, n: int, *, started: bool = True
    ) -> list[dict[str, Any]]:
        """:meth:`.Claims.claim_many`."""
        return self.claims.claim_many(now, kinds, owner, n, started=started)

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
        """:meth:`.Jobs.transition`; a job that ends drops its kept chunks, unless the rule
        says it keeps them for a retry (:func:`~edge_queue.rules.lifecycle.keeps_chunks`)."""
        job = self.jobs.transition(
            job_id, dst, now, expect_attempt=expect_attempt, detail=detail, current=current, **fields
        )
        if job_id in self.chunks.sizes and not keeps_chunks(dst, fields.get("error")):
            self.chunks.drop([job_id])
        return job

    def succeed_many(
        self, reports: Sequence[tuple[str, int, Any]], now: float, *, started: Iterable[str] = ()
    ) -> dict[str, dict[str, Any]]:
        """:meth:`.Claims.succeed_many`; the jobs drop their kept chunks."""
        done = self.claims.succeed_many(reports, now, started=started)
        if self.chunks.sizes:
            self.chunks.drop(done)
        return done

    def mark_started_many(self, starts: Sequence[tuple[str, int]], now: float) -> None:
        """:meth:`.Claims.mark_started_many`."""
        return self.claims.mark_started_many(starts, now)

    def progress(
        self, job_id: str, now: float, *, progress: float, stage: str | None, eta_s: float | None
    ) -> dict[str, Any]:
        """:meth:`.Jobs.progress`."""
        return self.jobs.progress(job_id, now, progress=progress, stage=stage, eta_s=eta_s)

    def orphans(self, owner: str) -> list[str]:
        """:meth:`.Jobs.orphans`."""
        return self.jobs.orphans(owner)

    def on_nodes(self) -> list[dict[str, Any]]:
        """:meth:`.Jobs.on_nodes`."""
        return self.jobs.on_nodes()

    def delete(self, job_ids: Iterable[str]) -> tuple[list[str], list[str], list[str]]:
        """:meth:`.Jobs.delete` (with the jobs' kept chunks)."""
        gone, empty, left = self.jobs.delete(job_ids)
        self.chunks.forget(gone)
        return gone, empty, left

    def keep_chunk(
        self,
        job_id: str,
        attempt: int,
        index: int,
        data: dict[str, Any],
        room: Callable[[int], str | None] | None = None,
    ) -> None:
        """:meth:`.Chunks.keep`."""
        self.chunks.keep(job_id, attempt, index, data, room)

    def kept_chunks(self, job_id: str) -> list[dict[str, Any]]:
        """:meth:`.Chunks.kept`."""
        return self.chunks.kept(job_id)

    def drop_chunks(self, job_ids: Iterable[str]) -> None:
        """:meth:`.Chunks.drop`."""
        self.chunks.drop(job_ids)

    def record_outputs(self, job_id: str, attempt: int, files: dict[str, dict[str, Any]]) -> None:
        """:meth:`.OutputFiles.record`."""
        self.outputs.record(job_id, attempt, files)

    def output_files(self, job_id: str) -> dict[str, dict[str, Any]]:
        """:meth:`.OutputFiles.of`."""
        return self.outputs.of(job_id)

    def finished_before(
        self, cutoff: float, states: Iterable[str] = ("succeeded", "failed", "cancelled"), limit: int = 10000
    ) -> list[str]:
        """:meth:`.Jobs.finished_before`."""
        return self.jobs.finished_before(cutoff, states, limit)
