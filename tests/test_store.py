"""The store on real SQLite files: submit, idempotency, dedupe, claim order, transitions, fencing."""

from __future__ import annotations

import os
import sqlite3
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_queue.errors import NotFoundError, TransitionError
from edge_queue.rules.states import TRANSITIONS, JobState, can_transition, is_terminal
from edge_queue.store import SCHEMA_VERSION, JobSpec, Store, iso, new_id, parse_iso

from .helpers.store_rows import spec


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "q.db")


def test_pragmas_wal_and_full_sync(tmp_path: Path) -> None:
    s = Store(tmp_path / "q.db")
    assert s.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert s.conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    n = Store(tmp_path / "n.db", durability="normal")
    assert n.conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
    assert s.integrity_check() == "ok"


def test_submit_commits_job_and_event(store: Store, tmp_path: Path) -> None:
    batch_id, created = store.submit([spec()], 1000.0)
    assert batch_id is None and not created[0].duplicate
    job = created[0].job
    assert job["state"] == "queued" and job["seq"] == 1 and job["attempt"] == 0
    # visible from another connection: committed
    other = sqlite3.connect(tmp_path / "q.db")
    assert other.execute("SELECT state FROM jobs WHERE job_id = ?", [job["job_id"]]).fetchone() == ("queued",)
    assert [e["to_state"] for e in store.events(job["job_id"])] == ["queued"]


def test_idempotency_key_returns_first_jobs(store: Store) -> None:
    b1, first = store.submit([spec("/m/a"), spec("/m/b")], 1.0, idempotency_key="k1", as_batch=True)
    b2, again = store.submit([spec("/m/a"), spec("/m/b")], 2.0, idempotency_key="k1", as_batch=True)
    assert b1 == b2 and b1 is not None
    assert [c.job["job_id"] for c in first] == [c.job["job_id"] for c in again]
    assert all(c.duplicate for c in again)
    assert store.counts()["queued"] == 2
    assert store.batch(b1)["total"] == 2


def test_equal_active_job_is_deduplicated_until_terminal(store: Store) -> None:
    _, (a,) = store.submit([spec(options={"sleep_s": 1})], 1.0)
    _, (b,) = store.submit([spec(options={"sleep_s": 1})], 2.0)
    _, (c,) = store.submit([spec(options={"sleep_s": 2})], 3.0)
    assert b.duplicate and b.job["job_id"] == a.job["job_id"]
    assert not c.duplicate
    store.transition(a.job["job_id"], JobState.CANCELLED, 4.0)
    _, (d,) = store.submit([spec(options={"sleep_s": 1})], 5.0)
    assert not d.duplicate


def test_a_job_back_in_the_queue_is_not_finished(store: Store) -> None:
    # a cancelled job retried by hand, then claimed and put back by a graceful stop (before: it
    # kept the cancel's finished_at, and the page's detail showed "Finished" for a queued job)
    _, (c,) = store.submit([spec()], 1.0)
    job_id = c.job["job_id"]
    store.transition(job_id, JobState.CANCELLED, 2.0)
    assert store.get(job_id)["finished_at"] is not None
    store.transition(job_id, JobState.QUEUED, 3.0)
    assert store.get(job_id)["finished_at"] is None
    store.claim(4.0, ["noop"], "r")
    store.transition(job_id, JobState.RETRYING, 5.0, retry_at=6.0)
    assert store.get(job_id)["finished_at"] is None


def test_claim_order_priority_then_age_and_kinds(store: Store) -> None:
    _, (old,) = store.submit([spec("/1")], 1.0)
    _, (new,) = store.submit([spec("/2")], 2.0)
    _, (urgent,) = store.submit([spec("/3", priority=5)], 3.0)
    _, (other,) = store.submit([spec("/4", kind="probe", priority=9)], 4.0)
    got = [store.claim(10.0, ["noop"], "run1")["job_id"] for _ in range(3)]
    assert got == [urgent.job["job_id"], old.job["job_id"], new.job["job_id"]]
    assert store.claim(10.0, ["noop"], "run1") is None
    claimed = store.claim(10.0, ["noop", "probe"], "run1")
    assert claimed["job_id"] == other.job["job_id"] and claimed["attempt"] == 1 and claimed["owner"] == "run1"


def test_run_at_and_retry_at_delay_claims(store: Store) -> None:
    store.submit([spec("/later", run_at=100.0)], 1.0)
    assert store.claim(99.0, ["noop"], "r") is None
    assert store.next_due() == pytest.approx(100.0, abs=0.001)
    assert store.next_due(after=99.0) == pytest.approx(100.0, abs=0.001)
    assert store.next_due(after=100.0) is None  # due already: waits for a worker, not a time
    job = store.claim(100.0, ["noop"], "r")
    store.transition(job["job_id"], JobState.RETRYING, 101.0, retry_at=150.0)
    assert store.claim(149.0, ["noop"], "r") is None
    again = store.claim(150.0, ["noop"], "r")
    assert again["attempt"] == 2 and again["retry_at"] is None


def test_transition_table_enforced_and_fenced(store: Store) -> None:
    _, (c,) = store.submit([spec()], 1.0)
    job_id = c.job["job_id"]
    with pytest.raises(TransitionError):
        store.transition(job_id, JobState.SUCCEEDED, 2.0)  # queued -> succeeded is not allowed
    store.claim(2.0, ["noop"], "r")
    with pytest.raises(TransitionError):
        store.transition(job_id, JobState.SUCCEEDED, 3.0, expect_attempt=7)  # stale attempt
    done = store.transition(job_id, JobState.SUCCEEDED, 3.0, expect_attempt=1, result={"x": 1})
    assert done["result"] == {"x": 1} and done["finished_at"] == iso(3.0) and done["seq"] == 3
    with pytest.raises(TransitionError):
        store.transition(job_id, JobState.RUNNING, 4.0)
    with pytest.raises(NotFoundError):
        store.get("nope")


def test_succeed_many_is_fenced_per_job_and_logs_in_report_order(store: Store) -> None:
    _, created = store.submit([spec(f"/m/{i}") for i in range(5)], 1.0, as_batch=True)
    ids = [c.job["job_id"] for c in created]
    claimed = store.claim_many(2.0, ["noop"], "r", 5, started=False)
    assert [j["job_id"] for j in claimed] == ids and all(j["started_at"] is None for j in claimed)
    store.transition(ids[3], JobState.CANCELLING, 2.5)  # cancelled meanwhile: not a success here
    reports = [(ids[2], 1, {"n": 2}), (ids[0], 1, None), (ids[1], 7, {}), (ids[3], 1, {}), ("nope", 1, {})]
    before = store.counts()
    done = store.succeed_many(reports, 3.0, started=[ids[2]])
    # only the jobs running on the reported attempt succeeded; the rest are left as they were
    assert sorted(done) == sorted([ids[0], ids[2]])
    assert store.get(ids[1])["state"] == "running" and store.get(ids[3])["state"] == "cancelling"
    a, b = done[ids[2]], done[ids[0]]
    assert a["result"] == {"n": 2} and b["result"] is None
    assert a["state"] == b["state"] == "succeeded" and a["finished_at"] == iso(3.0) and a["progress"] == 100.0
    assert a["seq"] == 3 and a["started_at"] == iso(3.0) and b["started_at"] is None  # only the one named
    # the event log has the successes in report order, with the ids the rows carry
    assert a["event_id"] + 1 == b["event_id"]
    assert [e["to_state"] for e in store.events(ids[2])] == ["queued", "running", "succeeded"]
    counts = store.counts()
    assert counts["succeeded"] == before["succeeded"] + 2 and counts["running"] == before["running"] - 2
    assert counts == store.connection.load_counts()


def test_orphans_belong_to_other_runs(store: Store) -> None:
    store.submit([spec("/a"), spec("/b")], 1.0, as_batch=True)
    a = store.claim(2.0, ["noop"], "dead-run")
    b = store.claim(2.0, ["noop"], "this-run")
    assert store.orphans("this-run") == [a["job_id"]]
    assert b["job_id"] not in store.orphans("this-run")


def test_batch_counts_and_done(store: Store) -> None:
    batch_id, created = store.submit([spec("/a"), spec("/b")], 1.0, as_batch=True)
    assert store.batch(batch_id)["counts"]["queued"] == 2 and not store.batch(batch_id)["done"]
    for c in created:
        store.transition(c.job["job_id"], JobState.CANCELLED, 2.0)
    assert store.batch(batch_id)["done"] and store.batch(batch_id)["counts"]["cancelled"] == 2


def test_delete_only_terminal(store: Store) -> None:
    batch_id, (a, b) = store.submit([spec("/a"), spec("/b")], 1.0, as_batch=True)
    store.transition(a.job["job_id"], JobState.CANCELLED, 2.0)
    # a is deleted, b (queued) is not; their batch keeps b
    assert store.delete([a.job["job_id"], b.job["job_id"]]) == ([a.job["job_id"]], [], [batch_id])
    assert store.events(a.job["job_id"]) == []


def test_ids_and_times() -> None:
    same_ms = [new_id(1_800_000_000.0) for _ in range(50)]
    assert same_ms == sorted(same_ms) and len(set(same_ms)) == 50
    ids = [new_id(1_900_000_000 + i) for i in range(50)]
    assert ids == sorted(ids) and all(len(i) == 16 and i.isalnum() and i.islower() for i in ids)
    assert iso(0.5) == "1970-01-01T00:00:00.500Z" and parse_iso(iso(1234.567)) == pytest.approx(1234.567)


def test_ids_made_after_a_restart_sort_after_a_bursts_ids(tmp_path: Path) -> None:
    """A burst runs the time part of ids ahead of the clock (1 ms per id beyond 1,000 a second);
    a process started after it (a restart) still makes ids that sort after every stored one
    (docs/topics.md: ids sort in creation order)."""
    import subprocess
    import sys
    import time

    store = Store(tmp_path / "q.db")
    now = time.time()
    batch_id, created = store.submit([spec(f"/m/{i}.wav") for i in range(5000)], now, as_batch=True)
    newest = created[-1].job["job_id"]
    assert int(newest[:9], 36) > (now + 4.9) * 1000  # 5,000 ids in one millisecond: 5 s ahead
    store.close()
    made_after = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from edge_queue.store import JobSpec, Store\n"
            "s = Store(sys.argv[1])\n"
            "b, (c,) = s.submit([JobSpec(kind='noop', input='/m/after.wav', options={})], time.time())\n"
            "b2, _ = s.submit([JobSpec(kind='noop', input=f'/m/{i}.wav', options={}) for i in (1, 2)],"
            " time.time(), as_batch=True)\n"
            "print(c.job['job_id'], b2)",
            str(tmp_path / "q.db"),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert made_after[0] > newest and made_after[1] > batch_id, (made_after, newest, batch_id)


@given(st.lists(st.tuples(st.integers(1, 36**9 - 1), st.integers(0, 2**64 - 1)), min_size=1, max_size=20))
def test_id_text_is_the_time_and_the_random_bits_in_base_36(draws: list[tuple[int, int]]) -> None:
    """An id is 9 base-36 digits of its millisecond (most significant first) and 7 of its
    random bits (least significant first), whatever the order of the times (the first digits
    are kept from the call before)."""
    import edge_queue.store.ids as store_module

    def base36(n: int, width: int) -> str:
        digits = ""
        for _ in range(width):
            n, r = divmod(n, 36)
            digits = "0123456789abcdefghijklmnopqrstuvwxyz"[r] + digits
        return digits

    real, last = store_module._random64, store_module._last_ms
    try:
        for ms, bits in draws:
            store_module._last_ms = 0
            store_module._random64 = lambda bits=bits: bits  # type: ignore[assignment]
            assert new_id(ms / 1000 + 0.0001) == base36(ms, 9) + base36(bits, 7)[::-1]
    finally:
        store_module._random64, store_module._last_ms = real, last


@given(st.floats(min_value=0, max_value=2**35, allow_nan=False) | st.integers(0, 2**33).map(lambda s: s + 0.9999995))
def test_iso_is_datetimes_text(ts: float) -> None:
    """iso keeps the text of the last second; it must stay what datetime writes (rounding to
    microseconds first, then cutting to milliseconds), also at a second's edge."""
    assert iso(ts) == datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def test_forked_child_draws_other_random_bits() -> None:
    """Ids take their random part from a pool of OS random bytes; a forked child must not
    reuse the parent's pool (two processes would make the same ids)."""
    new_id()  # the pool is filled
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, "".join(new_id(1_800_000_000.0)[9:] for _ in range(20)).encode())
        os._exit(0)
    os.close(w)
    child = os.read(r, 4096).decode()
    os.waitpid(pid, 0)
    mine = "".join(new_id(1_800_000_000.0)[9:] for _ in range(20))
    assert len(child) == len(mine) == 140 and child != mine


def test_state_table() -> None:
    assert {s for s in JobState if is_terminal(s)} == {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
    assert can_transition("running", "queued") and not can_transition("succeeded", "queued")
    assert set(TRANSITIONS) == set(JobState)


def test_a_schema_1_store_is_upgraded_keeping_its_events_and_their_ids(tmp_path: Path) -> None:
    # Given a store as edge-queue wrote it before schema 2 (event ids a plain rowid, no
    # lock_key), with a few jobs and their events
    path = tmp_path / "old.db"
    store = Store(path)
    _, created = store.submit([JobSpec("noop", f"x{i}", {}) for i in range(3)], 1.0, as_batch=True)
    store.claim_many(2.0, ["noop"], "run", 3)
    before = list(store.conn.execute("SELECT * FROM job_events ORDER BY id"))
    conn = store.conn
    conn.execute("DROP INDEX jobs_lock")
    conn.execute("ALTER TABLE jobs DROP COLUMN lock_key")
    conn.execute("DROP INDEX jobs_waiting_by")
    conn.execute("ALTER TABLE jobs DROP COLUMN submitted_by")
    conn.execute("ALTER TABLE job_events RENAME TO job_events_new")
    conn.execute(
        "CREATE TABLE job_events (id INTEGER PRIMARY KEY, job_id TEXT, at TEXT, from_state TEXT, to_state TEXT, "
        "attempt INTEGER, detail TEXT)"
    )
    conn.execute("INSERT INTO job_events SELECT * FROM job_events_new")
    conn.execute("DROP TABLE job_events_new")
    conn.execute("DROP TABLE store_meta")
    conn.execute("PRAGMA user_version=1")
    store.close()
    # When the new edge-queue opens it
    store = Store(path)
    # Then it is the newest schema, with the same events under the same ids, and new ids follow them
    assert store.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    after = list(store.conn.execute("SELECT * FROM job_events ORDER BY id"))
    assert after == before
    assert (
        "AUTOINCREMENT" in store.conn.execute("SELECT sql FROM sqlite_master WHERE name = 'job_events'").fetchone()[0]
    )
    job = store.transition(created[0].job["job_id"], JobState.SUCCEEDED, 3.0)
    assert job["event_id"] == before[-1][0] + 1
    assert "lock_key" in store.db.table("jobs").columns_dict
    assert "submitted_by" in store.db.table("jobs").columns_dict


def test_migrate_leaves_the_newest_schema_alone_and_refuses_a_newer_one(store: Store) -> None:
    # Given an open store (the newest schema) with a job
    created = store.submit([JobSpec("noop", "x", {})], 1.0)[1][0].job
    # When it is migrated again, nothing changes
    store.migrate()
    assert store.get(created["job_id"])["state"] == "queued"
    assert store.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    # And a schema newer than this edge-queue is refused, not changed
    store.conn.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    with pytest.raises(RuntimeError, match="is newer than this edge-queue"):
        store.migrate()
    assert store.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION + 1


def test_a_schema_2_store_gets_the_sender_column_and_keys_stay_per_sender(tmp_path: Path) -> None:
    # Given a schema 2 store (no submitted_by) with a job submitted under an idempotency key
    path = tmp_path / "old.db"
    store = Store(path)
    _, old = store.submit([JobSpec("noop", "x", {})], 1.0, idempotency_key="k")
    store.conn.execute("DROP INDEX jobs_waiting_by")
    store.conn.execute("ALTER TABLE jobs DROP COLUMN submitted_by")
    store.conn.execute("PRAGMA user_version=2")
    store.close()
    # When the new edge-queue opens it
    store = Store(path)
    # Then the job is kept, submitted by nobody (the shared topics), and its key still answers
    assert store.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert store.get(old[0].job["job_id"])["submitted_by"] is None
    _, again = store.submit([JobSpec("noop", "x", {})], 2.0, idempotency_key="k")
    assert again[0].duplicate and again[0].job["job_id"] == old[0].job["job_id"]
    # while the same key sent by alice, then by bob, makes a job of each
    _, alice = store.submit([JobSpec("noop", "x", {}, submitted_by="alice")], 3.0, idempotency_key="k")
    _, bob = store.submit([JobSpec("noop", "x", {}, submitted_by="bob")], 4.0, idempotency_key="k")
    assert not alice[0].duplicate and not bob[0].duplicate
    assert len({old[0].job["job_id"], alice[0].job["job_id"], bob[0].job["job_id"]}) == 3
    assert [j["job_id"] for j in store.list_jobs(submitted_by=("alice",))] == [alice[0].job["job_id"]]


def test_a_groups_plain_submits_are_seen_by_every_statement_after_them(store: Store, tmp_path: Path) -> None:
    """Plain submits inside a group are written together (Submits.submit_deferred); whatever
    runs after them in the group sees them, their ``queued`` events have the ids they were
    given, and the commit holds them."""
    store.submit([spec("/m/old")], 1.0)  # an event id to count from
    with store.group():
        _, (a,) = store.submit([spec("/m/a")], 2.0)
        _, (dup,) = store.submit([spec("/m/a")], 2.0)  # the same job, before it is written
        assert dup.duplicate and dup.job["job_id"] == a.job["job_id"]
        _, (b,) = store.submit([spec("/m/b", priority=5)], 2.0)
        assert store.counts()["queued"] == 3 and store.waiting() == 3
        assert store.get(a.job["job_id"])["state"] == "queued"  # a read writes them first
        # a claim (its own event rows) between two runs of deferred submits
        (claimed,) = store.claim_many(3.0, ["noop"], "me", 1)
        assert claimed["job_id"] == b.job["job_id"]
        _, (c,) = store.submit([spec("/m/c")], 4.0)
        store.requests.remember_request(b"k", b"{}", None, 4.0, 1)
        assert store.requests.recall_request(b"k") == (b"{}", None, 1)
    other = sqlite3.connect(tmp_path / "q.db")
    rows = dict(other.execute("SELECT job_id, state FROM jobs"))
    assert (
        rows[a.job["job_id"]] == "queued" and rows[b.job["job_id"]] == "running" and rows[c.job["job_id"]] == "queued"
    )
    for created in (a, b, c):
        queued = [e for e in store.events(created.job["job_id"]) if e["to_state"] == "queued"]
        assert [e["id"] for e in queued] == [created.job["event_id"]]
    ids = [r[0] for r in other.execute("SELECT id FROM job_events ORDER BY id")]
    assert ids == list(range(ids[0], ids[0] + len(ids)))  # in order, none skipped
    assert claimed["event_id"] == c.job["event_id"] - 1


def test_a_failed_group_leaves_none_of_its_plain_submits(store: Store, tmp_path: Path) -> None:
    """A group that fails after plain submits (a full disk at the commit, a bug) rolls them
    back with the rest: no row, no count, and the next group numbers its events afresh."""
    with pytest.raises(RuntimeError):
        with store.group():
            store.submit([spec("/m/a")], 1.0)
            store.requests.remember_request(b"k", b"{}", None, 1.0, 1)
            raise RuntimeError("the turn failed")
    assert store.counts()["queued"] == 0 and store.requests.recall_request(b"k") is None
    assert sqlite3.connect(tmp_path / "q.db").execute("SELECT count(*) FROM jobs").fetchone() == (0,)
    with store.group():
        _, (a,) = store.submit([spec("/m/a")], 2.0)
    assert [e["id"] for e in store.events(a.job["job_id"])] == [a.job["event_id"]]


def test_a_groups_meta_values_join_its_deferred_rows(store: Store, tmp_path: Path) -> None:
    """A value set per request inside a group (Home Assistant's last submit) is written with
    the group's deferred rows, the last one per key: the turn's plain submits stay unwritten
    until a statement reads the store, one ``executemany`` for all of them. A read inside the
    group sees the value; the commit keeps it; a failed group keeps none."""
    store.set_meta_text("ha_submit", "before")
    with store.group():
        store.submit([spec("/m/a")], 1.0)
        store.set_meta_text("ha_submit", "a")
        store.submit([spec("/m/b")], 1.0)
        store.set_meta_text("ha_submit", "b")
        store.set_meta("requests_seen", 2)
        assert len(store.connection.deferred_jobs) == 2  # not written one by one
        assert store.meta_text("ha_submit") == "b" and store.meta("requests_seen") == 2
        assert not store.connection.deferred_jobs
        store.set_meta_text("ha_submit", "c")
    other = sqlite3.connect(tmp_path / "q.db")
    assert other.execute("SELECT value FROM store_meta WHERE key = 'ha_submit'").fetchone() == ("c",)
    assert other.execute("SELECT count(*) FROM jobs").fetchone() == (2,)
    with pytest.raises(RuntimeError):
        with store.group():
            store.set_meta_text("ha_submit", "lost")
            raise RuntimeError("the turn failed")
    assert store.meta_text("ha_submit") == "c"
    with store.group():
        with pytest.raises(RuntimeError), store.connection.immediate():  # a savepoint, undone
            store.set_meta_text("ha_submit", "undone")
            raise RuntimeError("the operation failed")
    assert store.meta_text("ha_submit") == "c"


def test_a_plain_submit_sqlite_cannot_store_fails_alone(store: Store) -> None:
    """An input SQLite cannot take (a lone surrogate from a non-UTF-8 file name) fails its own
    submit, at once, and not the group's other submits."""
    with store.group():
        _, (a,) = store.submit([spec("/m/a")], 1.0)
        with pytest.raises(UnicodeEncodeError):
            store.submit([spec("/m/\udcff.wav")], 1.0)
        _, (b,) = store.submit([spec("/m/b")], 1.0)
    assert {j["job_id"] for j in store.list_jobs()} == {a.job["job_id"], b.job["job_id"]}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    submits=st.lists(
        st.tuples(st.integers(-2, 2), st.sampled_from([None, 5.0, 20.0]), st.sampled_from(["noop", "probe"])),
        min_size=1,
        max_size=5,
    ),
    claims=st.lists(st.sampled_from([("noop",), ("probe",), ("noop", "probe"), ()]), min_size=1, max_size=6),
    backlog=st.booleans(),
)
def test_a_claim_of_unwritten_submits_equals_the_claim_of_written_ones(
    tmp_path_factory: pytest.TempPathFactory,
    submits: list[tuple[int, float | None, str]],
    claims: list[tuple[str, ...]],
    backlog: bool,
) -> None:
    """An idle service's new job is claimed before its row is written (Claims.claim_deferred):
    the same jobs in the same order, with the same rows, events and event ids, as the claim of
    the written rows (Store.claim_many); taken only when every waiting job is one of the
    group's unwritten submits."""

    def run(written: bool) -> tuple[list[Any], list[Any], list[Any], list[str]]:  # noqa: C901
        store = Store(tmp_path_factory.mktemp("claim") / "q.db")
        if backlog:
            store.submit([spec("/m/earlier", priority=-3)], 1.0)
        statements: list[str] = []
        store.conn.set_trace_callback(statements.append)
        order: dict[str, int] = {}
        got = []
        with store.group():
            for i, (priority, run_at, kind) in enumerate(submits):
                _, (created,) = store.submit([spec(f"/m/{i}", kind=kind, priority=priority, run_at=run_at)], 2.0)
                order.setdefault(created.job["job_id"], i)
            if written:
                store.conn  # noqa: B018 - writes the deferred rows
            for kinds in claims:
                job = store.claim(10.0, kinds, "run1")
                got.append(None if job is None else {**job, "job_id": order.get(job["job_id"], -1)})
        order_of = lambda job_id: order.get(job_id, -1)  # noqa: E731
        rows = [{**row, "job_id": order_of(row["job_id"])} for row in store.list_jobs(limit=100)]
        rows.sort(key=lambda r: r["job_id"])
        events = [
            (e["id"], order_of(e["job_id"]), e["at"], e["from_state"], e["to_state"], e["attempt"], e["detail"])
            for e in store.db.query("SELECT * FROM job_events ORDER BY id")
        ]
        store.conn.set_trace_callback(None)
        store.close()
        return got, rows, events, statements

    fast, slow = run(written=False), run(written=True)
    assert fast[:3] == slow[:3]
    if backlog:
        return
    # no job waited before the group: the claims up to the first that found nothing took the
    # unwritten rows, without the written path's UPDATE
    leading = next((i for i, job in enumerate(fast[0]) if job is None), len(fast[0]))
    claimed = sum(job is not None for job in fast[0])
    updates = [s for s in fast[3] if s.startswith("UPDATE jobs SET state = 'running'")]
    assert len(updates) <= claimed - leading


def test_a_listing_finds_any_of_100000_jobs_by_name_and_counts_them(tmp_path: Path) -> None:
    """docs/topics.md, ``list``: ``input_contains`` and ``count`` find any job of a large store
    (the queue page's search), fast, with LIKE's wildcards taken as plain characters."""
    store = Store(tmp_path / "q.db", durability="normal")
    for b in range(100):
        names = [f"/media/Rec_{b * 1000 + i:06d}.wav" for i in range(1000)]
        store.submit([spec(n, kind="probe" if i % 2 else "noop") for i, n in enumerate(names)], 1.0, as_batch=True)
    store.submit([spec("/media/100%_done.wav")], 2.0)
    assert store.count_jobs() == 100_001
    # any one of them, in any case
    for n in (0, 12_345, 99_999):
        found = store.list_jobs(input_contains=f"rec_{n:06d}")
        assert [j["input"] for j in found] == [f"/media/Rec_{n:06d}.wav"]
        assert store.count_jobs(input_contains=f"REC_{n:06d}") == 1
    # filters combine, and the count is of every page
    assert store.count_jobs(input_contains="rec_0123", kind="probe") == 50
    page = store.list_jobs(input_contains="rec_0123", kind="probe", limit=20)
    rest = store.list_jobs(input_contains="rec_0123", kind="probe", before=page[-1]["job_id"], limit=100)
    assert len(page) == 20 and len(rest) == 30 and not {j["job_id"] for j in page} & {j["job_id"] for j in rest}
    # % and _ are the characters themselves
    assert [j["input"] for j in store.list_jobs(input_contains="100%_")] == ["/media/100%_done.wav"]
    assert store.count_jobs(input_contains="%") == 1 and store.count_jobs(input_contains="1_0") == 0
    import time

    began = time.perf_counter()
    store.list_jobs(input_contains="rec_054321", limit=100)
    store.count_jobs(input_contains="rec_054321")
    assert time.perf_counter() - began < 2.0  # a search of the page answers at once
