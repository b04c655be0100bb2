"""A job store's rows for tests: a job spec to submit, and how many chunks the store keeps for a job."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from edge_queue.store import JobSpec


def spec(input_: str = "/m/a.wav", kind: str = "noop", **kw) -> JobSpec:
    return JobSpec(kind=kind, input=input_, options=kw.pop("options", {}), **kw)


def kept_chunks(db: Path, job_id: str) -> int:
    conn = sqlite3.connect(db, timeout=5)
    try:
        return int(conn.execute("SELECT count(*) FROM job_chunks WHERE job_id = ?", [job_id]).fetchone()[0])
    finally:
        conn.close()
