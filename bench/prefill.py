"""Stores pre-filled with N terminal noop jobs, built in-process with edge_queue.store.Store.

The jobs are created with ``Store.submit`` (1,000 per transaction, durability normal) and
then marked ``succeeded`` with one UPDATE: a store holding a week of finished work, which the
service republishes (retained) at start and keeps until retention ends.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from edge_queue.store import JobSpec, Store, iso

_CACHE: dict[tuple[str, int], Path] = {}


def build(n: int, root: Path) -> Path:
    """A database file with ``n`` succeeded noop jobs (cached per invocation)."""
    if (str(root), n) in _CACHE:
        return _CACHE[(str(root), n)]
    path = root / f"prefill-{n}" / "edge-queue.db"
    store = Store(path, "normal")
    now = time.time()
    for start in range(0, n, 1000):
        specs = [JobSpec("noop", f"pre{i}", {}) for i in range(start, min(n, start + 1000))]
        store.submit(specs, now)
    at = iso(now)
    store.conn.execute(
        "UPDATE jobs SET state = 'succeeded', attempt = 1, seq = 3, started_at = ?, finished_at = ?, "
        "updated_at = ?, result = ?",
        [at, at, at, '{"slept_s": 0.0}'],
    )
    store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    _CACHE[(str(root), n)] = path
    return path


def data_dir_with(n: int, root: Path, dest: Path) -> Path:
    """A fresh data dir ``dest`` holding a copy of the ``n``-job store."""
    dest.mkdir(parents=True, exist_ok=True)
    if n:
        shutil.copy(build(n, root), dest / "edge-queue.db")
    return dest
