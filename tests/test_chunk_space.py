"""Kept chunks and the store's space (docs/topics.md, "Long jobs resume"; docs/operations.md,
"The disk is full"): a bound across all jobs, ``limits.min_free_disk_mb`` respected, and the
space of deleted rows given back to the file system, on real store files."""

from __future__ import annotations

import logging
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from edge_queue.jobs.outcomes import Outcomes
from edge_queue.rules.limits import DiskGuard
from edge_queue.store import Store, space
from edge_queue.store.chunks import MAX_ALL_CHUNK_BYTES, MAX_CHUNK_BYTES, MAX_JOB_CHUNK_BYTES
from edge_queue.workers.supervisor import Outcome

from .helpers.store_rows import spec

#: A chunk of about 3 MiB as JSON.
BIG = {"text": "x" * (3 * 2**20)}


def running_jobs(store: Store, n: int) -> list[str]:
    """``n`` jobs claimed (running, attempt 1)."""
    store.submit([spec(f"/m/{i}.wav", kind="transcribe") for i in range(n)], 1.0, as_batch=True)
    return [store.claim(2.0, ["transcribe"], "run")["job_id"] for _ in range(n)]  # type: ignore[index]


def kept_bytes(path: Path) -> int:
    with sqlite3.connect(path) as conn:
        return int(conn.execute("SELECT coalesce(sum(length(data)), 0) FROM job_chunks").fetchone()[0])


def test_kept_chunks_are_bounded_across_all_jobs_not_only_per_job(tmp_path: Path) -> None:
    # Given eight running jobs (a node holding eight), each sending 3 MiB chunks as fast as it can
    store = Store(tmp_path / "q.db", durability="normal")
    jobs = running_jobs(store, 8)
    refused: dict[str, str] = {}
    for job_id in jobs:
        for index in range(30):
            try:
                store.keep_chunk(job_id, 1, index, BIG)
            except ValueError as e:
                refused[job_id] = str(e)
                break
    # Then no job keeps over its bound, all of them together not over the bound across jobs
    # (before: 8 x 64 MiB = 512 MiB could be kept)
    total = kept_bytes(store.path)
    assert MAX_ALL_CHUNK_BYTES - MAX_CHUNK_BYTES < total <= MAX_ALL_CHUNK_BYTES, total
    assert any("all jobs' kept chunks" in why for why in refused.values()), refused
    assert all(len(store.kept_chunks(j)) * len(BIG["text"]) <= MAX_JOB_CHUNK_BYTES for j in jobs)
    # and the bound counts what is in the file, also after a restart
    store.close()
    store = Store(tmp_path / "q.db", durability="normal")
    with pytest.raises(ValueError, match="all jobs' kept chunks"):
        store.keep_chunk(jobs[-1], 1, 29, BIG)
    # and the chunks of ended jobs no longer count: others are kept again
    store.drop_chunks(jobs[:2])
    store.keep_chunk(jobs[-1], 1, 29, BIG)
    assert kept_bytes(store.path) <= MAX_ALL_CHUNK_BYTES


def test_a_chunk_that_would_cross_min_free_disk_mb_is_not_kept_and_the_job_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a running job and a min_free_disk_mb just above what is free on this disk
    store = Store(tmp_path / "q.db", durability="normal")
    (job_id,) = running_jobs(store, 1)
    free_mb = shutil.disk_usage(tmp_path).free / 2**20
    published: list[Any] = []

    class Publisher:
        def publish_job(self, job: dict[str, Any]) -> None:
            published.append(job)

    outcomes = Outcomes(
        lambda: store,
        Publisher(),  # type: ignore[arg-type]
        DiskGuard(tmp_path, free_mb + 2),
        crash_loop_limit=3,
        backoff=lambda attempt: 1.0,
    )
    # When it sends 50 chunks
    with caplog.at_level(logging.WARNING, logger="edge_queue.jobs.outcomes"):
        for index in range(50):
            outcomes.keep_chunk(Outcome("chunk", job_id, 1, {"index": index, "data": {"text": "words"}}))
    # Then none is kept, the job still runs, and the refusals are logged at a bounded rate
    assert store.kept_chunks(job_id) == []
    assert store.get(job_id)["state"] == "running"
    lines = [r.getMessage() for r in caplog.records]
    assert lines and "limits.min_free_disk_mb" in lines[0], lines
    assert len(lines) <= 20, len(lines)
    # while with room on the disk it is kept
    outcomes.disk = DiskGuard(tmp_path, 1)
    outcomes.keep_chunk(Outcome("chunk", job_id, 1, {"index": 0, "data": {"text": "words"}}))
    assert [c["index"] for c in store.kept_chunks(job_id)] == [0]


def test_the_store_gives_back_the_space_of_deleted_chunks(tmp_path: Path) -> None:
    # Given a new store that held 96 MiB of kept chunks of jobs that then ended
    store = Store(tmp_path / "q.db", durability="normal")
    assert space.incremental(store.connection)
    jobs = running_jobs(store, 2)
    for job_id in jobs:
        for index in range(16):
            store.keep_chunk(job_id, 1, index, BIG)
    store.shrink_wal()
    held = store.path.stat().st_size
    assert held > 90 * 2**20
    store.drop_chunks(jobs)
    # When the service gives space back, a bounded piece at a time
    calls = 0
    while store.give_back_space():
        calls += 1
        store.shrink_wal()
        assert calls < 100
    store.shrink_wal()
    # Then the file is small again (before: the free pages stayed in the file for good)
    assert store.path.stat().st_size < 8 * 2**20, store.path.stat().st_size
    assert calls >= 96 * 2**20 // (space.GIVE_BACK_PAGES * 4096)  # in pieces, not one long pause


def test_a_store_of_an_earlier_release_is_converted_when_opened(tmp_path: Path) -> None:
    # Given a store made without incremental auto-vacuum (as every earlier release made them)
    path = tmp_path / "q.db"
    store = Store(path, durability="normal")
    jobs = running_jobs(store, 1)
    store.keep_chunk(jobs[0], 1, 0, BIG)
    store.close()
    with sqlite3.connect(path) as raw:
        raw.execute("PRAGMA auto_vacuum = NONE")
        raw.execute("VACUUM")
        assert raw.execute("PRAGMA auto_vacuum").fetchone()[0] == 0
    # When the service opens it, it is converted, and keeps its rows
    store = Store(path, durability="normal")
    assert space.incremental(store.connection)
    assert len(store.kept_chunks(jobs[0])) == 1 and store.get(jobs[0])["state"] == "running"


@pytest.fixture
def small_disk(tmp_path: Path) -> Any:
    """A 64 MiB file system of its own (tmpfs, mounted as root), unmounted after the test."""
    import os
    import subprocess

    from .conftest import need

    where = tmp_path / "small-disk"
    where.mkdir()
    mounted = os.geteuid() == 0 and (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(where)], capture_output=True).returncode
        == 0
    )
    need(mounted, "cannot mount a 64 MiB tmpfs (needs root and CAP_SYS_ADMIN)")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False, capture_output=True)


def test_on_a_small_disk_chunks_stop_at_min_free_disk_mb_and_the_space_comes_back(small_disk: Path) -> None:
    # Given a store on a 64 MiB file system with limits.min_free_disk_mb = 16, and two running
    # jobs whose node sends 3 MiB chunks as fast as it can (before: the store took the disk to
    # 0 bytes free, stuck on disk_full, and kept the space after the jobs ended)
    store = Store(small_disk / "q.db", durability="normal")
    jobs = running_jobs(store, 2)

    class Publisher:
        def publish_job(self, job: dict[str, Any]) -> None:
            pass

    outcomes = Outcomes(
        lambda: store,
        Publisher(),  # type: ignore[arg-type]
        DiskGuard(small_disk, 16),
        crash_loop_limit=3,
        backoff=lambda attempt: 1.0,
    )
    lowest = shutil.disk_usage(small_disk).free
    for index in range(20):
        for job_id in jobs:
            outcomes.keep_chunk(Outcome("chunk", job_id, 1, {"index": index, "data": BIG}))
            lowest = min(lowest, shutil.disk_usage(small_disk).free)
    # Then chunks were kept until the limit, none past it: the disk kept its 16 MiB
    kept = sum(len(store.kept_chunks(j)) for j in jobs)
    assert 4 <= kept < 40, kept
    assert lowest >= 10 * 2**20, lowest  # the limit, less the write-ahead log's share
    assert store.get(jobs[0])["state"] == "running"
    # When the jobs end, the store gives the space back, and new work is accepted again
    store.drop_chunks(jobs)
    while store.give_back_space():
        store.shrink_wal()
    store.shrink_wal()
    # (the store and at most 8 MiB of write-ahead log stay: WAL_LIMIT_BYTES)
    assert shutil.disk_usage(small_disk).free > 48 * 2**20, shutil.disk_usage(small_disk).free
    assert DiskGuard(small_disk, 16).why_full(jobs=1) is None
    store.close()
