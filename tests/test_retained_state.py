"""Retained state on the broker across broker restarts, expiry, reconnects and replaced stores
(docs/topics.md, "States"): real brokers, real services."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from .conftest import (
    Broker,
    need,
    port_open,
    publish,
    retained_under,
    stop_client,
    stop_mosquitto,
    wait_until,
)
from .helpers.ports import free_port


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
