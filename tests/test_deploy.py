"""Deploying it like an appliance (docs/operations.md, "Install"): systemd units and notifications, the
shipped broker configurations with passwords and ACL, TLS, doctor, backup."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from .conftest import ROOT, Broker, need, port_open, run_doctor, stop_mosquitto, wait_until
from .helpers.deploy import STATE_TOPICS, connect, make_ca, service_env
from .helpers.ports import free_port

EDGE_QUEUE_BIN = str(Path(sys.executable).parent / "edge-queue")


@pytest.mark.parametrize("unit", ["edge-queue.service", "edge-queue-broker.service", "edge-queue-worker.service"])
def test_systemd_analyze_verify(unit: str, tmp_path: Path) -> None:
    need(shutil.which("systemd-analyze") is not None, "systemd-analyze not installed (apt-get install systemd)")
    text = (ROOT / "systemd" / unit).read_text().replace("/opt/edge-queue/.venv/bin/edge-queue", EDGE_QUEUE_BIN)
    (tmp_path / unit).write_text(text)
    out = subprocess.run(
        ["systemd-analyze", "verify", str(tmp_path / unit)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and unit not in out.stderr, out.stderr


def test_unit_security_exposure(tmp_path: Path) -> None:
    # systemd's own rating of the unit's sandbox (docs/operations.md, "Sandbox")
    need(shutil.which("systemd-analyze") is not None, "systemd-analyze not installed (apt-get install systemd)")
    out = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(ROOT / "systemd" / "edge-queue.service")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    found = re.search(r"Overall exposure level for edge-queue.service: ([0-9.]+) (\w+)", out.stdout)
    assert found, out.stdout + out.stderr
    print(f"figures: systemd-analyze security: {found.group(1)} {found.group(2)}")
    assert float(found.group(1)) <= 2.0, out.stdout
    documented = re.search(
        r"`systemd-analyze security` rates it ([0-9.]+)", (ROOT / "docs" / "operations.md").read_text()
    )
    assert documented and documented.group(1) == found.group(1), "docs/operations.md states another score"


#: Started before the service: the unit's NoNewPrivileges (PR_SET_NO_NEW_PRIVS, inherited by
#: the worker processes) and UMask; then the service itself. (MemoryDenyWriteExecute, tried
#: the same way with PR_SET_MDWE, breaks CTranslate2: it is not in the unit.)
SANDBOX = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
assert libc.prctl(39, 0, 0, 0, 0) == 1  # PR_GET_NO_NEW_PRIVS: it holds
os.umask(0o027)
os.execv(sys.argv[1], sys.argv[1:])
"""


@pytest.mark.slow
def test_transcription_under_the_units_privilege_limits(
    mosquitto, service_factory, speech: Path, tmp_path: Path
) -> None:
    # Given the service started with the unit's NoNewPrivileges and UMask=0027
    svc = service_factory(mosquitto, [speech])
    svc.prefix = [sys.executable, "-c", SANDBOX]
    svc.start()
    watcher = svc.watcher("response/#", "jobs/+")
    # When it transcribes real speech with faster-whisper (CTranslate2) and PyAV
    resp = svc.request("submit", {"kind": "transcribe", "input": str(speech / "jfk.flac")}, watcher)
    job_id = resp["data"]["jobs"][0]["job_id"]
    final = watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] in ("succeeded", "failed"), 120)
    # Then it succeeds, and what it wrote is not readable by other users
    assert final["state"] == "succeeded", final
    assert "ask not what your country" in final["result"]["text"].lower()
    for path in final["result"]["outputs"].values():
        assert Path(path).stat().st_mode & 0o007 == 0, path
    assert svc.db.stat().st_mode & 0o007 == 0


def test_unit_settings() -> None:
    unit = (ROOT / "systemd" / "edge-queue.service").read_text()
    for setting in (
        "Type=notify",
        "WatchdogSec=",
        "Restart=on-failure",
        "KillSignal=SIGTERM",
        "KillMode=mixed",
        "TimeoutStopSec=",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ProtectHome=",
        "PrivateTmp=yes",
        "ReadWritePaths=/var/lib/edge-queue",
        "User=edge-queue",
    ):
        assert f"\n{setting}" in unit, setting
    # every setting is explained by a comment on the line above it
    lines = unit.splitlines()
    for i, line in enumerate(lines):
        if "=" in line and not line.startswith("#") and i and lines[i - 1] and not lines[i - 1].startswith("["):
            assert lines[i - 1].startswith("#") or "=" in lines[i - 1], line


def test_ready_and_watchdog_notifications(mosquitto, service_factory, speech: Path, tmp_path: Path) -> None:
    # Given a fake systemd notify socket
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(30)
    svc = service_factory(mosquitto, [speech], {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"})
    svc.start(wait_online=False)
    try:
        got: list[str] = []
        while not (any("READY=1" in m for m in got) and any(m == "WATCHDOG=1" for m in got)):
            got.append(sock.recv(4096).decode())
        ready = next(m for m in got if "READY=1" in m)
        assert f"MAINPID={svc.proc.pid}" in ready and "STATUS=serving" in ready
        # READY comes after the service is online on the broker
        w = svc.watcher("status")
        wait_until(lambda: w.on(f"{svc.base}/status") == [b"online"], 10, "online")
        w.close()
        assert svc.stop() == 0
        rest = []
        sock.settimeout(2)
        try:
            while True:
                rest.append(sock.recv(4096).decode())
        except TimeoutError:
            pass
        assert any("STOPPING=1" in m for m in rest)
    finally:
        sock.close()


def _acl_scenario(
    broker: Broker,
    service_factory,
    speech: Path,
    service_user: tuple[str, str],
    client_user: tuple[str, str],
    base: str = "edge-queue",
) -> dict[str, object]:
    """What an anonymous client and a client user can and cannot do; the service works."""
    seen: dict[str, object] = {}
    reason, _ = connect(broker, None, None)
    seen["anonymous"] = reason
    svc = service_factory(broker, [speech], service_env(*service_user, base))
    svc.base = base  # a base topic the shipped ACLs name
    svc.start(wait_online=False)
    reason, pair = connect(broker, *client_user)
    assert reason == "Success", reason
    client, box = pair
    user = client_user[0]
    # what the shipped ACLs let every user read, and its own replies
    box["subscriptions"] = [*(t.replace("edge-queue", base, 1) for t in STATE_TOPICS), f"{base}/reply/{user}/#"]
    for topic in box["subscriptions"]:
        client.subscribe(topic, 1)
    wait_until(
        lambda: any(t == f"{base}/status" and p == b"online" for t, p in box.get("messages", [])),
        60,
        "the client user to read the retained online status",
    )
    client.publish(f"{base}/request/submit/{user}", json.dumps({"kind": "noop", "transaction": "acl"}), qos=1)

    def resp():
        for t, p in box.get("messages", []):
            if t == f"{base}/reply/{user}/response/submit" and json.loads(p).get("transaction") == "acl":
                return json.loads(p)
        return None

    response = wait_until(resp, 30, "the submit response")
    job_id = response["data"]["jobs"][0]["job_id"]
    wait_until(
        lambda: any(
            t == f"{base}/jobs/{job_id}" and json.loads(p)["state"] == "succeeded"
            for t, p in box.get("messages", [])
            if p
        ),
        30,
        "the job to succeed",
    )
    seen["client submit"] = response["status"]
    # A forged job state from the client user (its own connection) never reaches subscribers
    reason, forger_pair = connect(broker, *client_user)
    forger = forger_pair[0]
    for topic, payload in (
        (f"{base}/jobs/forged0000000000", b'{"state": "succeeded"}'),
        (f"{base}/status", b"offline"),
    ):
        info = forger.publish(topic, payload, qos=1, retain=True)
        try:
            info.wait_for_publish(5)
        except (RuntimeError, ValueError):
            pass  # the broker may drop the connection of a client that breaks the ACL
    forger.disconnect()
    forger.loop_stop()
    client.publish(f"{base}/request/list/{user}", json.dumps({"transaction": "after"}), qos=1)
    wait_until(
        lambda: any(t == f"{base}/reply/{user}/response/list" for t, _ in box.get("messages", [])),
        30,
        "a later response",
    )
    seen["forged job state delivered"] = any(t == f"{base}/jobs/forged0000000000" for t, _ in box["messages"])
    seen["forged status delivered"] = any(t == f"{base}/status" and p == b"offline" for t, p in box["messages"])
    seen["service disconnected"] = "disconnected from the broker" in svc.log() or "taken" in svc.log()
    client.disconnect()
    client.loop_stop()
    assert svc.stop() == 0
    return seen


@pytest.mark.slow
def test_shipped_mosquitto_speaks_tls_to_the_lan(mosquitto_with_acl, tmp_path: Path) -> None:
    # Given mosquitto with the shipped configuration: plain MQTT on loopback, TLS for the LAN
    broker = mosquitto_with_acl
    conf = (ROOT / "broker" / "mosquitto.conf").read_text()
    assert "listener 1883 127.0.0.1" in conf and "\nlistener 8883\n" in conf
    env = {
        **os.environ,
        "EDGE_QUEUE_MQTT__PORT": str(broker.tls_port),
        "EDGE_QUEUE_MQTT__USERNAME": "phone",
        "EDGE_QUEUE_MQTT__PASSWORD": "phone-secret",
        "EDGE_QUEUE_MQTT__BASE_TOPIC": "edge-queue",
        "EDGE_QUEUE_DATA_DIR": str(tmp_path / "cli"),
    }
    # Then a LAN client with the CA connects over TLS (edge-queue is not running: the CLI
    # reaches the broker and says so, exit 4)
    tls = {**env, "EDGE_QUEUE_MQTT__TLS__ENABLED": "true", "EDGE_QUEUE_MQTT__TLS__CA_FILE": str(broker.ca)}
    out = subprocess.run([sys.executable, "-m", "edge_queue", "jobs"], env=tls, capture_output=True, text=True)
    assert out.returncode == 4 and "not running" in out.stderr, out.stdout + out.stderr
    # and plain MQTT on the LAN port is not spoken
    out = subprocess.run([sys.executable, "-m", "edge_queue", "jobs"], env=env, capture_output=True, text=True)
    assert out.returncode == 3 and "is it an MQTT broker?" in out.stderr, out.stdout + out.stderr


#: What the shipped ACL must allow and refuse, on either broker.
EXPECTED_ACL = {
    "anonymous": "Not authorized",
    "client submit": "ok",
    "forged job state delivered": False,
    "forged status delivered": False,
    "service disconnected": False,
}


@pytest.mark.slow
@pytest.mark.parametrize("broker_fixture", ["mosquitto_with_acl", "amqtt_with_acl"])
def test_shipped_broker_config_enforces_the_acl(
    broker_fixture: str, request: pytest.FixtureRequest, service_factory, speech: Path
) -> None:
    broker = request.getfixturevalue(broker_fixture)
    seen = _acl_scenario(broker, service_factory, speech, ("edge-queue", "svc-secret"), ("phone", "phone-secret"))
    print(f"{broker.kind} ACL observations:", seen)
    assert seen == EXPECTED_ACL, seen
    assert connect(broker, "phone", "wrong")[0] == "Not authorized"


@pytest.mark.slow
def test_a_box_with_its_own_base_topic_works_under_the_several_boxes_acl(
    mosquitto_with_boxes_acl, service_factory, speech: Path
) -> None:
    # Given the shipped mosquitto with broker/edge-queue-boxes.acl and a box on its own base
    # topic, as docs/operations.md ("Several boxes on one broker") says (before: the shipped
    # ACL named edge-queue/ only, and no user could read or reach edge-queue/garage)
    seen = _acl_scenario(
        mosquitto_with_boxes_acl,
        service_factory,
        speech,
        ("edge-queue", "svc-secret"),
        ("phone", "phone-secret"),
        base="edge-queue/garage",
    )
    # Then a user reads its state, submits on its own request topic and reads the answer, and
    # cannot forge its state
    assert seen == EXPECTED_ACL, seen


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
@pytest.mark.slow
def test_a_base_topic_the_acl_does_not_grant_is_found_by_doctor_and_stops_the_service(
    mosquitto_with_acl, service_factory, speech: Path, tmp_path: Path, protocol: str
) -> None:
    # Given the shipped mosquitto, ACL and passwords, and the service's user on a base topic the
    # ACL does not grant it (before: doctor said all ok, and the service reconnected forever,
    # taking the broker's closing of its connections for "another client connected with our
    # client id")
    env = {**service_env("edge-queue", "svc-secret", "not-granted"), "EDGE_QUEUE_MQTT__PROTOCOL": protocol}
    svc = service_factory(mosquitto_with_acl, [speech], env)
    svc.base = "not-granted"
    # When doctor checks it
    out = run_doctor({**svc.env})
    # Then the grants check fails, naming the topic, the user and the fix
    assert out.returncode == 1, out.stdout
    line = next(ln for ln in out.stdout.splitlines() if "grants" in ln)
    assert line.startswith("FAIL") and "user 'edge-queue'" in line and "not-granted/" in line, line
    # and the service stops at once with the configuration's exit code and says why
    svc.start(wait_online=False)
    assert svc.proc is not None
    code = svc.proc.wait(30)
    assert code == 2, svc.log()
    # (mosquitto 2.0 grants the subscription and closes the connection at the denied publish)
    assert "grant user 'edge-queue' readwrite not-granted/# in the broker's ACL" in svc.log(), svc.log()
    assert "another client connected with our client id" not in svc.log()
    # while the granted base topic passes both
    granted = {**svc.env, "EDGE_QUEUE_MQTT__BASE_TOPIC": "edge-queue"}
    out = run_doctor(granted)
    assert "ok    grants: edge-queue: the broker lets us" in out.stdout, out.stdout


def test_the_several_boxes_acl_is_the_shipped_acl_one_level_down() -> None:
    # broker/edge-queue-boxes.acl grants what broker/edge-queue.acl grants, for edge-queue/<box>/
    def rules(name: str) -> list[str]:
        text = (ROOT / "broker" / name).read_text()
        return [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]

    def one_level_down(line: str) -> str:
        *words, topic = line.split(" ")
        if topic.startswith("edge-queue/") and topic != "edge-queue/#":
            topic = "edge-queue/+/" + topic.removeprefix("edge-queue/")
        return " ".join([*words, topic])

    assert rules("edge-queue-boxes.acl") == [one_level_down(line) for line in rules("edge-queue.acl")]


@pytest.mark.slow
def test_tls_with_a_test_ca(tmp_path: Path, service_factory, speech: Path) -> None:
    need(shutil.which("mosquitto") is not None, "mosquitto not installed")
    pki = make_ca(tmp_path)
    port = free_port()
    (tmp_path / "tls.conf").write_text(
        f"listener {port} 127.0.0.1\nallow_anonymous true\ncafile {pki['ca']}\ncertfile {pki['cert']}\n"
        f"keyfile {pki['key']}\n" + ("user root\n" if os.geteuid() == 0 else "")
    )
    proc = subprocess.Popen(
        ["mosquitto", "-c", str(tmp_path / "tls.conf")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_until(lambda: port_open("127.0.0.1", port), 10, "TLS mosquitto")
        broker = Broker("127.0.0.1", port, "mosquitto", proc)
        tls = {"EDGE_QUEUE_MQTT__TLS__ENABLED": "true", "EDGE_QUEUE_MQTT__TLS__CA_FILE": str(pki["ca"])}
        svc = service_factory(broker, [speech], tls)
        svc.start(wait_online=False)  # (its check subscribes without TLS)
        wait_until(lambda: "republished the retained state" in svc.log(), 60, "the service online")
        out = subprocess.run(
            [sys.executable, "-m", "edge_queue", "submit", "--kind", "noop", "x", "--wait", "--timeout", "60"],
            env=svc.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr + svc.log()
        assert svc.stop() == 0
        # a CA that did not sign the server's certificate is refused (verification is on by default)
        bad = {**svc.env, "EDGE_QUEUE_MQTT__TLS__CA_FILE": str(pki["other"])}
        out = subprocess.run(
            [sys.executable, "-m", "edge_queue", "jobs"], env=bad, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 3, out.stdout + out.stderr
        # plain TCP to the TLS listener gets no MQTT answer
        out = subprocess.run(
            [sys.executable, "-m", "edge_queue", "jobs"],
            env={**svc.env, "EDGE_QUEUE_MQTT__TLS__ENABLED": "false"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 3
    finally:
        stop_mosquitto(proc)


@pytest.mark.slow
def test_doctor_reports_each_check(mosquitto, tmp_path: Path, speech: Path) -> None:
    env = {
        **os.environ,
        "EDGE_QUEUE_DATA_DIR": str(tmp_path / "d"),
        "EDGE_QUEUE_MEDIA_ROOTS": json.dumps([str(speech)]),
        "EDGE_QUEUE_MQTT__BASE_TOPIC": "doc" + uuid.uuid4().hex[:6],
    }
    out = run_doctor(env)
    assert out.returncode == 0, out.stdout + out.stderr
    names = [line.split()[1].rstrip(":") for line in out.stdout.splitlines()]
    assert names[:6] == ["broker", "grants", "service", "data_dir", "disk", "database"] and "media" in names
    # the queue page: a warning when nothing listens where it looks for the broker's WebSocket
    # listener (the page would stay on "connecting"), ok when something does
    for ws_port, line in ((free_port(), "warn  queue page"), (mosquitto.port, "ok    queue page")):
        page = {**env, "EDGE_QUEUE_HTTP__WEBSOCKET_PORT": str(ws_port)}
        out = run_doctor(page)
        assert out.returncode == 0 and line in out.stdout, out.stdout
    bad = {
        **env,
        "EDGE_QUEUE_MEDIA_ROOTS": json.dumps([str(tmp_path / "nope")]),
        "EDGE_QUEUE_MQTT__PORT": str(free_port()),
    }
    out = run_doctor(bad)
    assert out.returncode == 1
    assert "FAIL  broker" in out.stdout and f"FAIL  media root {tmp_path / 'nope'}" in out.stdout


def test_backup_while_running(mosquitto, service_factory, speech: Path, tmp_path: Path) -> None:
    svc = service_factory(mosquitto, [speech]).start()
    watcher = svc.watcher("response/#", "jobs/+")
    ids = [
        svc.request("submit", {"kind": "noop", "options": {"sleep_s": 0.01 * i}}, watcher)["data"]["jobs"][0]["job_id"]
        for i in range(1, 6)
    ]
    dest = tmp_path / "backup.db"
    out = subprocess.run(
        [sys.executable, "-m", "edge_queue", "backup", str(dest)],
        env=svc.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    with sqlite3.connect(dest) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert {r[0] for r in conn.execute("SELECT job_id FROM jobs")} == set(ids)
    again = subprocess.run(
        [sys.executable, "-m", "edge_queue", "backup", str(dest)],
        env=svc.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 1 and "exists" in again.stderr


def test_log_lines_name_job_and_code(mosquitto, service_factory, speech: Path) -> None:
    svc = service_factory(mosquitto, [speech]).start()
    watcher = svc.watcher("response/#", "jobs/+")
    job_id = svc.request("submit", {"kind": "test_fail", "max_attempts": 1}, watcher)["data"]["jobs"][0]["job_id"]
    watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] == "failed")
    svc.request("submit", {"input": str(speech / "nope.wav")}, watcher)
    assert svc.stop() == 0
    log = svc.log()
    assert f"job {job_id} queued" in log and f"job {job_id} started" in log
    assert f"job {job_id} failed: internal_error" in log
    assert "rejected: input_not_found" in log
    assert all(len(line) < 2000 for line in log.splitlines())
