"""Nothing lost, nothing stuck (docs/topics.md, "States"): real processes, real signals, real brokers."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from .conftest import (
    REFERENCE,
    descendants,
    publish,
    wait_until,
    wer,
)


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
