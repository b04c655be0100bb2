"""A disk that fills up (docs/operations.md, "Load and back-pressure"): refused submits, answers
that cost space, failed commits and jobs out of space, with the real service on a small file
system.

Every test runs the real service process against a private mosquitto started with the delivery
settings of the shipped broker/mosquitto.conf, under a systemd-like watchdog: a NOTIFY_SOCKET
listener that kills the service with SIGABRT, as systemd does, when its WATCHDOG=1 pings stop
for longer than WatchdogSec. No test here may end with the watchdog having fired.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import (
    SPEECH,
    need,
    publish,
    wait_until,
)
from .helpers.brokers import PrivateMosquitto
from .helpers.figures import figures
from .helpers.load_rig import (
    Publisher,
    Responses,
    Rig,
    stop_and_longest_turn_ms,
)


#: The service's resident memory must stay under this, whatever the load (MiB).
@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 32 MiB tmpfs: a disk that really fills up."""
    need(os.geteuid() == 0, "mounting a tmpfs needs root")
    folder = tmp_path / "small"
    folder.mkdir()
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(folder)], capture_output=True)
    need(ok.returncode == 0, f"cannot mount a tmpfs here: {ok.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=False)


def _fill(path: Path, leave_mb: float) -> None:
    """Write a file until only about ``leave_mb`` MiB are free (0: until the disk is full)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while leave_mb == 0 or shutil.disk_usage(path.parent).free > leave_mb * 2**20 + 65536:
            os.write(fd, b"\0" * (65536 if leave_mb else 4096))
    except OSError:
        pass  # ENOSPC: full
    finally:
        os.close(fd)


def _until_answered(pub: Publisher, responses: Responses, body: dict[str, Any], done: Any, what: str) -> dict[str, Any]:
    """Send ``body`` (a fresh transaction each time) until its answer satisfies ``done``."""
    tries = iter(range(10**6))

    def attempt() -> dict[str, Any] | None:
        tx = f"probe{next(tries)}-{uuid.uuid4().hex[:6]}"
        pub.request("submit", {**body, "transaction": tx})
        wait_until(lambda: responses.count[tx], 30, f"the answer to {tx}", 0.01)
        answer = responses.bodies[tx]
        return answer if done(answer) else None

    return wait_until(attempt, 30, what, 0.25)


LATER = {"kind": "noop", "run_at": "2999-01-01T00:00:00Z"}  # waits: its row stays in the store


@pytest.mark.slow
def test_low_disk_refuses_submits_and_serves_the_rest(
    shipped_mosquitto: PrivateMosquitto, tmp_path: Path, small_disk: Path, rig: Callable[..., Rig]
) -> None:
    r = rig(shipped_mosquitto, small_disk, {"EDGE_QUEUE_LIMITS__MIN_FREE_DISK_MB": "8"})
    svc, responses, pub = r.start()
    for i in range(20):  # acknowledged work that must survive
        pub.request("submit", {**LATER, "transaction": f"keep{i}", "idempotency_key": f"keep{i}"})
    wait_until(lambda: responses.answered([f"keep{i}" for i in range(20)]) == 20, 30, "20 answers")
    _fill(small_disk / "filler", leave_mb=4)
    refused = _until_answered(pub, responses, LATER, lambda a: a["status"] == "error", "a refused submit")
    assert refused["error"]["code"] == "disk_full" and "min_free_disk_mb" in refused["error"]["message"]
    for tx, command, body in (
        ("low-list", "list", {"limit": 3}),
        ("low-cancel", "cancel", {"job_id": responses.bodies["keep0"]["data"]["jobs"][0]["job_id"]}),
        ("low-purge", "purge", {"older_than_s": 0}),
    ):
        pub.request(command, {**body, "transaction": tx})
        wait_until(lambda tx=tx: responses.count[tx], 30, f"the answer to {tx}")
        assert responses.bodies[tx]["status"] == "ok", responses.bodies[tx]
    (small_disk / "filler").unlink()
    _until_answered(pub, responses, LATER, lambda a: a["status"] == "ok", "a submit accepted again")
    stop_and_longest_turn_ms(svc)
    conn = sqlite3.connect(svc.db)
    keys = {r[0] for r in conn.execute("SELECT key FROM idempotency_keys")}
    assert {f"keep{i}" for i in range(20)} <= keys
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()


def test_a_full_disk_costs_home_assistants_requests_answers_not_the_service(
    shipped_mosquitto: PrivateMosquitto, small_disk: Path, rig: Callable[..., Rig]
) -> None:
    # Given a service with Home Assistant discovery on, on a disk another program fills up
    # (before: a submit on the shared topic, as Home Assistant's Submit text sends, killed the
    # service while it stored <base>/ha/submit, and again at every start until space was freed)
    env = {"EDGE_QUEUE_LIMITS__MIN_FREE_DISK_MB": "0", "EDGE_QUEUE_HOMEASSISTANT__DISCOVERY": "true"}
    r = rig(shipped_mosquitto, small_disk, env)
    svc, responses, pub = r.start()
    _until_answered(pub, responses, LATER, lambda a: a["status"] == "ok", "a job")
    _fill(small_disk / "filler", leave_mb=0)
    # When Home Assistant goes away (its Last Will: edge-queue keeps its place in the event
    # log), comes back, and a submit comes on the shared topic
    publish(shipped_mosquitto, "homeassistant/status", "offline")
    publish(shipped_mosquitto, "homeassistant/status", "online")
    pub.request("submit", {**LATER, "transaction": "ha-full"})
    wait_until(lambda: responses.count["ha-full"], 30, "the submit's answer")
    # Then the submit is answered disk_full, and the service keeps serving
    assert responses.bodies["ha-full"]["error"]["code"] == "disk_full", responses.bodies["ha-full"]
    pub.request("list", {"limit": 1, "transaction": "ha-list"})
    wait_until(lambda: responses.count["ha-list"], 30, "the list's answer")
    assert svc.proc is not None and svc.proc.poll() is None, svc.log()[-3000:]
    (small_disk / "filler").unlink()
    _until_answered(pub, responses, LATER, lambda a: a["status"] == "ok", "a submit accepted again")
    stop_and_longest_turn_ms(svc)


def test_a_disk_that_fills_up_costs_answers_not_the_service(
    shipped_mosquitto: PrivateMosquitto, tmp_path: Path, small_disk: Path, rig: Callable[..., Rig]
) -> None:
    # No free-space guard: another program fills the disk under the service.
    r = rig(shipped_mosquitto, small_disk, {"EDGE_QUEUE_LIMITS__MIN_FREE_DISK_MB": "0"})
    svc, responses, pub = r.start()
    # a finished job with an output folder, to purge while the disk is full
    done = _until_answered(pub, responses, {"kind": "noop"}, lambda a: a["status"] == "ok", "a job")
    done_id = done["data"]["jobs"][0]["job_id"]
    conn = sqlite3.connect(svc.db)
    wait_until(
        lambda: conn.execute("SELECT state FROM jobs WHERE job_id = ?", [done_id]).fetchone()[0] == "succeeded",
        30,
        "the job to succeed",
    )
    conn.close()
    outputs = svc.data_dir / "outputs" / done_id
    outputs.mkdir(parents=True, exist_ok=True)
    (outputs / "result.txt").write_text("kept until the purge is committed")
    _fill(small_disk / "filler", leave_mb=0)
    pub.request("purge", {"job_id": done_id, "transaction": "purge-full"})
    wait_until(lambda: responses.count["purge-full"], 30, "the purge's answer")
    assert responses.bodies["purge-full"]["error"]["code"] == "disk_full"
    assert (outputs / "result.txt").exists()  # a purge that was not committed deleted nothing
    # requests with an empty payload (a valid pause; a submit that is not JSON) are requests
    # too: answered in a turn whose commit fails, as any other
    pub.request("pause", b"")
    pub.request("submit", b"")
    wait_until(lambda: responses.count[None] == 2, 30, "answers to the two empty requests")
    txs = []
    for i in range(40):  # 1,000 jobs each: the store must grow
        tx = f"full{i}"
        pub.request("submit", {**LATER, "inputs": [f"i{i}-{k}" for k in range(1000)], "transaction": tx})
        txs.append(tx)
    pub.request("list", {"limit": 1, "transaction": "full-list"})
    wait_until(lambda: responses.answered([*txs, "full-list"]) == len(txs) + 1, 120, "every answer", 0.2)
    assert max(responses.count[t] for t in txs) == 1
    codes = Counter(
        responses.bodies[t]["status"] if responses.bodies[t]["status"] == "ok" else responses.bodies[t]["error"]["code"]
        for t in txs
    )
    assert set(codes) <= {"ok", "disk_full"} and codes["disk_full"] > 0, codes
    assert svc.proc.poll() is None and "could not commit" in svc.log()
    accepted = [t for t in txs if responses.bodies[t]["status"] == "ok"]
    (small_disk / "filler").unlink()
    after = _until_answered(pub, responses, LATER, lambda a: True, "an answer after space was freed")
    assert after["status"] == "ok", after
    pub.request("purge", {"job_id": done_id, "transaction": "purge-room"})
    wait_until(lambda: responses.count["purge-room"], 30, "the purge's answer")
    assert responses.bodies["purge-room"]["data"]["purged"] == [done_id]
    wait_until(lambda: not outputs.exists(), 10, "the purged job's outputs to go")
    stop_and_longest_turn_ms(svc)
    conn = sqlite3.connect(svc.db)
    jobs = conn.execute("SELECT count(*) FROM jobs").fetchone()[0]
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
    figures(full_disk=dict(codes), jobs_kept=jobs)
    assert jobs >= 1000 * len(accepted) + 1  # every accepted batch was kept, and the later job


@pytest.mark.slow
def test_a_burst_of_batches_never_takes_free_space_below_the_limit(
    shipped_mosquitto: PrivateMosquitto, tmp_path: Path, small_disk: Path, rig: Callable[..., Rig]
) -> None:
    # Given 14 MiB free and limits.min_free_disk_mb 8; when one client sends 12 batches of
    # 1,000 jobs at once (before: free space was measured every 2 s, so the whole burst was
    # accepted and took the disk from 24 to 3.5 MiB)
    r = rig(shipped_mosquitto, small_disk, {"EDGE_QUEUE_LIMITS__MIN_FREE_DISK_MB": "8"})
    svc, responses, pub = r.start()
    _fill(small_disk / "filler", leave_mb=14)
    txs = [f"burst{i}" for i in range(12)]
    for tx in txs:
        pub.request("submit", {**LATER, "inputs": [f"{tx}-{k}" for k in range(1000)], "transaction": tx})
    wait_until(lambda: responses.answered(txs) == len(txs), 120, "every answer", 0.2)
    codes = Counter(
        responses.bodies[t]["status"] if responses.bodies[t]["status"] == "ok" else responses.bodies[t]["error"]["code"]
        for t in txs
    )
    stop_and_longest_turn_ms(svc)
    free_mb = shutil.disk_usage(small_disk).free / 2**20
    figures(burst=dict(codes), free_mb_after=round(free_mb, 1))
    # Then the batches that would cross the limit are refused with disk_full, and the disk
    # keeps its limit (the store's checkpointed size, after the stop)
    assert codes["disk_full"] > 0 and codes["ok"] > 0, codes
    assert free_mb >= 7.5, (free_mb, codes)


@pytest.mark.slow
def test_a_commit_that_fails_on_a_full_disk_logs_the_job_once(
    shipped_mosquitto: PrivateMosquitto, tmp_path: Path, small_disk: Path, rig: Callable[..., Rig]
) -> None:
    # Given a job that ends while the disk holding the store is full (no free-space guard):
    # before, each new try of the turn logged its success (or its retry, each with another
    # random delay) again: 719 lines in 40 s
    r = rig(shipped_mosquitto, small_disk, {"EDGE_QUEUE_LIMITS__MIN_FREE_DISK_MB": "0"})
    svc, responses, pub = r.start()
    job = _until_answered(pub, responses, {"kind": "noop", "options": {"sleep_s": 3}}, lambda a: True, "a job")
    job_id = job["data"]["jobs"][0]["job_id"]
    wait_until(lambda: f"job {job_id} started" in svc.log(), 30, "the job to start")
    _fill(small_disk / "filler", leave_mb=0)
    wait_until(lambda: svc.log().count("could not commit") >= 1, 30, "a failed commit")
    time.sleep(4)  # the job ended meanwhile; its turn is tried again and again
    assert svc.log().count(f"job {job_id} succeeded") == 0, svc.log()[-3000:]
    # When space comes back, the job is logged once, as committed
    (small_disk / "filler").unlink()
    wait_until(lambda: f"job {job_id} succeeded" in svc.log(), 30, "the success")
    stop_and_longest_turn_ms(svc)
    assert svc.log().count(f"job {job_id} succeeded") == 1
    assert svc.log().count("could not commit") <= 20  # rate-limited, counted in one line


@pytest.mark.slow
def test_a_job_that_runs_out_of_space_fails_disk_full_and_is_retried(
    shipped_mosquitto: PrivateMosquitto, tmp_path: Path, small_disk: Path, rig: Callable[..., Rig]
) -> None:
    # Given a recording on a full disk (the store on another one), and a job writing beside it
    need((SPEECH / "jfk.flac").is_file(), f"speech recordings not found in {SPEECH}")
    media = small_disk / "media"
    media.mkdir()
    shutil.copy(SPEECH / "jfk.flac", media / "jfk.flac")
    (tmp_path / "store").mkdir()
    r = rig(shipped_mosquitto, tmp_path / "store", {"EDGE_QUEUE_MEDIA_ROOTS": json.dumps([str(media)])})
    _fill(small_disk / "filler", leave_mb=0)
    svc, responses, pub = r.start()
    body = {"kind": "extract_audio", "input": str(media / "jfk.flac"), "options": {"output": "beside", "format": "wav"}}
    job = _until_answered(pub, responses, body, lambda a: True, "the job")
    job_id = job["data"]["jobs"][0]["job_id"]
    conn = sqlite3.connect(svc.db)

    def state() -> tuple[str, str | None]:
        row = conn.execute("SELECT state, error FROM jobs WHERE job_id = ?", [job_id]).fetchone()
        return row[0], row[1]

    # Then its attempt fails with disk_full (before: a retryable internal_error), and it waits
    # for its retry
    s, error = wait_until(lambda: state()[1] and state(), 60, "the failed attempt")
    assert json.loads(error)["code"] == "disk_full", error
    assert s == "retrying", s
    # And once space is freed, a later attempt succeeds
    (small_disk / "filler").unlink()
    wait_until(lambda: state()[0] == "succeeded", 120, "the retry to succeed", 0.5)
    conn.close()
    assert (media / "jfk.wav").stat().st_size > 100_000
    stop_and_longest_turn_ms(svc)
