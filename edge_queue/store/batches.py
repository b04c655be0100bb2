"""Batches: the jobs of one submit of several inputs, with counts per state."""

from __future__ import annotations

from typing import Any

from edge_queue.errors import NotFoundError
from edge_queue.rules.states import JobState, is_terminal

from .connection import Connection


class Batches:
    """The ``batches`` table."""

    def __init__(self, c: Connection) -> None:
        self.c = c

    def batch_ids_in(self, batch_ids: list[str]) -> set[str]:
        """The subset of ``batch_ids`` that the store knows."""
        marks = ",".join("?" * len(batch_ids))
        return {
            r[0] for r in self.c.conn.execute(f"SELECT batch_id FROM batches WHERE batch_id IN ({marks})", batch_ids)
        }

    def batch(self, batch_id: str) -> dict[str, Any]:
        """The batch with ``counts`` per state, ``job_ids`` and ``done``. Raises NotFoundError."""
        rows = list(self.c.db.query("SELECT * FROM batches WHERE batch_id = ?", [batch_id]))
        if not rows:
            raise NotFoundError(f"no batch {batch_id!r}")
        batch = rows[0]
        counts = {s.value: 0 for s in JobState}
        ids = []
        for job_id, state, updated_at in self.c.conn.execute(
            "SELECT job_id, state, updated_at FROM jobs WHERE batch_id = ? ORDER BY job_id", [batch_id]
        ):
            counts[state] += 1
            ids.append(job_id)
            batch["updated_at"] = max(batch["updated_at"], updated_at)
        batch["counts"] = counts
        batch["job_ids"] = ids
        batch["done"] = all(is_terminal(s) for s in counts if counts[s]) and bool(ids)
        return batch

    def batch_id_page(self, after: str, limit: int) -> list[str]:
        """Up to ``limit`` batch ids greater than ``after``, in order."""
        return [
            r[0]
            for r in self.c.conn.execute(
                "SELECT batch_id FROM batches WHERE batch_id > ? ORDER BY batch_id LIMIT ?", [after, limit]
            )
        ]
