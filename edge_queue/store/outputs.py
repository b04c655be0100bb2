"""The files a job's workers wrote (``job_outputs``): one row per output path, with the identity
of the file written there (:func:`edge_queue.written.identity`: size and SHA-256) and the attempt
that wrote it.

A worker reports its files before it moves them into place, and waits until the row is committed
(docs/topics.md, "Where outputs go"): so a later attempt of the same job knows its own files from
anyone else's, and ``get`` reads an output only while it is still the file written. The rows stay
after the job ends and go with the job (``purge``, retention).
"""

from __future__ import annotations

from typing import Any

from .connection import Connection

#: Most output files one job records: a transcription writes 4.
MAX_JOB_OUTPUTS = 16


def create_outputs_table(c: Connection) -> None:
    """``job_outputs``: ``(job_id, path)``, the attempt that wrote it, its size and SHA-256."""
    c.conn.execute(
        "CREATE TABLE IF NOT EXISTS job_outputs (job_id TEXT NOT NULL, path TEXT NOT NULL, attempt INTEGER NOT NULL, "
        "size INTEGER NOT NULL, sha256 TEXT NOT NULL, PRIMARY KEY (job_id, path))"
    )


class OutputFiles:
    """The ``job_outputs`` table."""

    def __init__(self, c: Connection) -> None:
        self.c = c

    def record(self, job_id: str, attempt: int, files: dict[str, dict[str, Any]]) -> None:
        """Record ``files`` (path -> identity) as written by ``attempt`` of ``job_id``, replacing
        what an earlier attempt recorded for the same paths. Raises ``ValueError`` (nothing
        written) past :data:`MAX_JOB_OUTPUTS` paths for the job."""
        known = set(self.of(job_id))
        if len(known | set(files)) > MAX_JOB_OUTPUTS:
            raise ValueError(f"a job records at most {MAX_JOB_OUTPUTS} output files")
        sql = (
            "INSERT INTO job_outputs (job_id, path, attempt, size, sha256) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT (job_id, path) DO UPDATE SET attempt = excluded.attempt, size = excluded.size, "
            "sha256 = excluded.sha256"
        )
        rows = [[job_id, path, attempt, ident["size"], ident["sha256"]] for path, ident in files.items()]
        if self.c.group_depth:
            self.c.conn.executemany(sql, rows)
        else:
            with self.c.immediate():
                self.c.conn.executemany(sql, rows)

    def of(self, job_id: str) -> dict[str, dict[str, Any]]:
        """The files recorded for ``job_id``: path -> ``{"size", "sha256", "attempt"}``."""
        rows = self.c.conn.execute(
            "SELECT path, attempt, size, sha256 FROM job_outputs WHERE job_id = ?", [job_id]
        ).fetchall()
        return {p: {"size": s, "sha256": h, "attempt": a} for p, a, s, h in rows}
