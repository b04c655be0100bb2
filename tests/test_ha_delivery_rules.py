"""When a finished job counts as notified to Home Assistant, and what is sent for the ones it
missed (edge_queue/rules/ha_delivery.py, edge_queue/store/ha_owed.py; docs/home-assistant.md,
"Jobs that end while Home Assistant is down"). Milliseconds: plain functions, and a real SQLite
file for the owed runs."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from edge_queue.rules import ha_delivery as rules
from edge_queue.store import Store


def rows(n: int, states: tuple[str, ...] = ("succeeded",)) -> list[dict[str, object]]:
    return [
        {"event_id": i + 1, "job_id": f"j{i + 1}", "state": states[i % len(states)], "finished_at": f"t{i + 1}"}
        for i in range(n)
    ]


def test_a_few_missed_runs_are_sent_one_by_one_oldest_first() -> None:
    owed = rows(rules.SINGLE_MAX)
    assert rules.plan(owed) == [[r] for r in owed]


def test_a_burst_is_one_summary_then_the_newest() -> None:
    # 120 jobs ended while Home Assistant or the broker was away (before: the first 100 sent, one
    # notification each, the newest 20 never)
    owed = rows(120, ("succeeded", "succeeded", "failed"))
    summary_rows, newest = rules.plan(owed)
    assert summary_rows == owed and newest == [owed[-1]]
    body = rules.summary(summary_rows, dropped=0)
    assert body["event_type"] == "missed" and body["late"] is True
    assert (body["count"], body["succeeded"], body["failed"], body["cancelled"]) == (120, 80, 40, 0)
    assert body["job_ids"][0] == "j120" and len(body["job_ids"]) == rules.SUMMARY_IDS
    assert (body["first_finished_at"], body["last_finished_at"]) == ("t1", "t120")
    assert body["text"].startswith(
        "120 jobs ended while Home Assistant or the broker was away: 80 succeeded, 40 failed"
    )
    assert "5 older" in rules.summary(summary_rows, dropped=5)["text"]
    assert rules.summary(summary_rows, dropped=5)["count"] == 125


def test_what_is_sent_when() -> None:
    assert rules.send_live(None) and rules.send_live(True) and not rules.send_live(False)
    assert rules.send_owed("online", mqtt5=False) and rules.send_owed("online", mqtt5=True)
    # after our own connect Home Assistant's state is not known: only a broker that says
    # whether anyone got the message (MQTT 5) makes sending then safe
    assert rules.send_owed("connect", mqtt5=True) and not rules.send_owed("connect", mqtt5=False)
    with pytest.raises(ValueError):
        rules.send_owed("sometime", mqtt5=True)
    assert not rules.delivered(rules.NO_MATCHING_SUBSCRIBERS) and rules.delivered(0)


def test_owed_runs_are_kept_bounded_oldest_dropped_and_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import edge_queue.store.ha_owed as room

    monkeypatch.setattr(room, "OWED_MAX", 5)
    store = Store(tmp_path / "s.db")
    for i in range(1, 9):
        store.ha_owed.owe(i, f"j{i}", "succeeded", None)
    owed, dropped = store.ha_owed.owed()
    assert [r["event_id"] for r in owed] == [4, 5, 6, 7, 8] and dropped == 3
    store.ha_owed.delivered([4, 5])
    assert [r["event_id"] for r in store.ha_owed.owed()[0]] == [6, 7, 8]
    assert store.ha_owed.owed()[1] == 3
    store.ha_owed.forget_dropped()
    assert store.ha_owed.owed()[1] == 0
    store.close()


def test_a_turns_owed_runs_are_written_together_in_its_transaction(tmp_path: Path) -> None:
    """The runs a turn ends are owed with one statement, in the turn's transaction: a read in
    the turn sees them, the commit keeps them, a failed turn keeps none."""
    store = Store(tmp_path / "s.db")
    with store.group():
        for i in (1, 2, 3):
            store.ha_owed.owe(i, f"j{i}", "succeeded", None)
        assert len(next(iter(store.connection.deferred_rows.values()))) == 3  # not one by one
        assert [r["event_id"] for r in store.ha_owed.owed()[0]] == [1, 2, 3]
        store.ha_owed.owe(4, "j4", "failed", "t")
    with pytest.raises(RuntimeError), store.group():
        store.ha_owed.owe(5, "j5", "succeeded", None)
        raise RuntimeError("the turn failed")
    other = sqlite3.connect(tmp_path / "s.db")
    assert [r[0] for r in other.execute("SELECT event_id FROM ha_owed ORDER BY event_id")] == [1, 2, 3, 4]
    other.close()
    store.close()


def test_an_older_stores_offline_cursor_becomes_owed_runs(tmp_path: Path) -> None:
    # Given a store of the previous edge-queue, which kept the event id when Home Assistant went
    # offline: two jobs ended after it, one before
    path = tmp_path / "old.db"
    Store(path).close()
    conn = sqlite3.connect(path)
    conn.execute("DROP TABLE ha_owed")
    conn.execute(
        "INSERT INTO jobs (job_id, seq, kind, state, attempt, max_attempts, priority, created_at, finished_at) "
        "VALUES ('a', 1, 'noop', 'succeeded', 1, 3, 0, 't', 't1'), ('b', 1, 'noop', 'failed', 1, 3, 0, 't', 't2'), "
        "('c', 1, 'noop', 'succeeded', 1, 3, 0, 't', 't3')"
    )
    for job_id, state in (("a", "succeeded"), ("b", "failed"), ("c", "succeeded")):
        conn.execute(
            "INSERT INTO job_events (job_id, at, from_state, to_state, attempt) VALUES (?, 't', 'running', ?, 1)",
            [job_id, state],
        )
    first = conn.execute("SELECT min(id) FROM job_events WHERE job_id = 'a'").fetchone()[0]
    conn.execute("INSERT OR REPLACE INTO store_meta (key, value) VALUES ('ha_offline_after', ?)", [first])
    conn.commit()
    conn.close()
    # When this edge-queue opens it
    store = Store(path)
    # Then the two runs after the cursor are owed, and the cursor is gone
    owed, _ = store.ha_owed.owed()
    assert [(r["job_id"], r["state"]) for r in owed] == [("b", "failed"), ("c", "succeeded")]
    assert store.meta("ha_offline_after") is None
    store.close()
