"""Kept chunks: the finished parts of a long job, kept so that its next attempt resumes after
them (docs/topics.md, "Long jobs resume"; ``transcribe`` keeps one row per chunk of audio).

A row is written in the same group commit as the turn that received it, so it is durable before
the progress that reports it is published. A job's rows go when it reaches a final state, and
with the job (``purge``, retention).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import orjson

from .connection import Connection

#: Highest chunk index kept: 100,000 chunks of the shortest 5 s are 139 hours of audio.
MAX_CHUNK_INDEX = 100_000
#: Largest chunk kept, as JSON: a 30-minute chunk with word times is about 0.6 MB.
MAX_CHUNK_BYTES = 4 * 1024 * 1024
#: Most bytes of kept chunks one job holds, as JSON: 1 hour of speech in 120-s chunks with word
#: times is about 1.2 MB, so this is over 50 hours. A node holding a job's lease cannot fill the
#: hub's disk with chunks of it: over this, a chunk is not kept (it is decoded again on resume).
MAX_JOB_CHUNK_BYTES = 64 * 1024 * 1024
#: Most bytes of kept chunks all jobs hold together, as JSON: four jobs at the bound of each. Eight
#: nodes' jobs (or forged chunks of a node holding eight) cannot take the store past it; over it,
#: a chunk is not kept, and the job goes on (docs/topics.md, "Long jobs resume").
MAX_ALL_CHUNK_BYTES = 4 * MAX_JOB_CHUNK_BYTES


def create_chunks_table(c: Connection) -> None:
    """``job_chunks``: one row per kept chunk: the attempt that made it, its index from 0 and
    its data (JSON, as the kind gave it)."""
    c.conn.execute(
        "CREATE TABLE IF NOT EXISTS job_chunks (job_id TEXT NOT NULL, idx INTEGER NOT NULL, "
        "attempt INTEGER NOT NULL, data BLOB NOT NULL, PRIMARY KEY (job_id, idx))"
    )


class Chunks:
    """The ``job_chunks`` table, and the bytes each job's rows hold, by index (held in memory,
    so a job without kept chunks costs no statement when it ends, and the bounds cost none)."""

    def __init__(self, c: Connection) -> None:
        self.c = c
        #: job id -> chunk index -> bytes of its data; a rolled-back row stays counted until the
        #: job's rows are dropped (the bounds err on the side of keeping less)
        self.sizes: dict[str, dict[int, int]] = {}
        for job_id, idx, size in c.conn.execute("SELECT job_id, idx, length(data) FROM job_chunks"):
            self.sizes.setdefault(job_id, {})[idx] = size
        self.total = sum(sum(s.values()) for s in self.sizes.values())

    def keep(
        self,
        job_id: str,
        attempt: int,
        index: int,
        data: dict[str, Any],
        room: Callable[[int], str | None] | None = None,
    ) -> None:
        """Keep chunk ``index`` of ``job_id`` (replacing a row of the same index). One
        statement: atomic by itself, and part of the group commit when one is open. Raises
        ``TypeError`` (nothing written) for data that is not JSON, ``ValueError`` for an index
        outside 0..:data:`MAX_CHUNK_INDEX`, data over :data:`MAX_CHUNK_BYTES`, a job's chunks
        over :data:`MAX_JOB_CHUNK_BYTES` or all jobs' over :data:`MAX_ALL_CHUNK_BYTES`, or when
        ``room(bytes)`` (the disk guard) says why there is no room for it."""
        if not 0 <= index <= MAX_CHUNK_INDEX:
            shown = index if abs(index) < 10**12 else "out of range"
            raise ValueError(f"chunk index {shown} is not 0-{MAX_CHUNK_INDEX}")
        raw = orjson.dumps(data)
        if len(raw) > MAX_CHUNK_BYTES:
            raise ValueError(f"chunk {index} holds {len(raw):,} bytes, over {MAX_CHUNK_BYTES:,}")
        sizes = self.sizes.get(job_id, {})
        grows = len(raw) - sizes.get(index, 0)
        if sum(sizes.values()) + grows > MAX_JOB_CHUNK_BYTES:
            raise ValueError(
                f"the job's kept chunks would hold {sum(sizes.values()) + grows:,} bytes, over {MAX_JOB_CHUNK_BYTES:,}"
            )
        if self.total + grows > MAX_ALL_CHUNK_BYTES:
            raise ValueError(
                f"all jobs' kept chunks would hold {self.total + grows:,} bytes, over {MAX_ALL_CHUNK_BYTES:,}"
            )
        if room is not None and (why := room(len(raw))) is not None:
            raise ValueError(why)
        sql = (
            "INSERT INTO job_chunks (job_id, idx, attempt, data) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (job_id, idx) DO UPDATE SET attempt = excluded.attempt, data = excluded.data"
        )
        args = [job_id, index, attempt, raw]
        if self.c.group_depth:
            self.c.conn.execute(sql, args)
        else:
            with self.c.immediate():
                self.c.conn.execute(sql, args)
        self.sizes.setdefault(job_id, {})[index] = len(raw)
        self.total += grows

    def kept(self, job_id: str) -> list[dict[str, Any]]:
        """The kept chunks of ``job_id`` in index order: ``{"index", "attempt", "data"}``."""
        if job_id not in self.sizes:
            return []
        rows = self.c.conn.execute(
            "SELECT idx, attempt, data FROM job_chunks WHERE job_id = ? ORDER BY idx", [job_id]
        ).fetchall()
        return [{"index": i, "attempt": a, "data": orjson.loads(d)} for i, a, d in rows]

    def forget(self, job_ids: Iterable[str]) -> None:
        """The rows of ``job_ids`` were deleted with their jobs: stop counting them."""
        for job_id in job_ids:
            self.total -= sum(self.sizes.pop(job_id, {}).values())

    def drop(self, job_ids: Iterable[str]) -> None:
        """Delete the kept chunks of ``job_ids`` (no statement for jobs that hold none)."""
        gone = [j for j in job_ids if j in self.sizes]
        if not gone:
            return
        sql = "DELETE FROM job_chunks WHERE job_id = ?"
        if self.c.group_depth:
            self.c.conn.executemany(sql, [[j] for j in gone])
        else:
            with self.c.immediate():
                self.c.conn.executemany(sql, [[j] for j in gone])
        self.forget(gone)
