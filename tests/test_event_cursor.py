"""The durable event cursor (docs/topics.md, ``events``): every state change has a global,
strictly increasing ``event_id``, in the ``<base>/events`` messages and in the store's event
log, and a client that was away catches up from the last id it saw, with no gap and no
duplicate; what retention deleted is reported, never skipped in silence."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from .conftest import wait_until
from .helpers.figures import figures


def _live(watcher: Any, base: str) -> list[dict[str, Any]]:
    """The state changes seen on ``<base>/events`` (progress updates carry no event_id)."""
    return [e for e in watcher.json_on(f"{base}/events") if e["event_id"] is not None]


def _catch_up(svc: Any, watcher: Any, after: int, **filters: Any) -> tuple[list[dict[str, Any]], list[dict]]:
    """Page through the ``events`` request from ``after`` until it returns nothing new."""
    events: list[dict[str, Any]] = []
    answers = []
    while True:
        resp = svc.request("events", {"after": after, "limit": 200, **filters}, watcher)
        assert resp["status"] == "ok", resp
        answers.append(resp["data"])
        events += resp["data"]["events"]
        if resp["data"]["next_after"] == after:
            return events, answers
        after = resp["data"]["next_after"]


def _submit_noops(svc: Any, watcher: Any, n: int) -> list[str]:
    ids = []
    for start in range(0, n, 50):
        inputs = [f"n{i}-{uuid.uuid4().hex[:6]}" for i in range(start, min(n, start + 50))]
        resp = svc.request("submit", {"kind": "noop", "inputs": inputs}, watcher)
        ids += [j["job_id"] for j in resp["data"]["jobs"]]
    for job_id in ids:
        watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] == "succeeded")
    return ids


def test_a_client_that_was_away_catches_up_exactly(mosquitto, service_factory, tmp_path: Path) -> None:
    # Given a service, a subscriber of <base>/events that never disconnects, and a phone that
    # saw the first jobs' events and then went away
    svc = service_factory(mosquitto, [tmp_path]).start()
    always = svc.watcher("events", "jobs/+", "response/#")
    phone = svc.watcher("events")
    _submit_noops(svc, always, 10)
    wait_until(lambda: len(_live(phone, svc.base)) >= 30, 30, "the phone's first events")
    seen_before = _live(phone, svc.base)
    last = seen_before[-1]["event_id"]
    phone.close()
    # When 500+ state changes happen while it is away
    _submit_noops(svc, always, 170)
    # Then catching up from the last id it saw gives every event after it, once, in order,
    # the same as the subscriber that never went away saw live
    caught, answers = _catch_up(svc, always, last)
    live = _live(always, svc.base)
    missed = [e["event_id"] for e in live if e["event_id"] > last]
    got = [e["event_id"] for e in caught]
    assert len(missed) >= 500
    assert got == missed, (got[:5], missed[:5])
    assert got == sorted(set(got))
    assert not any(a["dropped"] for a in answers)
    # and each caught-up event says what the live one said
    by_id = {e["event_id"]: e for e in live}
    for e in caught:
        assert by_id[e["event_id"]]["job"]["job_id"] == e["job_id"]
        assert by_id[e["event_id"]]["job"]["state"] == e["state"]
        assert by_id[e["event_id"]]["type"] == e["type"]
    figures(
        what="event ids around the disconnect",
        phone_last_seen=[e["event_id"] for e in seen_before[-3:]],
        caught_up_first=got[:3],
        always_connected_next=missed[:3],
        caught_up_last=got[-3:],
        always_connected_last=missed[-3:],
    )
    # and the filters select within the same sequence
    one = caught[0]["job_id"]
    of_one, _ = _catch_up(svc, always, 0, job_id=one)
    assert [e["type"] for e in of_one] == ["new", "update", "end"]
    ends, _ = _catch_up(svc, always, last, types=["end"])
    assert [e["event_id"] for e in ends] == [e["event_id"] for e in caught if e["type"] == "end"]


def test_a_cursor_older_than_what_is_kept_is_told_so(mosquitto, service_factory, tmp_path: Path) -> None:
    # Given events of jobs that were then purged (their events deleted with them)
    svc = service_factory(mosquitto, [tmp_path]).start()
    watcher = svc.watcher("events", "jobs/+", "response/#")
    _submit_noops(svc, watcher, 5)
    first = _live(watcher, svc.base)[0]["event_id"]
    assert svc.request("purge", {"older_than_s": 0}, watcher)["status"] == "ok"
    _submit_noops(svc, watcher, 2)
    # When a client asks from before them
    resp = svc.request("events", {"after": first - 1}, watcher)["data"]
    # Then it is told that events were dropped, and from where the log goes on
    assert resp["dropped"] is True
    assert resp["oldest_event_id"] > first
    assert all(e["event_id"] >= resp["oldest_event_id"] for e in resp["events"])
    # and a cursor past the deleted ones is not
    newest_deleted = resp["oldest_event_id"] - 1
    assert svc.request("events", {"after": newest_deleted}, watcher)["data"]["dropped"] is False
    # and a malformed cursor is an invalid_request naming the field
    bad = svc.request("events", {"after": -1}, watcher)
    assert bad["status"] == "error" and bad["error"]["field"] == "after", bad


def test_a_kill_during_a_burst_leaves_no_gap_in_event_ids(shipped_mosquitto, service_factory, tmp_path: Path) -> None:
    # Given a service taking a burst of submits (on a broker that drops nothing to a slow
    # watcher: the shared one's 1,000 queued messages dropped the list response in a burst)
    svc = service_factory(shipped_mosquitto, [tmp_path]).start()
    watcher = svc.watcher("events", "jobs/+", "response/#")
    burst = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="burst-" + uuid.uuid4().hex[:8])
    burst.connect(svc.broker.host, svc.broker.port)
    burst.loop_start()
    try:
        for i in range(300):
            burst.publish(f"{svc.base}/request/submit", json.dumps({"kind": "noop", "input": f"k{i}"}), qos=1)
        # When it is killed in the middle (kill -9) and started again
        wait_until(lambda: len(_live(watcher, svc.base)) >= 100, 60, "some events")
        svc.kill()
        svc.start()
        wait_until(lambda: len(watcher.json_on(f"{svc.base}/response/submit")) >= 300, 60, "every submit answered")
        wait_until(
            lambda: svc.request("list", {"state": "queued", "limit": 1}, watcher)["data"]["jobs"] == [], 60, "idle"
        )
    finally:
        burst.loop_stop()
        burst.disconnect()
    # Then the log holds every id from the first to the last, none missing, none twice, and
    # every id a subscriber saw live is in it with the same state
    caught, _ = _catch_up(svc, watcher, 0)
    ids = [e["event_id"] for e in caught]
    assert ids == list(range(ids[0], ids[0] + len(ids))), "a gap in event ids"
    by_id = {e["event_id"]: e for e in caught}
    for e in _live(watcher, svc.base):
        assert by_id[e["event_id"]]["state"] == e["job"]["state"]
