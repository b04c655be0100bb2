"""New jobs: one transaction per submit with its batch, idempotency key and event rows, or,
for a plain submit inside a group, rows deferred to one ``executemany`` per table
(docs/topics.md, "`submit`": duplicates and idempotency keys).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from edge_queue.rules.states import JobState

from .connection import Connection
from .ids import dedupe_key, iso, new_id, sender_key
from .jobs import Jobs
from .rows import Created, JobSpec, LockHeld, bindable, decode_row, deferred_job_row, json_text, queued_row


class Submits:
    """Creates jobs; finds the jobs of a submit made before with the same idempotency key."""

    def __init__(self, c: Connection, jobs: Jobs) -> None:
        self.c, self.jobs = c, jobs

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
        by another user is another key (docs/topics.md, "`submit`").
        """
        if (
            self.c.group_depth == 1
            and idempotency_key is None
            and not as_batch
            and all(spec.lock_key is None and bindable(spec.input) for spec in specs)
        ):
            return None, [self.submit_deferred(spec, now) for spec in specs]
        if idempotency_key is not None and specs:
            idempotency_key = sender_key(idempotency_key, specs[0].submitted_by)
        with self.c.immediate():
            if idempotency_key is not None:
                found = self.idempotent(idempotency_key)
                if found is not None:
                    return found
                # its jobs were purged (or it was never used): the key is free
                self.c.conn.execute("DELETE FROM idempotency_keys WHERE key = ?", [idempotency_key])
            at = iso(now)
            batch_id = new_id(now) if as_batch else None
            if batch_id:
                self.c.conn.execute(
                    "INSERT INTO batches (batch_id, total, created_at, updated_at) VALUES (?, ?, ?, ?)",
                    [batch_id, len(specs), at, at],
                )
            out: list[Created] = []
            fresh: list[Created] = []
            new_jobs: list[dict[str, Any]] = []
            for spec in specs:
                key = dedupe_key(spec.kind, spec.input, spec.options)
                if idempotency_key is None and not as_batch:
                    found = self.c.conn.execute(
                        "SELECT job_id FROM jobs WHERE dedupe_key = ? AND state IN "
                        "('queued','running','retrying','cancelling') AND submitted_by IS ? LIMIT 1",
                        [key, spec.submitted_by],
                    ).fetchone()
                    if found:
                        out.append(Created(self.jobs.get(found[0]), True))
                        continue
                if spec.lock_key is not None and spec.reject_when_locked:
                    holder = self.jobs.lock_holder(spec.lock_key, spec.submitted_by)
                    if holder is not None:
                        raise LockHeld(spec.lock_key, holder)
                job_id = new_id(now)
                job = queued_row(spec, job_id, key, batch_id, at)
                new_jobs.append(job)
                out.append(Created(decode_row(dict(job)), False))
                fresh.append(out[-1])
            # Prepared once per connection (sqlite3's statement cache); one executemany each.
            if new_jobs:
                # every row has the same keys: the columns of the table
                columns = list(new_jobs[0])
                self.c.conn.executemany(
                    f"INSERT INTO jobs ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
                    [tuple(j.values()) for j in new_jobs],
                )
                self.c.conn.executemany(
                    "INSERT INTO job_events (job_id, at, from_state, to_state, attempt, detail) "
                    "VALUES (?, ?, NULL, 'queued', 0, NULL)",
                    [(j["job_id"], at) for j in new_jobs],
                )
                for created, event_id in zip(fresh, self.c.last_event_ids(len(new_jobs)), strict=True):
                    created.job["event_id"] = event_id
            if idempotency_key is not None:
                self.c.conn.execute(
                    "INSERT INTO idempotency_keys (key, batch_id, job_ids, created_at) VALUES (?, ?, ?, ?)",
                    [idempotency_key, batch_id, json.dumps([c.job["job_id"] for c in out]), at],
                )
            self.c.counts["queued"] += len(new_jobs)
        return batch_id, out

    def submit_deferred(self, spec: JobSpec, now: float) -> Created:
        """:meth:`submit` of one plain job (no batch, idempotency key or lock key) directly
        inside :meth:`.Connection.group`: its rows are kept for :meth:`Connection.write_deferred`,
        which writes the group's plain submits with one ``executemany`` per table before any
        other statement runs and before the commit (a savepoint and two inserts per request cost
        2x as much).

        Nothing can fail between here and that write but the group's transaction itself, which
        then rolls back whole: the effect is the one of :meth:`submit`. Its ``queued`` event
        gets the id its row will have: ids are taken in order from the highest ``job_events``
        id (AUTOINCREMENT), and every other insert of an event waits for these rows."""
        key = dedupe_key(spec.kind, spec.input, spec.options)
        pending = self.c.deferred_dedupe.get((key, spec.submitted_by))
        if pending is not None:
            return Created(decode_row(dict(pending)), True)
        found = self.c.raw.execute(
            "SELECT job_id FROM jobs WHERE dedupe_key = ? AND state IN "
            "('queued','running','retrying','cancelling') AND submitted_by IS ? LIMIT 1",
            [key, spec.submitted_by],
        ).fetchone()
        if found:
            return Created(self.jobs.get(found[0]), True)
        if not self.c.deferred_jobs:
            self.c.next_event_id = (
                1
                + self.c.raw.execute(
                    "SELECT max(coalesce((SELECT seq FROM sqlite_sequence WHERE name = 'job_events'), 0), "
                    "coalesce((SELECT max(id) FROM job_events), 0))"
                ).fetchone()[0]
            )
        at = iso(now)
        job_id = new_id(now)
        options = json_text(spec.options)
        run_at = iso(spec.run_at) if spec.run_at else None
        job = queued_row(spec, job_id, key, None, at, options=options, run_at=run_at)
        self.c.deferred_jobs.append(deferred_job_row(job))
        event_id = self.c.next_event_id
        self.c.next_event_id += 1
        self.c.deferred_events.append((event_id, job_id, at, None, JobState.QUEUED.value, 0))
        self.c.deferred_dedupe[(key, spec.submitted_by)] = job
        self.c.counts["queued"] += 1
        created = Created(decode_row(dict(job)), False)
        created.job["event_id"] = event_id
        return created

    def submitted_with(self, idempotency_key: str, submitted_by: str | None) -> tuple[str | None, list[Created]] | None:
        """The batch id and jobs (each ``duplicate=True``) of the submit that used
        ``idempotency_key`` for the sender ``submitted_by``, or None when the key is free: never
        used, or one of its jobs is no longer in the store (docs/topics.md, "`submit`")."""
        return self.idempotent(sender_key(idempotency_key, submitted_by))

    def idempotent(self, key: str) -> tuple[str | None, list[Created]] | None:
        row = self.c.conn.execute("SELECT batch_id, job_ids FROM idempotency_keys WHERE key = ?", [key]).fetchone()
        ids = json.loads(row[1]) if row else []
        if not ids or len(self.jobs.job_ids_in(ids)) != len(ids):
            return None
        return row[0], [Created(self.jobs.get(i), True) for i in ids]
