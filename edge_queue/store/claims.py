"""Claims: due jobs moved to ``running`` in claim order (priority, then age), and the
outcomes stored at once on the hot path (``succeed_many``, ``mark_started_many``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from edge_queue.rules.states import JobState

from .connection import Connection
from .ids import iso
from .rows import LOCK_HEAD, decode_row, deferred_job_row, json_text


class Claims:
    """Moves due jobs to ``running`` and running jobs to ``succeeded``, many at once."""

    def __init__(self, c: Connection) -> None:
        self.c = c

    def claim(
        self, now: float, kinds: Iterable[str], owner: str, *, exclude: Sequence[str] = ()
    ) -> dict[str, Any] | None:
        """Move the next due job of one of ``kinds`` to ``running`` and return it, or ``None``.

        Order: highest ``priority``, then oldest. Due: ``queued`` with ``run_at`` unset or
        past, or ``retrying`` with ``retry_at`` past. ``attempt`` is incremented; ``owner``
        (the service's per-start run id, or ``node:<id>``) marks whose attempt it is. Jobs in
        ``exclude`` are passed over (a worker node that could not read their input).
        """
        kinds = list(kinds)
        job = self.claim_deferred(now, kinds, owner)  # new submits: never in ``exclude``
        if job is not None:
            return job
        jobs = self.claim_many(now, kinds, owner, 1, exclude=exclude)
        return jobs[0] if jobs else None

    def claim_deferred(self, now: float, kinds: Sequence[str], owner: str) -> dict[str, Any] | None:
        """:meth:`claim` of a job submitted in this group and not written yet (an idle service's
        new job): its row and its ``running`` event are changed before they are written, instead
        of being written ``queued`` and then found and updated (P2's idle submit).

        Taken only when every waiting job of the store is one of the group's deferred submits
        (none has a lock key; ``retrying`` is empty): then the head of the claim order among
        them is the head of the store, and the result is the one of :meth:`claim_many`: the
        same order (highest ``priority``, then oldest, then ``job_id``), the same due rule,
        the same row and event. ``None``: not taken here (no deferred job is the head, or none
        is due); the caller then claims with :meth:`claim_many`."""
        if not self.c.deferred_jobs:
            return None
        counts = self.c.counts
        if counts["retrying"] or counts["queued"] != sum(1 for row in self.c.deferred_jobs if row[6] == "queued"):
            return None
        at = iso(now)
        head: tuple[int, str, str] | None = None
        pick = -1
        for i, row in enumerate(self.c.deferred_jobs):
            # columns of INSERT_JOB: job_id 0, kind 2, priority 5, state 6, run_at 11, created_at 14
            if row[6] != "queued" or row[2] not in kinds or (row[11] or "") > at:
                continue
            rank = (-row[5], row[14], row[0])
            if head is None or rank < head:
                head, pick = rank, i
        if head is None:
            return None
        row = self.c.deferred_jobs[pick]
        key = (row[9], row[12])
        job = dict(self.c.deferred_dedupe[key])
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
        self.c.deferred_jobs[pick] = deferred_job_row(job)
        self.c.deferred_dedupe[key] = job
        event_id = self.c.next_event_id
        self.c.next_event_id += 1
        self.c.deferred_events.append(
            (event_id, job["job_id"], at, JobState.QUEUED.value, job["state"], job["attempt"])
        )
        counts["queued"] -= 1
        counts["running"] += 1
        claimed = decode_row(dict(job))
        claimed["event_id"] = event_id
        return claimed

    def claim_many(
        self,
        now: float,
        kinds: Iterable[str],
        owner: str,
        n: int,
        *,
        started: bool = True,
        exclude: Sequence[str] = (),
    ) -> list[dict[str, Any]]:
        """:meth:`claim` up to ``n`` jobs at once, in claim order (one query per state).

        ``started=False`` claims jobs for a worker's queue: ``started_at`` stays null until
        :meth:`mark_started_many`, so that a service death before the worker got to them does not
        count their attempt (:meth:`.Jobs.orphans`)."""
        kinds = list(kinds)
        if not kinds or n < 1:
            return []
        at = iso(now)
        marks = ",".join("?" * len(kinds))
        skip = f" AND job_id NOT IN ({','.join('?' * len(exclude))})" if exclude else ""
        with self.c.immediate():
            # One query per state that has jobs, each walking the claim index in priority
            # order; the better heads of the two win.
            heads = [
                h
                for state, due in (("queued", "coalesce(run_at, '') <= ?"), ("retrying", "retry_at <= ?"))
                if self.c.counts[state]
                for h in self.c.conn.execute(
                    f"SELECT job_id, state, priority, created_at FROM jobs INDEXED BY jobs_claim "
                    f"WHERE state = ? AND kind IN ({marks}) AND {due} AND {LOCK_HEAD}{skip} "
                    "ORDER BY priority DESC, created_at, job_id LIMIT ?",
                    [state, *kinds, at, *exclude, n],
                )
            ]
            heads.sort(key=lambda h: (-h[2], h[3], h[0]))
            heads = heads[:n]
            if not heads:
                return []
            # one statement for all of them; RETURNING gives no order, so rows are put back in
            # claim order
            cur = self.c.conn.execute(
                "UPDATE jobs SET state = 'running', attempt = attempt + 1, seq = seq + 1, "
                "owner = ?, started_at = ?, updated_at = ?, retry_at = NULL, stage = NULL, "
                f"progress = 0, eta_s = NULL WHERE job_id IN ({','.join('?' * len(heads))}) RETURNING *",
                [owner, at if started else None, at, *(h[0] for h in heads)],
            )
            names = [d[0] for d in cur.description]
            by_id = {r["job_id"]: r for r in (dict(zip(names, row, strict=True)) for row in cur.fetchall())}
            jobs = [decode_row(by_id[h[0]]) for h in heads]
            for _, src, _, _ in heads:
                self.c.counts[src] -= 1
                self.c.counts["running"] += 1
            rows = [(j["job_id"], at, src, j["attempt"]) for j, (_, src, _, _) in zip(jobs, heads, strict=False)]
            sql = (
                "INSERT INTO job_events (job_id, at, from_state, to_state, attempt, detail) "
                "VALUES (?, ?, ?, 'running', ?, NULL)"
            )
            event_ids: Iterable[int | None]
            if len(rows) == 1:  # one job (an idle service's claim): its id without another query
                event_ids = [self.c.conn.execute(sql, rows[0]).lastrowid]
            else:
                self.c.conn.executemany(sql, rows)
                event_ids = self.c.last_event_ids(len(rows))
            for job, event_id in zip(jobs, event_ids, strict=True):
                job["event_id"] = event_id
        return jobs

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
        with self.c.immediate():
            for i in range(0, len(reports), 500):
                part = reports[i : i + 500]
                args: list[Any] = [at, at, at]
                for job_id, attempt, result in part:
                    args += (job_id, attempt, json_text(result) if result is not None else None, job_id in started)
                cur = self.c.conn.execute(
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
                    job = decode_row(dict(zip(names, row, strict=True)))
                    done[job["job_id"]] = job
            if done:
                ordered = [(job_id, attempt) for job_id, attempt, _ in reports if job_id in done]
                self.c.conn.executemany(
                    "INSERT INTO job_events (job_id, at, from_state, to_state, attempt, detail) "
                    "VALUES (?, ?, 'running', 'succeeded', ?, NULL)",
                    [(job_id, at, attempt) for job_id, attempt in ordered],
                )
                for (job_id, _), event_id in zip(ordered, self.c.last_event_ids(len(ordered)), strict=True):
                    done[job_id]["event_id"] = event_id
                self.c.counts["running"] -= len(done)
                self.c.counts["succeeded"] += len(done)
        return done

    def mark_started_many(self, starts: Sequence[tuple[str, int]], now: float) -> None:
        """Record that workers started these ``(job_id, attempt)`` from their queues (jobs
        claimed with ``started=False``): ``started_at`` is set where still unset."""
        if starts:
            at = iso(now)
            self.c.conn.executemany(
                "UPDATE jobs SET started_at = ? WHERE job_id = ? AND attempt = ? AND started_at IS NULL",
                [(at, job_id, attempt) for job_id, attempt in starts],
            )
