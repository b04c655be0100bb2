"""Lock keys (docs/topics.md, "Lock keys"), on the real service process and a real broker:
jobs with one key never run at the same time, run in submit order with ``on_lock: wait``, are
refused with ``lock_held`` by default, and the lock outlives restarts and kill -9."""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from .conftest import wait_until


def _submit(svc: Any, watcher: Any, **body: Any) -> dict[str, Any]:
    return svc.request("submit", body, watcher)


def _job_id(resp: dict[str, Any]) -> str:
    assert resp["status"] == "ok", resp
    return str(resp["data"]["jobs"][0]["job_id"])


def _runs(watcher: Any, base: str, job_id: str) -> list[tuple[float, float | None]]:
    """(started, ended) monotonic times of each run of a job, from <base>/events as received."""
    runs: list[tuple[float, float | None]] = []
    for topic, payload, _, at in list(watcher.messages):
        if topic != f"{base}/events" or not payload:
            continue
        event = json.loads(payload)
        if event["job"]["job_id"] != job_id or event["event_id"] is None:
            continue
        state = event["job"]["state"]
        if state == "running" and (not runs or runs[-1][1] is not None):
            runs.append((at, None))
        elif state in ("succeeded", "failed", "cancelled", "queued", "retrying") and runs and runs[-1][1] is None:
            runs[-1] = (runs[-1][0], at)
    return runs


def _ended(watcher: Any, base: str, job_id: str, state: str = "succeeded", timeout: float = 60) -> None:
    watcher.wait_json(f"{base}/jobs/{job_id}", lambda m: m["state"] == state, timeout)


@pytest.mark.slow
def test_reject_names_the_holder(mosquitto, service_factory, tmp_path: Path) -> None:
    svc = service_factory(mosquitto, [tmp_path]).start()
    watcher = svc.watcher("response/#", "jobs/+")
    holder = _job_id(_submit(svc, watcher, kind="test_hang", options={"seconds": 30}, lock_key="cam1"))
    # a second submit with the key, on_lock defaulting to reject
    second = _submit(svc, watcher, kind="noop", lock_key="cam1")
    assert second["status"] == "error", second
    assert second["error"]["code"] == "lock_held" and holder in second["error"]["message"], second
    assert second["error"]["field"] == "lock_key"
    # another key, and no key, are not held
    assert _submit(svc, watcher, kind="noop", lock_key="cam2")["status"] == "ok"
    assert _submit(svc, watcher, kind="noop")["status"] == "ok"
    # a batch with reject is refused as a request, not half-accepted
    batch = _submit(svc, watcher, kind="noop", inputs=["a", "b"], lock_key="cam3")
    assert batch["status"] == "error" and batch["error"]["field"] == "on_lock", batch
    # list filters by lock key
    listed = svc.request("list", {"lock_key": "cam1"}, watcher)["data"]["jobs"]
    assert [j["job_id"] for j in listed] == [holder] and listed[0]["lock_key"] == "cam1"
    assert svc.request("cancel", {"job_id": holder}, watcher)["status"] == "ok"


@pytest.mark.slow
def test_wait_runs_one_key_in_submit_order_beside_other_keys(mosquitto, service_factory, tmp_path: Path) -> None:
    # Given two workers
    svc = service_factory(mosquitto, [tmp_path], {"EDGE_QUEUE_WORKERS": "2"}).start()
    watcher = svc.watcher("response/#", "jobs/+", "events")
    # When three jobs with one key are submitted to wait (the last with the highest priority),
    # and a job with another key
    ids = [
        _job_id(
            _submit(
                svc,
                watcher,
                kind="test_hang",
                options={"seconds": 1.0},
                lock_key="a",
                on_lock="wait",
                priority=p,
                input=f"a{i}",
            )
        )
        for i, p in enumerate((0, 50, 100))
    ]
    other = _job_id(_submit(svc, watcher, kind="test_hang", options={"seconds": 2.5}, lock_key="b"))
    for job_id in [*ids, other]:
        _ended(watcher, svc.base, job_id)
    # Then they ran strictly one after another, in submit order, while the other key's job
    # ran beside them
    runs = [_runs(watcher, svc.base, job_id) for job_id in ids]
    assert all(len(r) == 1 for r in runs), runs
    spans = [r[0] for r in runs]
    for (_s1, e1), (s2, _) in zip(spans, spans[1:], strict=False):
        assert e1 is not None and s2 >= e1, spans
    (b_start, b_end) = _runs(watcher, svc.base, other)[0]
    assert b_end is not None and any(s < b_end and (e or 0) > b_start for s, e in spans), (spans, b_start, b_end)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["succeeded", "failed", "cancelled", "crash_loop"])
def test_the_lock_is_released_however_the_holder_ends(mosquitto, service_factory, tmp_path: Path, how: str) -> None:
    svc = service_factory(mosquitto, [tmp_path], {"EDGE_QUEUE_RETRY__BACKOFF_BASE_S": "0.1"}).start()
    watcher = svc.watcher("response/#", "jobs/+")
    holder_body: dict[str, Any] = {
        "succeeded": {"kind": "test_hang", "options": {"seconds": 0.5}},
        "failed": {"kind": "test_fail", "options": {"code": "unsupported_media"}},
        "cancelled": {"kind": "test_hang", "options": {"seconds": 60}},
        "crash_loop": {"kind": "test_crash"},
    }[how]
    holder = _job_id(_submit(svc, watcher, lock_key="k", **holder_body))
    waiter = _job_id(_submit(svc, watcher, kind="noop", lock_key="k", on_lock="wait"))
    if how == "cancelled":
        watcher.wait_json(f"{svc.base}/jobs/{holder}", lambda m: m["state"] == "running")
        assert svc.request("cancel", {"job_id": holder}, watcher)["status"] == "ok"
    end = "failed" if how in ("failed", "crash_loop") else how
    _ended(watcher, svc.base, holder, end, timeout=120)
    # the waiter runs once the holder has ended, and not before
    _ended(watcher, svc.base, waiter, "succeeded")
    holder_end = next(
        at for t, p, _, at in list(watcher.messages) if t.endswith(holder) and p and json.loads(p)["state"] == end
    )
    waiter_states = [(json.loads(p)["state"], at) for t, p, _, at in list(watcher.messages) if t.endswith(waiter) and p]
    assert all(at >= holder_end for s, at in waiter_states if s in ("running", "succeeded")), waiter_states
    # and a new submit with reject is accepted: nothing holds the key
    assert _submit(svc, watcher, kind="noop", lock_key="k")["status"] == "ok"


def test_a_kill_keeps_the_lock_with_its_holder(mosquitto, service_factory, tmp_path: Path) -> None:
    # Given a holder running and a waiter
    svc = service_factory(mosquitto, [tmp_path]).start()
    watcher = svc.watcher("response/#", "jobs/+", "events")
    holder = _job_id(_submit(svc, watcher, kind="test_hang", options={"seconds": 2}, lock_key="dev"))
    waiter = _job_id(_submit(svc, watcher, kind="noop", lock_key="dev", on_lock="wait"))
    watcher.wait_json(f"{svc.base}/jobs/{holder}", lambda m: m["state"] == "running")
    # When the service is killed (kill -9) and started again
    svc.kill()
    svc.start()
    # Then the holder runs again, and the waiter waits for it still
    _ended(watcher, svc.base, holder)
    _ended(watcher, svc.base, waiter)
    holder_runs = _runs(watcher, svc.base, holder)
    waiter_runs = _runs(watcher, svc.base, waiter)
    assert len(holder_runs) == 2 and len(waiter_runs) == 1, (holder_runs, waiter_runs)
    assert waiter_runs[0][0] >= holder_runs[-1][1], (holder_runs, waiter_runs)


@pytest.mark.slow
def test_twenty_clients_at_once_one_holds_the_key(mosquitto, service_factory, tmp_path: Path) -> None:
    svc = service_factory(mosquitto, [tmp_path]).start()
    watcher = svc.watcher("response/#")
    clients = []
    for _ in range(20):
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="race-" + uuid.uuid4().hex[:8])
        c.connect(svc.broker.host, svc.broker.port)
        c.loop_start()
        clients.append(c)
    go = threading.Barrier(20)

    def fire(i: int) -> None:
        go.wait()
        body = {
            "kind": "test_hang",
            "options": {"seconds": 5},
            "lock_key": "same",
            "input": f"c{i}",
            "transaction": f"race{i}",
        }
        clients[i].publish(f"{svc.base}/request/submit", json.dumps(body), qos=1)

    threads = [threading.Thread(target=fire, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    topic = f"{svc.base}/response/submit"
    wait_until(
        lambda: len([r for r in watcher.json_on(topic) if str(r.get("transaction")).startswith("race")]) >= 20,
        30,
        "20 answers",
    )
    answers = [r for r in watcher.json_on(topic) if str(r.get("transaction")).startswith("race")]
    ok = [a for a in answers if a["status"] == "ok"]
    assert len(answers) == 20 and len(ok) == 1, answers
    assert all(a["error"]["code"] == "lock_held" for a in answers if a["status"] != "ok")
    for c in clients:
        c.loop_stop()
        c.disconnect()
