"""Jobs as stored: reading them, moving them between states (checked against the transition
table and fenced by attempt), progress, orphans of a dead run, deletion.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from edge_queue.errors import NotFoundError, TransitionError
from edge_queue.rules.states import ACTIVE, JobState, can_transition, is_terminal

from .connection import Connection
from .ids import iso, parse_iso
from .rows import JSON_COLUMNS, LOCK_HEAD, decode_row


class Jobs:
    """The ``jobs`` table (and the event row of each change)."""

    def __init__(self, c: Connection) -> None:
        self.c = c

    def get(self, job_id: str) -> dict[str, Any]:
        """The job row (JSON columns decoded). Raises :class:`NotFoundError`."""
        row = self.c.row("SELECT * FROM jobs WHERE job_id = ?", [job_id])
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
        input_contains: str | None = None,
    ) -> list[dict[str, Any]]:
        """Jobs newest first, filtered; ``before`` is a job id to page past (exclusive);
        ``submitted_by=(user,)`` keeps the jobs of that sender only (``(None,)``: of the shared
        request topics); ``input_contains`` keeps the jobs whose input path holds that text
        (ASCII letters in any case)."""
        where, args = _filters(state, kind, batch_id, lock_key, submitted_by, input_contains)
        if before is not None:
            where.append("job_id < ?")
            args.append(before)
        sql = "SELECT * FROM jobs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY job_id DESC LIMIT ?"
        args.append(limit)
        return [decode_row(r) for r in self.c.db.query(sql, args)]

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
        """How many jobs :meth:`list_jobs` finds with these filters, on every page."""
        where, args = _filters(state, kind, batch_id, lock_key, submitted_by, input_contains)
        sql = "SELECT count(*) FROM jobs" + (" WHERE " + " AND ".join(where) if where else "")
        return int(self.c.conn.execute(sql, args).fetchone()[0])

    def iter_jobs(self) -> Iterator[dict[str, Any]]:
        """Every job, oldest first (for republish)."""
        for row in self.c.db.query("SELECT * FROM jobs ORDER BY job_id"):
            yield decode_row(row)

    def job_ids_in(self, job_ids: list[str]) -> set[str]:
        """The subset of ``job_ids`` that the store knows."""
        marks = ",".join("?" * len(job_ids))
        return {r[0] for r in self.c.conn.execute(f"SELECT job_id FROM jobs WHERE job_id IN ({marks})", job_ids)}

    def submitters(self, limit: int) -> list[str]:
        """The broker users who submitted a kept job (at most ``limit``; one scan of the jobs)."""
        rows = self.c.conn.execute(
            "SELECT DISTINCT submitted_by FROM jobs WHERE submitted_by IS NOT NULL LIMIT ?", [limit]
        )
        return [r[0] for r in rows]

    def waiting_of(self, submitted_by: str | None) -> int:
        """Jobs of one sender waiting to run (``queued`` + ``retrying``)."""
        return int(
            self.c.conn.execute(
                "SELECT count(*) FROM jobs INDEXED BY jobs_waiting_by WHERE submitted_by IS ? "
                "AND state IN ('queued','retrying')",
                [submitted_by],
            ).fetchone()[0]
        )

    def iter_job_page(self, after: str, limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` jobs with ``job_id > after``, oldest first (a republish in pieces)."""
        cur = self.c.conn.execute("SELECT * FROM jobs WHERE job_id > ? ORDER BY job_id LIMIT ?", [after, limit])
        names = [d[0] for d in cur.description]
        return [decode_row(dict(zip(names, r, strict=True))) for r in cur]

    def running(self) -> list[dict[str, Any]]:
        return [
            decode_row(r)
            for r in self.c.db.query("SELECT * FROM jobs WHERE state IN ('running','cancelling') ORDER BY started_at")
        ]

    def last_finished(self) -> dict[str, Any] | None:
        rows = list(
            self.c.db.query("SELECT * FROM jobs WHERE finished_at IS NOT NULL ORDER BY finished_at DESC LIMIT 1")
        )
        return decode_row(rows[0]) if rows else None

    def lock_holder(self, lock_key: str, submitted_by: str | None = None) -> str | None:
        """The job that holds ``lock_key`` of sender ``submitted_by``: the oldest active job with
        both, or None."""
        row = self.c.conn.execute(
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
            self.c.conn.execute(sql, [floor]).fetchone()
            for state, sql in (
                (
                    "retrying",
                    "SELECT retry_at FROM jobs INDEXED BY jobs_retry_due WHERE state = 'retrying' AND retry_at > ? "
                    "ORDER BY retry_at LIMIT 1",
                ),
                (
                    "queued",
                    "SELECT run_at FROM jobs INDEXED BY jobs_run_at WHERE state = 'queued' AND run_at IS NOT NULL "
                    f"AND run_at > ? AND {LOCK_HEAD} ORDER BY run_at LIMIT 1",
                ),
            )
            if self.c.counts[state]
        ]
        due = min((h[0] for h in heads if h and h[0]), default=None)
        return parse_iso(due) if due else None

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
        with self.c.immediate():
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
                values["progress"], values["finished_at"] = 0.0, None
            elif dst in ACTIVE:
                values["finished_at"] = None
            for key, val in fields.items():
                if key in JSON_COLUMNS:
                    val = json.dumps(val) if val is not None else None
                elif key == "retry_at" and val is not None:
                    val = iso(val)
                values[key] = val
            sets = ", ".join(f"{k} = ?" for k in values)
            row = self.c.row(f"UPDATE jobs SET {sets} WHERE job_id = ? RETURNING *", [*values.values(), job_id])
            assert row is not None
            row["event_id"] = self.c.event(job_id, at, src, dst, values.get("attempt", job["attempt"]), detail)
            self.c.counts[src.value] -= 1
            self.c.counts[dst.value] += 1
            return row

    def progress(
        self, job_id: str, now: float, *, progress: float, stage: str | None, eta_s: float | None
    ) -> dict[str, Any]:
        """Record progress (percent 0-100) of a running job; ``seq`` advances. Returns the row."""
        at = iso(now)
        with self.c.immediate():
            row = self.c.row(
                "UPDATE jobs SET progress = ?, stage = ?, eta_s = ?, seq = seq + 1, updated_at = ? "
                "WHERE job_id = ? AND state IN ('running','cancelling') RETURNING *",
                [progress, stage, eta_s, at, job_id],
            )
        return row if row is not None else self.get(job_id)

    def orphans(self, owner: str) -> list[str]:
        """Ids of jobs left ``running``/``cancelling`` by another run of the service (jobs held
        by a worker node, ``owner`` ``node:<id>``, are not: their leases go on, :meth:`on_nodes`)."""
        return [
            r[0]
            for r in self.c.conn.execute(
                "SELECT job_id FROM jobs WHERE state IN ('running','cancelling') "
                "AND (owner IS NULL OR (owner != ? AND owner NOT LIKE 'node:%'))",
                [owner],
            )
        ]

    def on_nodes(self) -> list[dict[str, Any]]:
        """Jobs ``running``/``cancelling`` on a worker node (``owner`` ``node:<id>``): job_id,
        attempt, kind, owner (docs/nodes.md, "Leases")."""
        cur = self.c.conn.execute(
            "SELECT job_id, attempt, kind, owner FROM jobs WHERE state IN ('running','cancelling') "
            "AND owner LIKE 'node:%'"
        )
        return [dict(zip(("job_id", "attempt", "kind", "owner"), row, strict=True)) for row in cur]

    def delete(self, job_ids: Iterable[str]) -> tuple[list[str], list[str], list[str]]:
        """Delete terminal jobs (and their events), and batches left without jobs.

        Returns ``(job ids deleted, batch ids deleted, batch ids that lost jobs but remain)``;
        non-terminal or unknown ids are skipped.
        """
        gone: list[str] = []
        batches: set[str] = set()
        with self.c.immediate():
            for job_id in job_ids:
                row = self.c.conn.execute("SELECT state, batch_id FROM jobs WHERE job_id = ?", [job_id]).fetchone()
                if row and is_terminal(row[0]):
                    (newest,) = self.c.conn.execute(
                        "SELECT max(id) FROM job_events WHERE job_id = ?", [job_id]
                    ).fetchone()
                    if newest is not None:  # the event cursor reports events deleted unread (events_after)
                        self.c.conn.execute(
                            "INSERT INTO store_meta (key, value) VALUES ('events_deleted_upto', ?) "
                            "ON CONFLICT (key) DO UPDATE SET value = max(value, excluded.value)",
                            [newest],
                        )
                    self.c.conn.execute("DELETE FROM job_events WHERE job_id = ?", [job_id])
                    self.c.conn.execute("DELETE FROM job_chunks WHERE job_id = ?", [job_id])
                    self.c.conn.execute("DELETE FROM job_outputs WHERE job_id = ?", [job_id])
                    self.c.conn.execute("DELETE FROM jobs WHERE job_id = ?", [job_id])
                    gone.append(job_id)
                    self.c.counts[row[0]] -= 1
                    if row[1]:
                        batches.add(row[1])
            empty = [
                b
                for b in sorted(batches)
                if self.c.conn.execute("SELECT 1 FROM jobs WHERE batch_id = ? LIMIT 1", [b]).fetchone() is None
            ]
            for b in empty:
                self.c.conn.execute("DELETE FROM batches WHERE batch_id = ?", [b])
        return gone, empty, sorted(batches.difference(empty))

    def finished_before(
        self, cutoff: float, states: Iterable[str] = ("succeeded", "failed", "cancelled"), limit: int = 10_000
    ) -> list[str]:
        """Ids of terminal jobs in ``states`` that finished before ``cutoff`` (Unix seconds)."""
        states = list(states)
        marks = ",".join("?" * len(states))
        return [
            r[0]
            for r in self.c.conn.execute(
                f"SELECT job_id FROM jobs WHERE state IN ({marks}) AND finished_at < ? LIMIT ?",
                [*states, iso(cutoff), limit],
            )
        ]


def _filters(
    state: str | None,
    kind: str | None,
    batch_id: str | None,
    lock_key: str | None,
    submitted_by: tuple[str | None] | None,
    input_contains: str | None,
) -> tuple[list[str], list[Any]]:
    """The WHERE terms and their arguments of a job listing."""
    where: list[str] = []
    args: list[Any] = []
    if submitted_by is not None:
        where.append("submitted_by IS ?")
        args.append(submitted_by[0])
    for col, val in (("state", state), ("kind", kind), ("batch_id", batch_id), ("lock_key", lock_key)):
        if val is not None:
            where.append(f"{col} = ?")
            args.append(val)
    if input_contains:
        # instr(), not LIKE: LIKE reads its pattern as a C string, so a NUL ended the pattern
        # there ("%\0x%" matched every job), and % and _ are wildcards. instr() compares bytes
        # by length, and lower() folds ASCII letters only, as LIKE did.
        where.append("instr(lower(input), lower(?)) > 0")
        args.append(input_contains)
    return where, args
