"""The event log (``job_events``): one row per state change, ids never reused, read by the
``events`` cursor (docs/topics.md, ``events``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from edge_queue.rules.states import JobState, is_terminal

from .connection import Connection


class EventLog:
    """Reads the event log (its rows are written with each change, by the room that makes it)."""

    def __init__(self, c: Connection) -> None:
        self.c = c

    def events(self, job_id: str) -> list[dict[str, Any]]:
        """The event log of one job, oldest first."""
        return list(self.c.db.query("SELECT * FROM job_events WHERE job_id = ? ORDER BY id", [job_id]))

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
        rows = self.c.conn.execute(
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
        oldest = self.c.conn.execute("SELECT min(id) FROM job_events").fetchone()[0]
        deleted = self.c.conn.execute("SELECT value FROM store_meta WHERE key = 'events_deleted_upto'").fetchone()
        return events, oldest, bool(deleted and deleted[0] > after)

    def newest_event_id(self) -> int:
        """The id of the newest event (0 when none)."""
        return int(self.c.conn.execute("SELECT max(id) FROM job_events").fetchone()[0] or 0)
