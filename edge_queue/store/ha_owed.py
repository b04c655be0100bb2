"""Finished runs not yet known notified to Home Assistant (``ha_owed``): one row per ``end``
event, written in the transaction that ends the job, deleted once the broker says the message
carrying it reached a subscriber (:mod:`edge_queue.rules.ha_delivery`). At most
:data:`~edge_queue.rules.ha_delivery.OWED_MAX` rows; the oldest beyond are dropped and counted
(``store_meta`` key ``ha_owed_dropped``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from edge_queue.rules.ha_delivery import OWED_MAX

from .connection import Connection

#: The event cursor an earlier edge-queue kept while Home Assistant was offline (converted).
OLD_CURSOR_KEY = "ha_offline_after"
DROPPED_KEY = "ha_owed_dropped"


def create_ha_owed_table(c: Connection) -> None:
    """``ha_owed``: ``event_id`` (the ``end`` event), ``job_id``, ``state``, ``finished_at``;
    and, once, the end events after an earlier edge-queue's offline cursor."""
    c.conn.execute(
        "CREATE TABLE IF NOT EXISTS ha_owed (event_id INTEGER PRIMARY KEY, job_id TEXT NOT NULL, "
        "state TEXT NOT NULL, finished_at TEXT)"
    )
    row = c.conn.execute("SELECT value FROM store_meta WHERE key = ?", [OLD_CURSOR_KEY]).fetchone()
    if row is not None:
        with c.immediate():
            if int(row[0]) >= 0:
                c.conn.execute(
                    "INSERT OR IGNORE INTO ha_owed (event_id, job_id, state, finished_at) "
                    "SELECT e.id, e.job_id, e.to_state, j.finished_at FROM job_events e JOIN jobs j USING (job_id) "
                    "WHERE e.id > ? AND e.from_state IS NOT NULL "
                    "AND e.to_state IN ('succeeded','failed','cancelled') ORDER BY e.id DESC LIMIT ?",
                    [int(row[0]), OWED_MAX],
                )
            c.conn.execute("DELETE FROM store_meta WHERE key = ?", [OLD_CURSOR_KEY])


OWE = "INSERT OR REPLACE INTO ha_owed (event_id, job_id, state, finished_at) VALUES (?, ?, ?, ?)"


class HaOwed:
    """The ``ha_owed`` table."""

    def __init__(self, c: Connection) -> None:
        self.c = c

    def owe(self, event_id: int, job_id: str, state: str, finished_at: str | None) -> None:
        """A run ended (inside the turn's group: the same transaction as its end; written with
        the group's deferred rows, one statement for the turn's ends)."""
        row = (event_id, job_id, state, finished_at)
        if self.c.group_depth == 1:
            self.c.defer(OWE, row)
        else:
            self._write(OWE, [row])

    def delivered(self, event_ids: Iterable[int]) -> None:
        """Runs that reached Home Assistant: no longer owed."""
        ids = [[i] for i in event_ids]
        if ids:
            self._write("DELETE FROM ha_owed WHERE event_id = ?", ids)

    def owed(self) -> tuple[list[dict[str, Any]], int]:
        """The owed runs, oldest first, at most ``OWED_MAX`` (the older ones are deleted here),
        and how many were dropped so far; the dropped count is cleared with the last row."""
        rows = self.c.conn.execute(
            "SELECT event_id, job_id, state, finished_at FROM ha_owed ORDER BY event_id DESC LIMIT ?", [OWED_MAX + 1]
        ).fetchall()
        dropped = int(self._meta() or 0)
        if len(rows) > OWED_MAX:
            cut = rows[OWED_MAX - 1][0]
            gone = self.c.conn.execute("SELECT count(*) FROM ha_owed WHERE event_id < ?", [cut]).fetchone()[0]
            self._write("DELETE FROM ha_owed WHERE event_id < ?", [[cut]])
            dropped += int(gone)
            self._write(
                "INSERT INTO store_meta (key, value) VALUES (?, ?) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                [[DROPPED_KEY, dropped]],
            )
            rows = rows[:OWED_MAX]
        keys = ("event_id", "job_id", "state", "finished_at")
        return [dict(zip(keys, r, strict=True)) for r in reversed(rows)], dropped

    def forget_dropped(self) -> None:
        """The dropped count was reported (in a summary Home Assistant got)."""
        self._write("DELETE FROM store_meta WHERE key = ?", [[DROPPED_KEY]])

    def _meta(self) -> int | None:
        row = self.c.conn.execute("SELECT value FROM store_meta WHERE key = ?", [DROPPED_KEY]).fetchone()
        return None if row is None else int(row[0])

    def _write(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        if self.c.group_depth:
            self.c.conn.executemany(sql, rows)
        else:
            with self.c.immediate():
                self.c.conn.executemany(sql, rows)
