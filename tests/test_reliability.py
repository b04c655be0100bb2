"""Nothing lost, nothing stuck (docs/topics.md, "States"): real processes, real signals, real brokers."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from .conftest import (
    REFERENCE,
    Broker,
    descendants,
    need,
    port_open,
    publish,
    retained_under,
    stop_client,
    stop_mosquitto,
    wait_until,
    wer,
)
from .helpers.ports import free_port


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _events(db: Path, job_id: str) -> list[tuple[str, str | None, str, int]]:
    with sqlite3.connect(db) as conn:
        return conn.execute(
            "SELECT at, from_state, to_state, attempt FROM job_events WHERE job_id = ? ORDER BY id", [job_id]
        ).fetchall()


@pytest.mark.slow
@pytest.mark.usefixtures("model_installed")
def test_kill9_service_during_transcription(mosquitto, service_factory, long_speech: Path) -> None:
    svc = service_factory(mosquitto, [long_speech.parent], {"EDGE_QUEUE_TRANSCRIBE__BATCH_SIZE": "1"}).start()
    watcher = svc.watcher("response/#", "jobs/+", "status")
    watcher = svc.watcher("response/#", "jobs/+", "status", "events")
    job_id = svc.request("submit", {"input": str(long_speech)}, watcher)["data"]["jobs"][0]["job_id"]
    topic = f"{svc.base}/jobs/{job_id}"
    watcher.wait_json(topic, lambda m: m["stage"] == "transcribing", timeout=60)
    workers = descendants(svc.proc.pid)
    # When the service dies with SIGKILL mid-transcription
    svc.kill()
    # Then its workers die with it, and the broker publishes the Last Will
    wait_until(lambda: not any(_alive(p) for p in workers), 10, "the workers to die with the service")
    wait_until(lambda: watcher.on(f"{svc.base}/status")[-1:] == [b"offline"], 60, "the Last Will")
    # And a submit published while it is down is kept by the broker (persistent session)
    publish(mosquitto, f"{svc.base}/request/submit", json.dumps({"kind": "noop", "transaction": "later"}))
    # When it starts again, the orphaned attempt is requeued before any new work is taken
    svc.start()
    done = watcher.wait_json(topic, lambda m: m["state"] in ("succeeded", "failed"), timeout=120)
    assert done["state"] == "succeeded" and done["attempt"] == 2, done
    assert wer(" ".join(list(REFERENCE.values()) * 4), done["result"]["text"]) < 0.1
    later = watcher.wait_json(f"{svc.base}/response/submit", lambda m: m.get("transaction") == "later")
    noop_id = later["data"]["jobs"][0]["job_id"]
    watcher.wait_json(f"{svc.base}/jobs/{noop_id}", lambda m: m["state"] == "succeeded")
    # the requeue made before connecting was still sent as an event, so seq has no gap there
    seqs = [e["job"]["seq"] for e in watcher.json_on(f"{svc.base}/events") if e["job"]["job_id"] == job_id]
    assert seqs == list(range(1, seqs[-1] + 1)), seqs
    events = _events(svc.db, job_id)
    requeued = [e for e in events if e[1] == "running" and e[2] == "queued"]
    assert len(requeued) == 1 and requeued[0][3] == 1
    noop_claimed = [e for e in _events(svc.db, noop_id) if e[2] == "running"][0]
    assert requeued[0][0] <= noop_claimed[0], (requeued, noop_claimed)


def test_poison_job_ends_in_crash_loop_while_others_succeed(broker, service_factory, speech: Path) -> None:
    svc = service_factory(broker, [speech]).start()
    watcher = svc.watcher("response/#", "jobs/+", "events")
    poison = svc.request("submit", {"kind": "test_crash"}, watcher)["data"]["jobs"][0]["job_id"]
    good = [
        svc.request("submit", {"kind": "noop", "options": {"sleep_s": 0.2 * i}}, watcher)["data"]["jobs"][0]["job_id"]
        for i in range(1, 6)
    ]
    final = watcher.wait_json(f"{svc.base}/jobs/{poison}", lambda m: m["state"] == "failed", timeout=60)
    assert final["error"]["code"] == "crash_loop" and final["attempt"] == 3 and not final["error"]["retryable"]
    assert [j["state"] for j in watcher.job_events(svc.base, poison)].count("retrying") == 2
    for job_id in good:
        watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] == "succeeded", timeout=60)
    assert svc.proc.poll() is None


def test_a_job_that_says_cancelled_unasked_fails_and_the_service_goes_on(broker, service_factory, speech: Path) -> None:
    # Given a plug-in kind that raises JobCancelled (code cancelled) when nobody asked for a
    # cancel: running -> cancelled is no transition the table allows
    svc = service_factory(broker, [speech]).start()
    watcher = svc.watcher("response/#", "jobs/+")
    odd = svc.request("submit", {"kind": "test_fail", "options": {"code": "cancelled"}}, watcher)
    odd_id = odd["data"]["jobs"][0]["job_id"]
    # Then the job fails, not retried, saying why; and the service serves the next job
    final = watcher.wait_json(f"{svc.base}/jobs/{odd_id}", lambda m: m["state"] == "failed", timeout=30)
    assert final["error"]["code"] == "internal_error" and not final["error"]["retryable"], final
    assert "no cancel was asked for" in final["error"]["message"] and final["attempt"] == 1
    after = svc.request("submit", {"kind": "noop"}, watcher)["data"]["jobs"][0]["job_id"]
    watcher.wait_json(f"{svc.base}/jobs/{after}", lambda m: m["state"] == "succeeded", timeout=30)
    assert svc.proc.poll() is None


@pytest.mark.slow
@pytest.mark.usefixtures("model_installed")
def test_cancel_running_transcription_then_fresh_worker(mosquitto, service_factory, long_speech: Path) -> None:
    svc = service_factory(
        mosquitto, [long_speech.parent], {"EDGE_QUEUE_WORKERS": "1", "EDGE_QUEUE_TRANSCRIBE__BATCH_SIZE": "1"}
    ).start()
    watcher = svc.watcher("response/#", "jobs/+", "queue", "events")
    job_id = svc.request("submit", {"input": str(long_speech)}, watcher)["data"]["jobs"][0]["job_id"]
    topic = f"{svc.base}/jobs/{job_id}"
    watcher.wait_json(topic, lambda m: m["stage"] == "transcribing", timeout=60)
    first_pid = watcher.wait_json(f"{svc.base}/queue", lambda q: q["running"])["running"][0]["worker_pid"]
    asked = time.monotonic()
    assert svc.request("cancel", {"job_id": job_id}, watcher)["data"]["cancelling"] == [job_id]
    final = watcher.wait_json(topic, lambda m: m["state"] == "cancelled", timeout=15)
    assert time.monotonic() - asked < 10  # within the default grace period
    assert final["error"]["code"] == "cancelled"
    states = [j["state"] for j in watcher.job_events(svc.base, job_id)]
    assert states.index("cancelling") < states.index("cancelled")
    # the next job runs on a fresh worker process
    nxt = svc.request("submit", {"kind": "noop", "options": {"sleep_s": 1.5}}, watcher)["data"]["jobs"][0]["job_id"]
    q = watcher.wait_json(f"{svc.base}/queue", lambda q: any(r["job_id"] == nxt for r in q["running"]))
    assert q["running"][0]["worker_pid"] != first_pid
    assert not _alive(first_pid)


def test_cancel_of_a_job_that_ignores_it_ends_the_worker(broker, service_factory, speech: Path) -> None:
    svc = service_factory(broker, [speech], {"EDGE_QUEUE_CANCEL_GRACE_S": "1"}).start()
    watcher = svc.watcher("response/#", "jobs/+", "queue")
    job_id = svc.request("submit", {"kind": "test_hang"}, watcher)["data"]["jobs"][0]["job_id"]
    topic = f"{svc.base}/jobs/{job_id}"
    pid = watcher.wait_json(f"{svc.base}/queue", lambda q: q["running"])["running"][0]["worker_pid"]
    asked = time.monotonic()
    svc.request("cancel", {"job_id": job_id}, watcher)
    final = watcher.wait_json(topic, lambda m: m["state"] == "cancelled", timeout=15)
    assert time.monotonic() - asked < 6 and final["error"]["code"] == "cancelled"
    wait_until(lambda: not _alive(pid), 10, "the stubborn worker to be ended")
    # the service goes on: a new job succeeds
    ok = svc.request("submit", {"kind": "noop"}, watcher)["data"]["jobs"][0]["job_id"]
    watcher.wait_json(f"{svc.base}/jobs/{ok}", lambda m: m["state"] == "succeeded")


def test_timeout_ends_the_attempt_and_retries_with_backoff(broker, service_factory, speech: Path) -> None:
    env = {"EDGE_QUEUE_RETRY__BACKOFF_BASE_S": "0.5", "EDGE_QUEUE_RETRY__BACKOFF_CAP_S": "1"}
    svc = service_factory(broker, [speech], env).start()
    watcher = svc.watcher("response/#", "jobs/+", "events")
    resp = svc.request("submit", {"kind": "test_hang", "timeout_s": 1, "max_attempts": 2}, watcher)
    topic = f"{svc.base}/jobs/{resp['data']['jobs'][0]['job_id']}"
    final = watcher.wait_json(topic, lambda m: m["state"] == "failed", timeout=30)
    assert final["error"]["code"] == "timeout" and final["attempt"] == 2
    retrying = [j for j in watcher.job_events(svc.base, final["job_id"]) if j["state"] == "retrying"]
    assert len(retrying) == 1 and retrying[0]["retry_at"] and retrying[0]["error"]["retryable"]
    # a non-retryable code fails at once
    resp = svc.request("submit", {"kind": "test_fail", "options": {"code": "unsupported_media"}}, watcher)
    topic = f"{svc.base}/jobs/{resp['data']['jobs'][0]['job_id']}"
    final = watcher.wait_json(topic, lambda m: m["state"] == "failed", timeout=30)
    assert final["attempt"] == 1 and final["error"] == {
        "code": "unsupported_media",
        "message": "failing on purpose",
        "retryable": False,
    }


@pytest.mark.slow
def test_a_stopped_worker_past_its_timeout_does_not_stall_the_service(broker, service_factory, speech: Path) -> None:
    # Given a job whose worker process is stopped (SIGSTOP: SIGTERM stays pending, as for a
    # worker in uninterruptible sleep on a hung network share) when its timeout passes
    svc = service_factory(broker, [speech], {"EDGE_QUEUE_WORKERS": "1"}).start()
    watcher = svc.watcher("response/#", "jobs/+", "queue")
    resp = svc.request("submit", {"kind": "test_hang", "timeout_s": 3, "max_attempts": 1}, watcher)
    topic = f"{svc.base}/jobs/{resp['data']['jobs'][0]['job_id']}"
    pid = watcher.wait_json(f"{svc.base}/queue", lambda q: q["running"], timeout=10)["running"][0]["worker_pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        # Then the attempt ends with timeout and a fresh worker runs the next job
        final = watcher.wait_json(topic, lambda m: m["state"] == "failed", timeout=30)
        assert final["error"]["code"] == "timeout"
        ok = svc.request("submit", {"kind": "noop"}, watcher)["data"]["jobs"][0]["job_id"]
        watcher.wait_json(f"{svc.base}/jobs/{ok}", lambda m: m["state"] == "succeeded", timeout=30)
        # And the stopped process is killed without the loop waiting for it
        wait_until(lambda: not _alive(pid), 15, "the stopped worker to be killed")
        assert svc.request("list", {}, watcher)["status"] == "ok"
        assert "slow loop turn" not in svc.log(), svc.log()[-3000:]
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_a_due_retry_waiting_for_a_busy_worker_does_not_spin_the_loop(mosquitto, service_factory, speech: Path) -> None:
    # Given a job whose retry is due while the only worker runs another, longer job
    import psutil

    from edge_queue.store import parse_iso

    env = {"EDGE_QUEUE_WORKERS": "1", "EDGE_QUEUE_RETRY__BACKOFF_BASE_S": "0.5", "EDGE_QUEUE_RETRY__BACKOFF_CAP_S": "1"}
    svc = service_factory(mosquitto, [speech], env).start()
    watcher = svc.watcher("response/#", "jobs/+", "events")
    body = {"kind": "test_fail", "options": {"code": "internal_error"}, "max_attempts": 2}
    failing = svc.request("submit", body, watcher)["data"]["jobs"][0]["job_id"]
    # (on <base>/events: a retry due within 20 ms is coalesced away on the retained topic)
    retrying = wait_until(
        lambda: [j for j in watcher.job_events(svc.base, failing) if j["state"] == "retrying"], 30, "the retry"
    )[0]
    busy = svc.request("submit", {"kind": "noop", "options": {"sleep_s": 8}}, watcher)["data"]["jobs"][0]["job_id"]
    watcher.wait_json(f"{svc.base}/jobs/{busy}", lambda m: m["state"] == "running", timeout=30)
    wait_until(lambda: time.time() > parse_iso(retrying["retry_at"]) + 0.2, 10, "the retry to be due")
    # Then the service sleeps until the worker is free (it does not poll the store in a loop)
    proc = psutil.Process(svc.proc.pid)
    cpu0, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
    wait_until(lambda: time.monotonic() - t0 >= 2.0, 5, "two seconds of waiting")
    share = (sum(proc.cpu_times()[:2]) - cpu0) / (time.monotonic() - t0)
    assert share < 0.3, f"the service used {share:.0%} of a core while the retry waited"
    # And the retry runs once the worker is free
    final = watcher.wait_json(f"{svc.base}/jobs/{failing}", lambda m: m["state"] == "failed", timeout=30)
    assert final["attempt"] == 2


def test_backoff_schedule_with_an_injected_clock(tmp_path: Path) -> None:
    # Given a service driven by a fake clock and a fixed jitter draw (no processes, no broker)
    from edge_queue.config.settings import Settings
    from edge_queue.service import Service
    from edge_queue.store import JobSpec, Store, parse_iso
    from edge_queue.workers.supervisor import Outcome

    now = [1_000_000.0]
    settings = Settings(data_dir=tmp_path, retry={"max_attempts": 4, "backoff_base_s": 5, "backoff_cap_s": 12})
    svc = Service(settings, clock=lambda: now[0], rng=lambda: 1.0)
    svc.store = Store(tmp_path / "q.db")
    svc.bridge.publish = lambda *a, **k: None  # no broker in this unit test
    _, (created,) = svc.store.submit([JobSpec("noop", None, {}, max_attempts=4)], now[0])
    job_id = created.job["job_id"]
    delays = []
    for attempt in (1, 2, 3):
        job = svc.store.claim(now[0], ["noop"], svc.run_id)
        assert job is not None and job["attempt"] == attempt
        svc.outcomes.apply(
            Outcome("failed", job_id, attempt, {"code": "internal_error", "message": "x", "retryable": True}), now[0]
        )
        job = svc.store.get(job_id)
        assert job["state"] == "retrying"
        delay = parse_iso(job["retry_at"]) - now[0]
        delays.append(round(delay, 3))
        # not claimable a moment before retry_at, claimable at it
        assert svc.store.claim(now[0] + delay - 0.01, ["noop"], svc.run_id) is None
        now[0] += delay
    assert delays == [5.0, 10.0, 12.0]  # base * 2**(n-1), capped
    job = svc.store.claim(now[0], ["noop"], svc.run_id)
    svc.outcomes.apply(
        Outcome("failed", job_id, 4, {"code": "internal_error", "message": "x", "retryable": True}), now[0]
    )
    assert svc.store.get(job_id)["state"] == "failed"
    # a stale outcome (an old attempt) changes nothing
    svc.outcomes.apply(Outcome("done", job_id, 2, {"result": {}}), now[0])
    assert svc.store.get(job_id)["state"] == "failed"
    svc.close()


def test_requests_published_while_stopped_run_on_start(mosquitto, service_factory, speech: Path) -> None:
    svc = service_factory(mosquitto, [speech]).start()
    watcher = svc.watcher("response/#", "jobs/+")
    assert svc.stop() == 0
    txs = [f"t{i}" for i in range(5)]
    for tx in txs:  # QoS 1 to the broker while the service is down
        publish(mosquitto, f"{svc.base}/request/submit", json.dumps({"kind": "noop", "transaction": tx}))
    svc.start()
    for tx in txs:
        resp = watcher.wait_json(f"{svc.base}/response/submit", lambda m, tx=tx: m.get("transaction") == tx)
        job_id = resp["data"]["jobs"][0]["job_id"]
        watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] == "succeeded")
    assert len(watcher.json_on(f"{svc.base}/response/submit")) == 5


def test_duplicate_delivery_creates_one_job(broker, service_factory, speech: Path) -> None:
    svc = service_factory(broker, [speech]).start()
    watcher = svc.watcher("response/#", "jobs/+")
    body = json.dumps({"kind": "noop", "idempotency_key": "k-" + uuid.uuid4().hex, "transaction": 1})
    publish(broker, f"{svc.base}/request/submit", body)
    publish(broker, f"{svc.base}/request/submit", body)
    wait_until(lambda: len(watcher.json_on(f"{svc.base}/response/submit")) == 2, 15, "two responses")
    first, second = watcher.json_on(f"{svc.base}/response/submit")
    assert [j["job_id"] for j in first["data"]["jobs"]] == [j["job_id"] for j in second["data"]["jobs"]]
    assert [j["duplicate"] for j in first["data"]["jobs"] + second["data"]["jobs"]] == [False, True]
    assert len(svc.request("list", {}, watcher)["data"]["jobs"]) == 1


def test_graceful_stop_requeues_without_counting(broker, service_factory, speech: Path) -> None:
    svc = service_factory(broker, [speech], {"EDGE_QUEUE_CANCEL_GRACE_S": "1"}).start()
    watcher = svc.watcher("response/#", "jobs/+", "status")
    job_id = svc.request("submit", {"kind": "noop", "options": {"sleep_s": 30}}, watcher)["data"]["jobs"][0]["job_id"]
    topic = f"{svc.base}/jobs/{job_id}"
    watcher.wait_json(topic, lambda m: m["state"] == "running")
    stopped = time.monotonic()
    assert svc.stop() == 0
    assert time.monotonic() - stopped < 10
    last = watcher.json_on(topic)[-1]
    assert last["state"] == "queued" and last["attempt"] == 0
    assert last["stage"] is None and last["progress"] == 0 and last["eta_s"] is None
    assert watcher.on(f"{svc.base}/status")[-1] == b"offline"
    assert "graceful stop" in svc.log()
    # and it runs to the end after the next start, as attempt 1
    svc.start()
    svc.request("cancel", {"job_id": job_id}, watcher)  # shorten: cancel it once it runs again
    final = watcher.wait_json(topic, lambda m: m["state"] == "cancelled", timeout=30)
    assert final["attempt"] <= 1


@pytest.mark.slow
def test_unknown_retained_jobs_are_cleared_and_retention_purges(broker, service_factory, speech: Path) -> None:
    svc = service_factory(broker, [speech])
    stale = f"{svc.base}/jobs/zzzz0000stale000"
    publish(broker, stale, json.dumps({"v": 1, "job_id": "zzzz0000stale000", "state": "running"}), retain=True)
    watcher = svc.watcher("response/#", "jobs/+")
    svc.start()
    wait_until(lambda: b"" in watcher.on(stale), 15, "the unknown retained job topic to be cleared")
    job_id = svc.request("submit", {"kind": "noop"}, watcher)["data"]["jobs"][0]["job_id"]
    watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] == "succeeded")
    assert svc.stop() == 0
    # restart with a retention shorter than the job's age: purged at start-up, topic cleared
    time.sleep(0.2)  # the job must be older than the retention period below (0.1 s)
    svc.env["EDGE_QUEUE_RETENTION_DAYS"] = str(0.1 / 86400)
    svc.start()
    wait_until(lambda: watcher.on(f"{svc.base}/jobs/{job_id}")[-1:] == [b""], 15, "the purged job's topic cleared")
    assert svc.request("get", {"job_id": job_id}, watcher)["error"]["code"] == "not_found"


def test_pause_resume_retry_purge(broker, service_factory, speech: Path) -> None:
    svc = service_factory(broker, [speech]).start()
    watcher = svc.watcher("response/#", "jobs/+", "queue")
    assert svc.request("pause", {}, watcher)["data"] == {"paused": True}
    job_id = svc.request("submit", {"kind": "test_fail", "max_attempts": 1}, watcher)["data"]["jobs"][0]["job_id"]
    watcher.wait_json(f"{svc.base}/queue", lambda q: q["paused"] and q["counts"]["queued"] == 1)
    assert watcher.json_on(f"{svc.base}/jobs/{job_id}")[-1]["state"] == "queued"
    svc.request("resume", {}, watcher)
    watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] == "failed")
    again = svc.request("retry", {"job_id": job_id}, watcher)
    assert again["data"]["state"] == "queued" and again["data"]["attempt"] == 0
    watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] == "failed" and m["seq"] > again["data"]["seq"])
    assert svc.request("retry", {"job_id": "nosuch"}, watcher)["error"]["code"] == "not_found"
    assert svc.request("purge", {"job_id": job_id}, watcher)["data"]["purged"] == [job_id]
    wait_until(lambda: watcher.on(f"{svc.base}/jobs/{job_id}")[-1] == b"", 10, "the purged topic to be cleared")
    running = svc.request("submit", {"kind": "noop", "options": {"sleep_s": 20}}, watcher)["data"]["jobs"][0]["job_id"]
    assert svc.request("purge", {"job_id": running}, watcher)["error"]["code"] == "conflict"
    assert svc.request("cancel", {"all": True}, watcher)["status"] == "ok"


def test_no_job_starts_after_a_pause_is_acknowledged(broker, service_factory, speech: Path) -> None:
    """docs/topics.md, ``pause``: no new attempt starts once it is answered, including the jobs a
    worker was handed in advance (short jobs, about ten at once here) and had not started."""
    # Given one worker busy with short jobs, so that it holds several at once
    svc = service_factory(broker, [speech], {"EDGE_QUEUE_WORKERS": "1"}).start()
    watcher = svc.watcher("response/#", "queue")
    jobs = svc.request(
        "submit", {"kind": "noop", "options": {"sleep_s": 0.005}, "inputs": [f"p{i}" for i in range(600)]}, watcher
    )["data"]["jobs"]
    wait_until(
        lambda: (q := watcher.json_on(f"{svc.base}/queue")) and q[-1]["counts"]["succeeded"] >= 50,
        30,
        "50 jobs done",
    )
    # When the queue is paused
    assert svc.request("pause", {}, watcher)["data"] == {"paused": True}
    paused_at = time.time()
    # Then the job running goes on and ends; nothing else starts
    watcher.wait_json(f"{svc.base}/queue", lambda q: q["paused"] and q["counts"]["running"] == 0, 30)
    conn = sqlite3.connect(svc.db)
    started = conn.execute(
        "SELECT job_id, started_at, state, attempt FROM jobs WHERE started_at IS NOT NULL"
    ).fetchall()
    from edge_queue.store import parse_iso

    # A job's start is stamped when the service hears of it: the one job the worker may have
    # taken from its queue just before the pause's release reached it is stamped after.
    late = [row for row in started if parse_iso(row[1]) > paused_at]
    assert len(late) <= 1, f"{len(late)} job(s) started after the pause was answered: {late[:3]}"
    waiting = conn.execute("SELECT count(*) FROM jobs WHERE state = 'queued' AND attempt = 0").fetchone()[0]
    assert waiting == len(jobs) - len(started) > 0
    conn.close()


def test_recycles_worker_after_max_jobs(broker, service_factory, speech: Path) -> None:
    svc = service_factory(broker, [speech], {"EDGE_QUEUE_WORKERS": "1", "EDGE_QUEUE_MAX_JOBS_PER_WORKER": "2"}).start()
    watcher = svc.watcher("response/#", "jobs/+")
    ids = [
        svc.request("submit", {"kind": "noop", "options": {"sleep_s": 0.01 * i}}, watcher)["data"]["jobs"][0]["job_id"]
        for i in range(1, 5)
    ]
    for job_id in ids:
        watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] == "succeeded")
    wait_until(lambda: svc.log().count("recycled: 2 jobs done") == 2, 10, "two recycles")


def test_a_worker_given_short_jobs_in_advance_still_ends_after_max_jobs(broker, service_factory, speech: Path) -> None:
    # Given one worker replaced after 5 jobs, and 40 no-op jobs (short: handed out several at once)
    env = {"EDGE_QUEUE_WORKERS": "1", "EDGE_QUEUE_MAX_JOBS_PER_WORKER": "5"}
    svc = service_factory(broker, [speech], env).start()
    watcher = svc.watcher("response/#", "jobs/+")
    jobs = svc.request("submit", {"kind": "noop", "inputs": [f"n{i}" for i in range(40)]}, watcher)["data"]["jobs"]
    for job in jobs:
        watcher.wait_json(f"{svc.base}/jobs/{job['job_id']}", lambda m: m["state"] == "succeeded")
    # Then every worker ran exactly 5 (it was never given more than it had left)
    wait_until(lambda: svc.log().count(" recycled: ") == 8, 10, "eight recycles")
    assert svc.log().count("recycled: 5 jobs done (max_jobs_per_worker 5)") == 8, svc.log()


def _forkserver(service_pid: int) -> int | None:
    """The pid of the service's forkserver (the parent of its workers), or None."""
    for pid in descendants(service_pid):
        try:
            if b"forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            pass
    return None


def test_the_workers_forkserver_killed_again_and_again_costs_no_job(mosquitto, service_factory, speech: Path) -> None:
    # Given a service with its two workers up
    svc = service_factory(mosquitto, [speech]).start()
    watcher = svc.watcher("response/#", "jobs/+")
    running = svc.request("submit", {"kind": "noop", "options": {"sleep_s": 30}}, watcher)["data"]["jobs"][0]
    watcher.wait_json(f"{svc.base}/jobs/{running['job_id']}", lambda m: m["state"] == "running")
    for _ in range(8):
        fs = wait_until(lambda: _forkserver(svc.proc.pid), 15, "the forkserver")
        wait_until(lambda fs=fs: len(descendants(fs)) >= 2 or svc.proc.poll() is not None, 15, "its two workers")
        assert svc.proc.poll() is None, svc.log()
        # When the forkserver is killed (its workers die with it, and the service may try to
        # start their successors before the kernel has made the dead forkserver a zombie)
        os.kill(fs, signal.SIGKILL)
        # Then the service starts a new one and new workers, and keeps serving
        wait_until(
            lambda fs=fs: _forkserver(svc.proc.pid) not in (None, fs) or svc.proc.poll() is not None,
            15,
            "a new forkserver",
        )
        assert svc.proc.poll() is None, svc.log()
    # a new job runs, and the one that was running was run again (each kill cost it an
    # attempt) until it failed with a code, or it still runs
    later = svc.request("submit", {"kind": "noop"}, watcher)["data"]["jobs"][0]
    watcher.wait_json(f"{svc.base}/jobs/{later['job_id']}", lambda m: m["state"] == "succeeded", timeout=30)
    again = watcher.wait_json(f"{svc.base}/jobs/{running['job_id']}", lambda m: m["attempt"] >= 2)
    assert again["state"] in ("running", "retrying", "queued", "failed"), again
    if again["state"] == "failed":
        assert again["error"]["code"] in ("crash_loop", "worker_lost"), again
    assert "Traceback" not in svc.log() and svc.proc.poll() is None, svc.log()


@pytest.fixture
def private_mosquitto(tmp_path: Path):
    """A private mosquitto without persistence on a free port, restartable by the test."""
    need(subprocess.run(["which", "mosquitto"], capture_output=True).returncode == 0, "mosquitto not installed")
    port = free_port()
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> Broker:
        proc = subprocess.Popen(["mosquitto", "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(proc)
        wait_until(lambda: port_open("127.0.0.1", port), 10, "private mosquitto")
        return Broker("127.0.0.1", port, "mosquitto", proc)

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(5)


def test_retained_state_is_back_after_broker_restart(private_mosquitto, service_factory, speech: Path) -> None:
    broker = private_mosquitto()
    svc = service_factory(broker, [speech]).start()
    watcher = svc.watcher("response/#", "jobs/+", "batches/+")
    resp = svc.request("submit", {"kind": "noop", "inputs": ["a", "b"]}, watcher)
    batch_id = resp["data"]["batch_id"]
    watcher.wait_json(f"{svc.base}/batches/{batch_id}", lambda b: b["done"])
    watcher.close()
    # When the broker restarts with nothing retained
    broker.proc.send_signal(signal.SIGTERM)
    broker.proc.wait(10)
    restarted = time.monotonic()
    broker = private_mosquitto()
    # Then status, info, queue, every job and the batch are retained again within 5 s
    topics = [f"{svc.base}/{t}" for t in ("status", "info", "queue", f"batches/{batch_id}")]
    topics += [f"{svc.base}/jobs/{j['job_id']}" for j in resp["data"]["jobs"]]

    def all_back() -> bool:
        w = svc.watcher("#")
        try:
            time.sleep(0.3)
            return all(w.on(t) for t in topics) and w.on(f"{svc.base}/status")[-1] == b"online"
        finally:
            w.close()

    wait_until(all_back, 10, "the retained state after the restart", interval=0.2)
    assert time.monotonic() - restarted < 5.5


@pytest.mark.slow
def test_service_deaths_cost_attempts_not_the_job(broker, service_factory, speech: Path) -> None:
    svc = service_factory(broker, [speech]).start()
    watcher = svc.watcher("response/#", "jobs/+", "events")
    body = {"kind": "noop", "options": {"sleep_s": 30}, "max_attempts": 10}
    job_id = svc.request("submit", body, watcher)["data"]["jobs"][0]["job_id"]
    topic = f"{svc.base}/jobs/{job_id}"
    for attempt in (1, 2, 3):
        watcher.wait_json(topic, lambda m, a=attempt: m["state"] == "running" and m["attempt"] == a, timeout=60)
        svc.kill()
        svc.start()
    running = watcher.wait_json(topic, lambda m: m["state"] == "running" and m["attempt"] == 4, timeout=60)
    assert running["error"] is None
    svc.request("cancel", {"job_id": job_id}, watcher)
    watcher.wait_json(topic, lambda m: m["state"] == "cancelled")
    ends = [e for e in watcher.json_on(f"{svc.base}/events") if e["job"]["job_id"] == job_id and e["type"] == "end"]
    assert len(ends) == 1


def test_a_second_service_on_the_same_data_dir_refuses_to_start(broker, service_factory, speech: Path) -> None:
    first = service_factory(broker, [speech]).start()
    second = subprocess.run(
        [sys.executable, "-m", "edge_queue", "serve"],
        env={**first.env, "EDGE_QUEUE_MQTT__CLIENT_ID": first.env["EDGE_QUEUE_MQTT__CLIENT_ID"] + "b"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 2 and "edge-queue.lock" in second.stderr
    assert first.proc.poll() is None


def test_serve_waits_for_a_broker_that_is_still_starting(service_factory, speech: Path) -> None:
    need(subprocess.run(["which", "mosquitto"], capture_output=True).returncode == 0, "mosquitto not installed")
    broker = Broker("127.0.0.1", free_port(), "mosquitto")
    svc = service_factory(broker, [speech])
    svc.start(wait_online=False)
    time.sleep(2)  # the broker comes up two seconds after the service (systemd start order)
    assert svc.proc.poll() is None, svc.log()
    conf = Path(svc.data_dir.parent / "late.conf")
    conf.write_text(f"listener {broker.port} 127.0.0.1\nallow_anonymous true\n")
    late = subprocess.Popen(["mosquitto", "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        watcher = wait_until(lambda: _try_watch(svc), 30, "the service to come online")
        wait_until(lambda: watcher.on(f"{svc.base}/status")[-1:] == [b"online"], 30, "online")
        watcher.close()
        assert svc.stop() == 0
    finally:
        stop_mosquitto(late)


def _try_watch(svc):
    try:
        return svc.watcher("status")
    except (OSError, AssertionError):
        return None


@pytest.mark.slow
def test_more_retained_jobs_than_mqtt_message_ids_are_all_republished(
    service_factory, speech: Path, tmp_path: Path
) -> None:
    # paho numbers QoS 1 messages with 16-bit ids; 70,000 retained job topics at start-up
    # must all arrive, not 65,535 of them.
    need(subprocess.run(["which", "mosquitto"], capture_output=True).returncode == 0, "mosquitto not installed")
    from edge_queue.rules.states import JobState
    from edge_queue.store import JobSpec, Store

    port = free_port()
    conf = tmp_path / "big.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\nmax_queued_messages 0\nset_tcp_nodelay true\n")
    proc = subprocess.Popen(["mosquitto", "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: port_open("127.0.0.1", port), 10, "private mosquitto")
        broker = Broker("127.0.0.1", port, "mosquitto", proc)
        svc = service_factory(broker, [speech], {"EDGE_QUEUE_DURABILITY": "normal"})
        store = Store(svc.data_dir / "edge-queue.db", "normal")
        n = 70_000
        for start in range(0, n, 5000):
            store.submit([JobSpec("noop", f"x{i}", {}) for i in range(start, start + 5000)], 1.0, as_batch=True)
        store.conn.execute(
            "UPDATE jobs SET state = ?, finished_at = ?", [JobState.CANCELLED.value, "2099-01-01T00:00:00.000Z"]
        )
        store.close()
        watcher = svc.watcher("jobs/+")
        svc.start(wait_online=False)
        wait_until(lambda: len({t for t, *_ in watcher.messages}) >= n, 120, f"{n} retained job topics", interval=0.5)
        assert len({t for t, *_ in watcher.messages}) == n
        watcher.close()
        assert svc.stop() == 0
    finally:
        stop_mosquitto(proc)


def test_a_new_store_finding_job_state_on_the_broker_says_so(mosquitto, service_factory, speech: Path) -> None:
    # Given a service that ran jobs and a batch, whose store is then deleted (replaced by mistake)
    svc = service_factory(mosquitto, [speech]).start()
    watcher = svc.watcher("response/#", "jobs/+", "batches/+")
    ids = [svc.request("submit", {"kind": "noop"}, watcher)["data"]["jobs"][0]["job_id"] for _ in range(3)]
    batch = svc.request("submit", {"kind": "noop", "inputs": ["a", "b"]}, watcher)["data"]
    ids += [j["job_id"] for j in batch["jobs"]]
    for job_id in ids:
        watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] == "succeeded")
    watcher.wait_json(f"{svc.base}/batches/{batch['batch_id']}", lambda m: m["done"])
    assert svc.stop() == 0
    for name in ("edge-queue.db", "edge-queue.db-wal", "edge-queue.db-shm"):
        (svc.data_dir / name).unlink(missing_ok=True)
    # When it starts on a new, empty store
    svc.start()
    # Then the log says loudly that the new store met job state on the broker, before it clears it
    wait_until(lambda: "was created at this start, but the broker holds job state" in svc.log(), 20, "the warning")
    line = next(li for li in svc.log().splitlines() if "was created at this start" in li)
    assert line.startswith("ERROR") and str(svc.db) in line and "restore a backup" in line
    for job_id in ids:  # and the unknown jobs' retained state is cleared, as documented
        wait_until(lambda job_id=job_id: watcher.on(f"{svc.base}/jobs/{job_id}")[-1] == b"", 20, "a cleared topic")
    # and so is the unknown batch's (docs/topics.md, "Topics")
    batch_topic = f"{svc.base}/batches/{batch['batch_id']}"
    wait_until(lambda: watcher.on(batch_topic)[-1] == b"", 20, "the cleared batch topic")
    watcher.close()


def test_service_death_costs_an_attempt_only_to_jobs_that_started(
    shipped_mosquitto, service_factory, speech: Path
) -> None:
    # Given short jobs, which workers take up to 16 at a time (docs/topics.md, started_at), on
    # a broker that drops nothing to a slow watcher in the burst of 400
    svc = service_factory(shipped_mosquitto, [speech]).start()
    watcher = svc.watcher("response/#", "jobs/+", "queue")
    warm = svc.request("submit", {"kind": "noop", "inputs": [f"w{i}" for i in range(10)]}, watcher)
    for job in warm["data"]["jobs"]:
        watcher.wait_json(f"{svc.base}/jobs/{job['job_id']}", lambda m: m["state"] == "succeeded")
    resp = svc.request(
        "submit", {"kind": "noop", "options": {"sleep_s": 0.01}, "inputs": [f"j{i}" for i in range(400)]}, watcher
    )
    ids = [j["job_id"] for j in resp["data"]["jobs"]]
    # When the service is killed while its workers hold several of them each
    wait_until(
        lambda: any(q["counts"]["running"] > 2 for q in watcher.json_on(f"{svc.base}/queue")), 30, "workers holding >2"
    )
    conn = sqlite3.connect(svc.db)
    held = conn.execute("SELECT count(*) FROM jobs WHERE state = 'running'").fetchone()[0]
    conn.close()
    svc.kill()
    svc.start()
    for job_id in ids:
        watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] == "succeeded", timeout=60)
    # Then only the jobs a worker had started (one per worker) lost an attempt
    conn = sqlite3.connect(svc.db)
    again = conn.execute(
        f"SELECT count(*) FROM jobs WHERE attempt > 1 AND job_id IN ({','.join('?' * len(ids))})", ids
    ).fetchone()[0]
    conn.close()
    assert held > 2, held
    assert again <= 2, f"{again} jobs lost an attempt; {held} were held by workers"
    watcher.close()


def test_a_new_store_and_its_folder_are_the_service_users_alone(mosquitto, service_factory, speech: Path) -> None:
    # Given no data_dir yet, and a umask that would let everyone read new files
    svc = service_factory(mosquitto, [speech])
    assert not svc.data_dir.exists()
    old = os.umask(0o022)
    try:
        svc.start()
    finally:
        os.umask(old)
    # Then the folder and the store (every transcript is in it) are the service user's alone
    assert svc.data_dir.stat().st_mode & 0o077 == 0, oct(svc.data_dir.stat().st_mode)
    assert svc.db.stat().st_mode & 0o077 == 0, oct(svc.db.stat().st_mode)


def test_a_partly_purged_batch_is_published_again_without_the_purged_jobs(
    broker, service_factory, speech: Path
) -> None:
    # Given a finished batch of two jobs
    svc = service_factory(broker, [speech]).start()
    watcher = svc.watcher("response/#", "batches/+")
    sub = svc.request(
        "submit", {"kind": "probe", "inputs": [str(speech / "jfk.flac"), str(speech / "librivox-0870.wav")]}, watcher
    )
    batch_id, (a, b) = sub["data"]["batch_id"], [j["job_id"] for j in sub["data"]["jobs"]]
    topic = f"{svc.base}/batches/{batch_id}"
    watcher.wait_json(topic, lambda m: m["done"])
    # When one of its jobs is purged
    assert svc.request("purge", {"job_id": a}, watcher)["data"]["purged"] == [a]
    # Then the retained batch lists the other one only; purging that one clears the batch
    watcher.wait_json(topic, lambda m: m["job_ids"] == [b] and m["total"] >= 1)
    assert svc.request("purge", {"job_id": b}, watcher)["data"]["purged"] == [b]
    wait_until(lambda: watcher.on(topic)[-1] == b"", 10, "the batch topic cleared")


def test_events_of_one_turns_outcomes_go_out_in_event_id_order(tmp_path: Path) -> None:
    """A turn's successes are stored together (their events numbered first); a report the
    general path decides (a job being cancelled) comes after them in event_id order, whatever
    its place among the reports (docs/topics.md, "Events": in order; a catch-up client keeps
    only events past the last id it saw)."""
    import json

    from edge_queue.config.settings import Settings
    from edge_queue.rules.states import JobState
    from edge_queue.service import Service
    from edge_queue.store import JobSpec, Store
    from edge_queue.workers.supervisor import Outcome

    now = 1_000_000.0
    svc = Service(Settings(data_dir=tmp_path), clock=lambda: now)
    svc.store = Store(tmp_path / "q.db")
    sent: list[tuple[str, bytes]] = []
    svc.bridge.publish = lambda topic, payload, retain=False, **_: sent.append((topic, payload))  # no broker here
    ids = [svc.store.submit([JobSpec("noop", f"in{i}", {})], now)[1][0].job["job_id"] for i in range(3)]
    assert len(svc.store.claim_many(now, ["noop"], svc.run_id, 3)) == 3
    svc.store.transition(ids[0], JobState.CANCELLING, now)  # cancelled while it ran
    sent.clear()
    with svc.store.group():
        svc.outcomes.apply_all([Outcome("done", job_id, 1, {"result": {}}) for job_id in ids], now)
    events = [json.loads(p) for t, p in sent if t == svc.topics.events]
    assert sorted(e["job"]["job_id"] for e in events) == sorted(ids)
    order = [e["event_id"] for e in events]
    assert order == sorted(order) and len(set(order)) == 3, events
    svc.close()


def test_a_persistent_broker_restoring_an_older_save_is_not_taken_for_a_replaced_store(
    service_factory, speech: Path, tmp_path: Path
) -> None:
    # Given a service on a new store, against a persistent mosquitto, done with its first read
    # of the retained job topics
    from .helpers.brokers import PrivateMosquitto

    broker = PrivateMosquitto(tmp_path / "broker")
    try:
        svc = service_factory(broker, [speech]).start()
        wait_until(lambda: "retained job and" in svc.log(), 30, "the first read")
        # When the broker restarts and restores a save that holds a job this store never had
        # (before: logged as an ERROR telling to restore a backup, as for a replaced store)
        ghost = "0mx1aaaaaaaaaaaa"
        publish(broker, f"{svc.base}/jobs/{ghost}", json.dumps({"job_id": ghost, "state": "succeeded"}), retain=True)
        broker.stop()
        broker.start()
        # Then its state is cleared with a warning that says what likely happened
        wait_until(lambda: "clearing the retained state of jobs this store does not know" in svc.log(), 60, "the line")
        line = next(li for li in svc.log().splitlines() if "this store does not know" in li)
        assert line.startswith("WARNING") and "older save" in line, line
        assert "restore a backup" not in svc.log()
        assert svc.stop() == 0
    finally:
        if broker.proc is not None and broker.proc.poll() is None:
            broker.stop()


@pytest.mark.slow
def test_a_finished_jobs_retained_state_expires_from_the_broker_and_stays_in_the_store(
    mosquitto, service_factory, speech: Path
) -> None:
    # Given finished jobs' retained states that expire 3 s after the job ended (before: the
    # broker kept every stored job, and a new subscriber of jobs/+ got all of them: 100,100
    # messages in 7.7 s with 100,000 stored)
    svc = service_factory(mosquitto, [speech], {"EDGE_QUEUE_MQTT__FINISHED_EXPIRY_S": "3"}).start()
    watcher = svc.watcher("response/#", "jobs/+")
    done = svc.request("submit", {"kind": "noop", "inputs": [f"x{i}" for i in range(20)]}, watcher)["data"]["jobs"]
    waiting = svc.request("submit", {"kind": "noop", "run_at": "2999-01-01T00:00:00Z"}, watcher)["data"]["jobs"][0]
    for job in done:
        watcher.wait_json(f"{svc.base}/jobs/{job['job_id']}", lambda m: m["state"] == "succeeded", 30)
    assert {f"{svc.base}/jobs/{j['job_id']}" for j in done} <= retained_under(mosquitto, svc.base)
    # When they have been over for longer than that, then a new subscriber gets only the job
    # still waiting, and the store still answers for all
    only_waiting = {f"{svc.base}/jobs/{waiting['job_id']}"}
    wait_until(
        lambda: {t for t in retained_under(mosquitto, svc.base) if "/jobs/" in t} == only_waiting, 15, "the expiry"
    )
    got = svc.request("get", {"job_id": done[0]["job_id"]}, watcher)
    assert got["data"]["state"] == "succeeded"
    # and a republish (as at every reconnect) does not bring them back
    svc.request("republish", {}, watcher)
    wait_until(lambda: "republished the retained state of 21 job(s)" in svc.log(), 30, "the republish")
    retained = {t for t in retained_under(mosquitto, svc.base) if "/jobs/" in t}
    assert retained == only_waiting, retained


def test_a_finished_state_sent_again_after_a_reconnect_keeps_its_expiry(tmp_path: Path) -> None:
    # Given the service's bridge on a private mosquitto that freezes (SIGSTOP) just before the
    # bridge writes a finished job's retained state with its Message Expiry: on the socket,
    # never read (the service's short publish path keeps the message for paho to send again)
    from edge_queue.config.settings import MqttSettings
    from edge_queue.mqtt.bridge import Bridge
    from edge_queue.mqtt.topics import Topics

    from .helpers.brokers import PrivateMosquitto

    broker = PrivateMosquitto(tmp_path / "broker")
    base = "eqt" + uuid.uuid4().hex[:10]
    settings = MqttSettings(host=broker.host, port=broker.port, base_topic=base, protocol="5")
    bridge = Bridge(settings, Topics(base), client_id="svc-" + base)
    topic = f"{base}/jobs/0mx1aaaaaaaaaaaa"
    got: list[mqtt.MQTTMessage] = []
    sub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="sub-" + base, protocol=mqtt.MQTTv5)
    try:
        bridge.connect(10)
        assert broker.proc is not None
        os.kill(broker.proc.pid, signal.SIGSTOP)
        bridge.publish(topic, b'{"state": "succeeded"}', retain=True, expiry_s=3600)
        bridge.pump(time.monotonic())
        assert bridge.unacked == 1
        # When the broker dies there (its save never had the message) and starts again
        os.kill(broker.proc.pid, signal.SIGKILL)
        broker.proc.wait(10)
        broker.start()

        def pumped() -> bool:
            bridge.pump(time.monotonic())
            return bridge.connected and bridge.connection == 2 and bridge.unacked == 0

        wait_until(pumped, 30, "the bridge to reconnect and its message to be acknowledged")
        # Then paho sent it again with its expiry: a subscriber gets it retained, expiring
        sub.on_message = lambda c, u, m: got.append(m)
        sub.connect(broker.host, broker.port)
        sub.subscribe(topic, 1)
        sub.loop_start()
        wait_until(lambda: got, 10, "the retained state")
        assert got[0].retain and got[0].payload == b'{"state": "succeeded"}'
        assert 0 < got[0].properties.MessageExpiryInterval <= 3600
    finally:
        stop_client(sub)
        bridge.close(offline=False, timeout_s=1)
        if broker.proc is not None and broker.proc.poll() is None:
            broker.stop()


def _park(broker: Broker, client_id: str, topic: str) -> None:
    """A persistent MQTT 3.1.1 session that subscribes to ``topic`` at QoS 1 and goes away
    without reading anything (raw packets: no client library acknowledges for it)."""

    def utf8(text: str) -> bytes:
        return len(text).to_bytes(2, "big") + text.encode()

    def packet(kind: int, body: bytes) -> bytes:
        assert len(body) < 128
        return bytes([kind, len(body)]) + body

    with socket.create_connection((broker.host, broker.port), 5) as s:
        s.sendall(packet(0x10, utf8("MQTT") + bytes([4, 0]) + (60).to_bytes(2, "big") + utf8(client_id)))
        assert s.recv(4)[:2] == b"\x20\x02"
        s.sendall(packet(0x82, (1).to_bytes(2, "big") + utf8(topic) + bytes([1])))
        wait_until(lambda: len(s.recv(1)) == 1, 10, "the SUBACK to be on its way")


def test_a_parked_session_holds_no_finished_job_once_its_state_expired(shipped_mosquitto, service_factory) -> None:
    # Given finished jobs whose retained states expire 3 s after they ended, a job still
    # waiting, and a session parked on <base>/jobs/+ by a client that never reads (before: a
    # parked session kept every stored job's state, 10 MiB per session with 50,000 jobs)
    broker = shipped_mosquitto
    svc = service_factory(broker, [], {"EDGE_QUEUE_MQTT__FINISHED_EXPIRY_S": "3"}).start()
    watcher = svc.watcher("response/#", "jobs/+")
    done = svc.request("submit", {"kind": "noop", "inputs": [f"x{i}" for i in range(50)]}, watcher)["data"]["jobs"]
    waiting = svc.request("submit", {"kind": "noop", "run_at": "2999-01-01T00:00:00Z"}, watcher)["data"]["jobs"][0]
    for job in done:
        watcher.wait_json(f"{svc.base}/jobs/{job['job_id']}", lambda m: m["state"] == "succeeded", 30)
    watcher.close()
    parked = "parked-" + uuid.uuid4().hex[:8]
    _park(broker, parked, f"{svc.base}/jobs/+")
    # When the states have expired and the parked client comes back to its session
    only_waiting = {f"{svc.base}/jobs/{waiting['job_id']}"}
    wait_until(lambda: {t for t in retained_under(broker, svc.base) if "/jobs/" in t} == only_waiting, 15, "the expiry")
    got: list[str] = []
    back = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=parked, clean_session=False)
    back.on_message = lambda c, u, m: got.append(m.topic)
    back.connect(broker.host, broker.port)
    back.loop_start()
    marker = f"{svc.base}/jobs/zz-marker"
    try:
        # a message sent after it is back comes after everything its session held
        wait_until(lambda: back.is_connected(), 10, "the reconnect")
        publish(broker, marker, "after")
        wait_until(lambda: marker in got, 30, "the marker")
    finally:
        back.disconnect()
        back.loop_stop()
    # Then the session held the waiting job's state only: the broker dropped the expired ones
    assert set(got) - {marker} == only_waiting, sorted(set(got))[:5]
