"""Several edge-queue installations and one broker (docs/operations.md, "Several boxes on one
broker"): an identity per installation, one service per base topic, and a client-id take-over
said as such. Against a private mosquitto whose log shows every connection."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from .conftest import ServiceProcess, publish, retained_under, run_doctor, wait_until
from .helpers.brokers import PrivateMosquitto
from .helpers.figures import figures


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[PrivateMosquitto]:
    """A private mosquitto whose log shows every connection, stopped after the test."""
    broker = PrivateMosquitto(tmp_path / "broker")
    try:
        yield broker
    finally:
        broker.stop()


def _default_id(svc: ServiceProcess) -> ServiceProcess:
    """Leave the client id to the service (the tests' services set one each otherwise)."""
    svc.env.pop("EDGE_QUEUE_MQTT__CLIENT_ID", None)
    return svc


def _info(svc: ServiceProcess) -> dict[str, Any]:
    w = svc.watcher("info")
    try:
        return w.wait_json(f"{svc.base}/info", lambda m: True)
    finally:
        w.close()


@pytest.mark.slow
def test_two_default_installs_on_one_broker_keep_to_themselves(tmp_path: Path, service_factory) -> None:
    # Given two installs with default settings but their data folder and base topic
    broker = PrivateMosquitto(tmp_path / "broker")
    try:
        media = tmp_path / "media"  # data_dir may not lie inside a media root
        media.mkdir()
        a = _default_id(service_factory(broker, [media]))
        a.data_dir = tmp_path / "a"
        a.env["EDGE_QUEUE_DATA_DIR"] = str(a.data_dir)
        b = _default_id(ServiceProcess(broker, tmp_path, [media]))
        b.data_dir = tmp_path / "b"
        b.env["EDGE_QUEUE_DATA_DIR"] = str(b.data_dir)
        a.start()
        b.start()
        # Then each has its own instance id and client id, the broker never closed one for the
        # other, and each one's jobs keep their retained state
        ia, ib = _info(a), _info(b)
        assert ia["instance_id"] != ib["instance_id"] and len(ia["instance_id"]) == 12
        for svc in (a, b):
            watcher = svc.watcher("response/#", "jobs/+")
            job_id = svc.request("submit", {"kind": "noop"}, watcher)["data"]["jobs"][0]["job_id"]
            watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] == "succeeded")
            watcher.close()
        a.stop()
        a.start()  # a restart keeps the identity (and so the client id and its session)
        assert _info(a)["instance_id"] == ia["instance_id"]
        log = broker.log.read_text()
        for info in (ia, ib):
            assert f"edge-queue-{info['instance_id']}" in log
        assert "already connected" not in log and "taken over" not in log.lower(), log[-2000:]
        figures(broker_log=[line for line in log.splitlines() if "as edge-queue-" in line and "-scan-" not in line])
        assert b.stop() == 0
    finally:
        if b.proc is not None and b.proc.poll() is None:
            b.stop()
        broker.stop()


def test_a_second_install_on_a_taken_base_topic_does_not_start(tmp_path: Path, service_factory, own_broker) -> None:
    # Given an install serving a base topic, with jobs
    broker = own_broker
    first = _default_id(service_factory(broker, [tmp_path])).start()
    watcher = first.watcher("response/#", "jobs/+")
    ids = [first.request("submit", {"kind": "noop"}, watcher)["data"]["jobs"][0]["job_id"] for _ in range(3)]
    for job_id in ids:
        watcher.wait_json(f"{first.base}/jobs/{job_id}", lambda m: m["state"] == "succeeded")
    info = _info(first)
    # When a second install (its own data folder) starts on the same base topic
    env = {**first.env, "EDGE_QUEUE_DATA_DIR": str(tmp_path.parent / f"{tmp_path.name}-second")}
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "edge_queue", "serve"], env=env, capture_output=True, text=True, timeout=60
    )
    # Then it exits at once with its own code and one line naming the other and what to change
    assert out.returncode == 5, out.stderr
    assert time.monotonic() - started < 15
    line = next(li for li in out.stderr.splitlines() if "another edge-queue is online" in li)
    assert info["instance_id"] in line and info["host"] in line and info["version"] in line
    assert "mqtt.base_topic" in line
    # and the first one's jobs and retained topics are untouched, and it still serves
    time.sleep(0.5)
    for job_id in ids:
        assert json.loads(watcher.on(f"{first.base}/jobs/{job_id}")[-1])["state"] == "succeeded"
    assert first.request("get", {"job_id": ids[0]}, watcher)["status"] == "ok"
    watcher.close()


@pytest.mark.slow
def test_a_replaced_data_dir_takes_its_base_topic_over(tmp_path: Path, service_factory, own_broker) -> None:
    # Given an install that ran jobs and stopped, whose data folder is then replaced
    broker = own_broker
    svc = _default_id(service_factory(broker, [tmp_path])).start()
    watcher = svc.watcher("response/#", "jobs/+", "batches/+")
    batch = svc.request("submit", {"kind": "noop", "inputs": ["a", "b"]}, watcher)["data"]
    for job in batch["jobs"]:
        watcher.wait_json(f"{svc.base}/jobs/{job['job_id']}", lambda m: m["state"] == "succeeded")
    old = _info(svc)["instance_id"]
    assert svc.stop() == 0
    svc.data_dir = tmp_path.parent / f"{tmp_path.name}-new-data"  # outside the media root
    svc.env["EDGE_QUEUE_DATA_DIR"] = str(svc.data_dir)
    # When it starts again
    svc.start()
    # Then it takes the base topic over (its own new identity), says so, and clears the
    # ghost job and batch topics
    assert _info(svc)["instance_id"] != old
    wait_until(lambda: "taking over the base topic" in svc.log() and old in svc.log(), 10, "the take-over line")
    for job in batch["jobs"]:
        topic = f"{svc.base}/jobs/{job['job_id']}"
        wait_until(lambda topic=topic: watcher.on(topic)[-1] == b"", 20, "a cleared job topic")
    wait_until(lambda: watcher.on(f"{svc.base}/batches/{batch['batch_id']}")[-1] == b"", 20, "the batch")
    watcher.close()


def test_another_install_announcing_itself_is_reported(tmp_path: Path, service_factory, own_broker) -> None:
    # Given a running install
    broker = own_broker
    svc = _default_id(service_factory(broker, [tmp_path])).start()
    alone = _info(svc)
    ours = alone["instance_id"]
    # issue 52, row 17: `conflict` is there when alone too (Home Assistant's templates warned
    # of the absent key at each of its starts and each reconnect)
    assert alone["conflict"] == [], alone
    watcher = svc.watcher("info", "response/#")
    # When another installation announces itself on its base topic (live, as at its connect)
    other = {"v": 1, "instance_id": "0123456789ab", "host": "otherbox", "version": "0.1.0"}
    pub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="other-" + uuid.uuid4().hex[:6])
    pub.connect(broker.host, broker.port)
    pub.loop_start()
    pub.publish(f"{svc.base}/info", json.dumps(other), qos=1).wait_for_publish(10)
    pub.loop_stop()
    pub.disconnect()
    # Then the log names it, and our own info lists it under conflict
    wait_until(lambda: "another edge-queue announced itself" in svc.log(), 10, "the error line")
    mine = watcher.wait_json(f"{svc.base}/info", lambda m: m.get("instance_id") == ours and m["conflict"])
    assert mine["conflict"][0]["instance_id"] == "0123456789ab" and mine["conflict"][0]["host"] == "otherbox"
    # And issue 52, row 19: once the other box is gone, a republish clears it (before: listed
    # until the service restarted)
    seen = len(watcher.on(f"{svc.base}/info"))
    svc.request("republish", {}, watcher)
    wait_until(lambda: len(watcher.on(f"{svc.base}/info")) > seen, 10, "info republished")
    assert json.loads(watcher.on(f"{svc.base}/info")[-1])["conflict"] == []
    watcher.close()


@pytest.mark.slow
def test_a_client_id_take_over_is_said_as_such(tmp_path: Path, service_factory, own_broker) -> None:
    # Given a running install with its default client id
    broker = own_broker
    svc = _default_id(service_factory(broker, [tmp_path])).start()
    with sqlite3.connect(svc.db) as conn:
        (secret,) = conn.execute("SELECT value FROM store_meta WHERE key = 'client_id_secret'").fetchone()
    info = _info(svc)
    client_id = f"edge-queue-{info['instance_id']}-{secret:016x}"
    assert f"{secret:016x}" not in json.dumps(info)  # the id cannot be guessed from what is published
    # When another client keeps connecting with that client id (as a second service with
    # the same mqtt.client_id does: each takes the id from the other)
    thief = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    thief.reconnect_delay_set(1, 1)
    thief.connect(broker.host, broker.port, clean_start=False)
    thief.loop_start()
    # Then the service says what is happening, and waits before it reconnects
    try:
        wait_until(lambda: "another client connected with our client id" in svc.log(), 60, "the take-over line")
    finally:
        thief.loop_stop()
        thief.disconnect()
    assert "reconnecting in 10 s" in svc.log()
    line = next(li for li in svc.log().splitlines() if "another client connected with our client id" in li)
    assert line.startswith("ERROR") and client_id in line
    # and it comes back once the other client is gone
    before = svc.log().count("connected to 127.0.0.1")
    wait_until(lambda: svc.log().count("connected to 127.0.0.1") > before, 30, "the reconnect")
    watcher = svc.watcher("response/#")
    assert svc.request("list", {"limit": 1}, watcher)["status"] == "ok"
    watcher.close()


@pytest.mark.slow
def test_a_renamed_base_topic_says_how_to_clear_the_old_one_and_doctor_sees_it(
    mosquitto, service_factory, tmp_path: Path, mosquitto_clients: None
) -> None:
    # Given an installation that served on one base topic
    svc = service_factory(mosquitto, [tmp_path]).start()
    watcher = svc.watcher("response/#")
    svc.request("submit", {"kind": "noop"}, watcher)
    assert svc.stop() == 0
    old = svc.base
    # When it starts again with another mqtt.base_topic (before: nothing said the old base's
    # retained topics stay on the broker)
    svc.base = old + "new"
    svc.env["EDGE_QUEUE_MQTT__BASE_TOPIC"] = svc.base
    svc.start()
    # Then it says so once, with the command that clears them
    line = next(li for li in svc.log().splitlines() if "mqtt.base_topic changed" in li)
    assert line.startswith("WARNING") and f"-t '{old}/#' --remove-retained" in line, line
    assert f"{old}/status" in retained_under(mosquitto, old)
    # and doctor sees the old base's retained topics
    doctor = run_doctor(svc.env)
    assert "warn  base topic: the broker still holds retained topics of the old base" in doctor.stdout, doctor.stdout
    # which the command clears, and then doctor has nothing to say of them
    command = line.split("clear them with: ", 1)[1]
    subprocess.run(command, shell=True, check=False, timeout=30, capture_output=True)
    assert retained_under(mosquitto, old) == set()
    assert "base topic" not in run_doctor(svc.env).stdout


@pytest.mark.slow
def test_an_installation_given_anothers_client_id_stops_and_leaves_it_every_request(
    mosquitto, service_factory, tmp_path: Path
) -> None:
    # Given an installation serving its household, and a second one, on its own base topic,
    # started with the same client id (before: each acknowledged the other's requests and
    # dropped them, with no response; then an ERROR line, and still no response)
    (tmp_path / "b").mkdir()
    a = service_factory(mosquitto, [tmp_path])
    b = service_factory(mosquitto, [tmp_path])
    b.data_dir = tmp_path.parent / f"{tmp_path.name}-b-data"  # outside the media root
    b.log_path = tmp_path / "b" / "service.log"
    a.env["EDGE_QUEUE_MQTT__CLIENT_ID"] = b.env["EDGE_QUEUE_MQTT__CLIENT_ID"] = "shared-" + a.base
    b.env["EDGE_QUEUE_DATA_DIR"] = str(b.data_dir)
    a.start()
    answers = a.watcher("response/#")
    b.start(wait_online=False)
    # When the household keeps submitting to the first one, a few a second
    sent: list[str] = []

    def send_until_b_exits() -> bool:
        sent.append(f"t{len(sent)}")
        publish(mosquitto, f"{a.base}/request/submit", json.dumps({"kind": "noop", "transaction": sent[-1]}))
        return b.proc.poll() is not None

    wait_until(send_until_b_exits, 90, "the second installation to stop", 0.2)
    # Then the second one stops with the documented exit code and one ERROR line naming the id
    assert b.proc.wait(30) == 6, b.log()
    errors = [li for li in b.log().splitlines() if li.startswith("ERROR")]
    assert len(errors) == 1 and "shared-" + a.base in errors[0] and "exit code 6" in errors[0], b.log()
    # and every request sent to the first one is answered by it, exactly once: the ones the
    # second one received were left unacknowledged, and the broker gave them to their owner
    for extra in range(5):  # and it goes on serving
        sent.append(f"after{extra}")
        publish(mosquitto, f"{a.base}/request/submit", json.dumps({"kind": "noop", "transaction": sent[-1]}))

    def answered() -> list[str]:
        return [m["transaction"] for t, p, *_ in answers.messages if "/response/" in t for m in [json.loads(p)]]

    wait_until(lambda: set(answered()) >= set(sent), 90, "an answer to every request")
    assert set(answered()) == set(sent)
    # each made one job: a request delivered again after a lost PUBACK (the two take the
    # connection from each other meanwhile) is answered again with the same job
    jobs: dict[str, set[str]] = {}
    for t, p, *_ in answers.messages:
        if "/response/" in t:
            body = json.loads(p)
            assert body["status"] == "ok", body
            jobs.setdefault(body["transaction"], set()).add(body["data"]["jobs"][0]["job_id"])
    assert all(len(ids) == 1 for ids in jobs.values()), {t: ids for t, ids in jobs.items() if len(ids) > 1}
    answers.close()
    assert "our MQTT session received" not in a.log()
    assert a.stop() == 0


@pytest.mark.slow
def test_an_installation_given_anothers_client_id_stops_with_no_request_arriving(
    mosquitto, service_factory, tmp_path: Path
) -> None:
    # Given an installation serving, and a second one started with the same client id, its own
    # base topic and data, and no request arriving for either (before: the two took the session
    # from each other for ever, an ERROR line each every 20 s)
    a = service_factory(mosquitto, [tmp_path])
    b = service_factory(mosquitto, [tmp_path])
    b.data_dir = tmp_path.parent / f"{tmp_path.name}-b-data"
    b.log_path = tmp_path / "b.log"
    a.env["EDGE_QUEUE_MQTT__CLIENT_ID"] = b.env["EDGE_QUEUE_MQTT__CLIENT_ID"] = "idle-" + a.base
    b.env["EDGE_QUEUE_DATA_DIR"] = str(b.data_dir)
    a.start()
    b.start(wait_online=False)
    # When the first takes its session back
    assert b.proc is not None
    wait_until(lambda: b.proc.poll() is not None, 120, "the second installation to stop")
    # Then the second one, which found a session it did not make, stops with the documented
    # exit code and one ERROR line naming the id
    assert b.proc.wait(30) == 6, b.log()
    errors = [li for li in b.log().splitlines() if li.startswith("ERROR")]
    assert len(errors) == 1 and "idle-" + a.base in errors[0] and "exit code 6" in errors[0], b.log()
    # and the first goes on serving
    answers = a.watcher("response/#")
    assert a.request("list", {}, answers)["status"] == "ok"
    answers.close()
    assert a.proc is not None and a.proc.poll() is None
    assert a.stop() == 0


def test_the_owner_of_a_shared_session_never_stops_for_the_others_requests(mosquitto, service_factory) -> None:
    # Given an installation serving on its own session, into which another client with its id
    # put a subscription to another base's requests (as a second installation given the same
    # mqtt.client_id does, leaving its requests behind when it stops: before, the owner took
    # them for a sign that it was the one to stop, and both stopped)
    a = service_factory(mosquitto, [])
    a.env["EDGE_QUEUE_MQTT__CLIENT_ID"] = client_id = "owner-" + a.base
    a.start()
    other = a.base + "x"
    thief = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=False)
    subscribed: list[int] = []
    thief.on_subscribe = lambda c, u, mid, codes, p: subscribed.append(mid)
    thief.on_connect = lambda c, u, f, r, p: c.subscribe(f"{other}/request/#", 1)
    thief.connect(mosquitto.host, mosquitto.port)
    thief.loop_start()
    wait_until(lambda: subscribed, 10, "the other client's subscription")
    thief.loop_stop()
    thief.disconnect()
    # When the other base's request reaches the session, now the owner's again
    answers = a.watcher("response/#")
    publish(mosquitto, f"{other}/request/submit", json.dumps({"kind": "noop", "transaction": "theirs"}))
    said = "a request of another installation"
    wait_until(lambda: said in a.log(), 60, "the line about the other installation's request")
    # Then it says so once, and serves on: its own requests are answered
    lines = [li for li in a.log().splitlines() if said in li]
    assert len(lines) == 1 and lines[0].startswith("ERROR") and "its requests wait in the session" in lines[0]
    assert a.request("list", {"limit": 1}, answers)["status"] == "ok"
    assert a.proc.poll() is None, a.log()[-2000:]
    answers.close()
    assert a.stop() == 0
