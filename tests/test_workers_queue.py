"""Short jobs handed to workers in advance (docs/topics.md, `started_at`): bounded by their expected
time, given back to the queue behind a long job, on cancel and on a graceful stop; real service
process, real broker."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import Watcher, wait_until


def test_short_jobs_held_by_workers_are_bounded_by_their_expected_time(broker, service_factory, speech: Path) -> None:
    # Given 150 jobs of 20 ms (short: under 50 ms on average), on the default 2 workers
    svc = service_factory(broker, [speech]).start()
    watcher = svc.watcher("events", "response/#")
    resp = svc.request(
        "submit", {"kind": "test_hang", "options": {"seconds": 0.02}, "inputs": [f"h{i}" for i in range(150)]}, watcher
    )
    ids = {j["job_id"] for j in resp["data"]["jobs"]}
    wait_until(
        lambda: sum(1 for e in watcher.json_on(f"{svc.base}/events") if e["type"] == "end") >= len(ids),
        60,
        "every job's end event",
        0.2,
    )
    # When the jobs handed to workers are counted from the events (a job is handed out at its
    # "running" event, claimed in a worker's queue, and leaves it at its "end" event)
    held = most = 0
    for e in watcher.json_on(f"{svc.base}/events"):
        if e["job"]["job_id"] in ids and e["type"] != "new":
            held += 1 if e["job"]["state"] == "running" else -1
            most = max(most, held)
    # Then workers held several short jobs at once (they run without a loop turn each), but no
    # more than about 0.1 s of expected work each: 5 jobs of 20 ms, on 2 workers
    # (prefetch.PREFETCH_S; docs/topics.md, started_at)
    assert 2 < most <= 2 * 5, most
    watcher.close()


def _warm_up_noop(svc, watcher, n: int = 10) -> None:
    """Run ``n`` no-op jobs: the kind becomes short (under 50 ms on average), so workers are
    handed several of its jobs at once (docs/topics.md, ``started_at``)."""
    resp = svc.request("submit", {"kind": "noop", "inputs": [f"w{i}" for i in range(n)]}, watcher)
    for job in resp["data"]["jobs"]:
        watcher.wait_json(f"{svc.base}/jobs/{job['job_id']}", lambda m: m["state"] == "succeeded")


def _workers_holding_sleepers(
    service_factory, broker, speech: Path, sleep_s: float, n: int
) -> tuple[Any, Watcher, list[str]]:
    """A service whose workers were handed ``n`` no-op jobs of ``sleep_s`` seconds each, many
    at once (the kind is short after :func:`_warm_up_noop`): ``(service, watcher, job ids)``."""
    svc = service_factory(broker, [speech]).start()
    watcher = svc.watcher("events", "jobs/+", "response/#")
    _warm_up_noop(svc, watcher)
    resp = svc.request(
        "submit", {"kind": "noop", "options": {"sleep_s": sleep_s}, "inputs": [f"s{i}" for i in range(n)]}, watcher
    )
    return svc, watcher, [j["job_id"] for j in resp["data"]["jobs"]]


@pytest.mark.slow
def test_jobs_waiting_behind_a_long_one_in_a_worker_go_back_to_the_queue(
    mosquitto, service_factory, speech: Path
) -> None:
    # Given workers handed many jobs of a short kind at once, which turn out to be long
    # (the kind's mean cannot foresee options that make a job long)
    svc, watcher, ids = _workers_holding_sleepers(service_factory, mosquitto, speech, 3, 40)

    def back_in_queue() -> list[dict]:
        return [
            e["job"]
            for e in watcher.json_on(f"{svc.base}/events")
            if e["job"]["job_id"] in ids and e["job"]["state"] == "queued" and e["type"] == "update"
        ]

    # When the job a worker runs passes 1 s (prefetch.OVERRUN_S), then the jobs waiting
    # behind it are given back to the queue, their attempt not counted
    given_back = wait_until(lambda: len(back_in_queue()) >= len(ids) - 2 and back_in_queue(), 15, "jobs given back")
    assert all(job["attempt"] == 0 and job["started_at"] is None for job in given_back)
    # And a job of higher priority submitted now runs before any of them
    urgent = svc.request("submit", {"kind": "noop", "priority": 100, "input": "urgent"}, watcher)["data"]["jobs"][0]
    watcher.wait_json(f"{svc.base}/jobs/{urgent['job_id']}", lambda m: m["state"] == "succeeded", 15)
    returned = {job["job_id"] for job in given_back}
    order = [
        e["job"]["job_id"]
        for e in watcher.json_on(f"{svc.base}/events")
        if e["job"]["state"] == "running" and e["job"]["attempt"] == 1 and e["job"]["started_at"] is not None
    ]
    assert urgent["job_id"] in order
    assert not returned & set(order[: order.index(urgent["job_id"])])
    watcher.close()


def test_a_cancelled_job_waiting_in_a_workers_queue_ends_at_once(mosquitto, service_factory, speech: Path) -> None:
    # Given a worker holding many jobs of a short kind at once, half a second each
    svc, watcher, ids = _workers_holding_sleepers(service_factory, mosquitto, speech, 0.5, 30)
    last = ids[-1]
    watcher.wait_json(f"{svc.base}/jobs/{last}", lambda m: m["state"] == "running")
    # When the last one, waiting in its worker's queue behind about 7 s of jobs, is cancelled
    assert svc.request("cancel", {"job_id": last}, watcher)["status"] == "ok"
    # Then it ends cancelled without waiting for them, never started (docs/topics.md, cancel)
    final = watcher.wait_json(f"{svc.base}/jobs/{last}", lambda m: m["state"] == "cancelled", 4)
    assert final["started_at"] is None and final["error"]["code"] == "cancelled"
    assert final["attempt"] == 0  # the attempt it never started is not counted
    watcher.close()


def test_a_graceful_stop_gives_back_the_jobs_waiting_in_workers_queues(
    mosquitto, service_factory, speech: Path
) -> None:
    # Given workers holding many jobs of a short kind, half a second each (about 15 s of work)
    svc, watcher, ids = _workers_holding_sleepers(service_factory, mosquitto, speech, 0.5, 30)
    watcher.wait_json(f"{svc.base}/jobs/{ids[-1]}", lambda m: m["state"] == "running")
    # When edge-queue is stopped (SIGTERM)
    t0 = time.monotonic()
    assert svc.stop() == 0
    took = time.monotonic() - t0
    # Then only the jobs the workers run finish (docs/topics.md, "Attempts and failures"): the
    # others go back to the queue at once, their attempt not counted, and the stop does not
    # wait the 10 s of cancel_grace_s while workers run the jobs of their queues
    assert took < 5, took
    states = {j: watcher.json_on(f"{svc.base}/jobs/{j}")[-1] for j in ids}
    queued = [s for s in states.values() if s["state"] == "queued"]
    assert len(queued) >= len(ids) - 4
    assert all(s["attempt"] == 0 for s in queued)
    watcher.close()
