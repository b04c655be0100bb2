"""The shipped broker configurations on free ports, with their passwords and ACL (mosquitto and the
embedded amqtt), the users tests log in as, and a client that logs in as one of them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from ..conftest import ROOT, Broker, need, port_open, stop_mosquitto, wait_until
from .ports import free_port

#: The topics every user may read with the shipped ACLs (broker/README.md).
STATE_TOPICS = [
    "edge-queue/status",
    "edge-queue/info",
    "edge-queue/queue",
    "edge-queue/events",
    "edge-queue/jobs/+",
    "edge-queue/batches/+",
    "edge-queue/response/+",
]


#: The users of the shipped broker configurations in tests: the service, Home Assistant, and
#: two ordinary users (amqtt lists each user by name: "guest" copies "phone").
USERS = {
    "edge-queue": "svc-secret",
    "phone": "phone-secret",
    "guest": "guest-secret",
    "homeassistant": "ha-secret",
    # worker nodes (docs/nodes.md): n1 is in the hub's access.nodes in tests/test_nodes.py, n2 not
    "n1": "n1-secret",
    "n2": "n2-secret",
}


def _passwd(path: Path, users: dict[str, str]) -> None:
    for i, (user, password) in enumerate(users.items()):
        flags = ["-c"] if i == 0 else []
        subprocess.run(["mosquitto_passwd", *flags, "-b", str(path), user, password], check=True, timeout=30)


def connect(broker: Broker, user: str | None, password: str | None, protocol: int = mqtt.MQTTv311):
    """A connected paho client, or the CONNACK reason string when refused."""
    result: dict[str, object] = {}
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="acl-" + uuid.uuid4().hex[:8], protocol=protocol)
    if user:
        c.username_pw_set(user, password)

    def on_connect(cl, u, f, reason, p) -> None:
        result.setdefault("reason", str(reason))
        for topic in result.get("subscriptions", []):  # again after a reconnect
            cl.subscribe(topic, 1)

    c.on_connect = on_connect
    c.on_message = lambda cl, u, m: result.setdefault("messages", []).append((m.topic, bytes(m.payload)))
    c.connect(broker.host, broker.port)
    c.loop_start()
    wait_until(lambda: "reason" in result or None, 10, "a CONNACK")
    if result["reason"] != "Success":
        c.loop_stop()
        return str(result["reason"]), None
    return "Success", (c, result)


def service_env(user: str, password: str, base: str = "edge-queue") -> dict[str, str]:
    return {
        "EDGE_QUEUE_MQTT__USERNAME": user,
        "EDGE_QUEUE_MQTT__PASSWORD": password,
        "EDGE_QUEUE_MQTT__BASE_TOPIC": base,
        # as shipped: the ACLs must let the service publish its Home Assistant device (mosquitto
        # 2.0.11 closes an MQTT 5 connection on any denied publish)
        "EDGE_QUEUE_HOMEASSISTANT__DISCOVERY": "true",
    }


@pytest.fixture
def mosquitto_with_acl(tmp_path: Path):
    yield from _shipped_mosquitto(tmp_path, "edge-queue.acl")


@pytest.fixture
def mosquitto_with_boxes_acl(tmp_path: Path):
    yield from _shipped_mosquitto(tmp_path, "edge-queue-boxes.acl")


def _shipped_mosquitto(tmp_path: Path, acl: str):
    """The shipped mosquitto.conf on free ports with the ACL file ``acl`` of broker/."""
    need(
        shutil.which("mosquitto") is not None and shutil.which("mosquitto_passwd") is not None,
        "mosquitto not installed",
    )
    port = free_port()
    _passwd(tmp_path / "passwd", USERS)
    shutil.copy(ROOT / "broker" / acl, tmp_path / "acl")
    conf = (ROOT / "broker" / "mosquitto.conf").read_text()
    conf = conf.replace("/etc/mosquitto/edge-queue.passwd", str(tmp_path / "passwd"))
    conf = conf.replace("/etc/mosquitto/edge-queue.acl", str(tmp_path / "acl"))
    conf = conf.replace("/var/lib/mosquitto/", str(tmp_path) + "/")
    conf = conf.replace("listener 1883 127.0.0.1", f"listener {port} 127.0.0.1")
    pki = make_ca(tmp_path)  # the LAN listener's certificate
    tls_port = free_port()
    conf = conf.replace("listener 8883", f"listener {tls_port} 127.0.0.1")
    conf = conf.replace("/etc/mosquitto/certs/edge-queue.crt", str(pki["cert"]))
    conf = conf.replace("/etc/mosquitto/certs/edge-queue.key", str(pki["key"]))
    ws_port = free_port()  # the queue page's WebSocket listener
    conf = conf.replace("listener 9001\n", f"listener {ws_port}\n")
    assert "max_queued_messages 0" in conf and "persistence true" in conf
    if os.geteuid() == 0:  # else mosquitto drops to its own user, which cannot read pytest's tmp
        conf += "\nuser root\n"
    (tmp_path / "mosquitto.conf").write_text(conf)
    with open(tmp_path / "mosquitto.log", "wb") as log:
        proc = subprocess.Popen(["mosquitto", "-c", str(tmp_path / "mosquitto.conf")], stdout=log, stderr=log)
    wait_until(lambda: port_open("127.0.0.1", port) or proc.poll() is not None, 10, "mosquitto")
    assert proc.poll() is None, (tmp_path / "mosquitto.log").read_text()
    broker = Broker("127.0.0.1", port, "mosquitto", proc)
    broker.tls_port, broker.ca = tls_port, pki["ca"]  # type: ignore[attr-defined]
    broker.ws_port = ws_port
    yield broker
    stop_mosquitto(proc)


@pytest.fixture
def amqtt_with_acl(tmp_path: Path):
    from pwdlib import PasswordHash

    hasher = PasswordHash.recommended()
    (tmp_path / "amqtt.passwd").write_text("".join(f"{u}:{hasher.hash(p)}\n" for u, p in USERS.items()))
    port = free_port()
    conf = (ROOT / "broker" / "amqtt.yaml").read_text()
    ws_port = free_port()  # the queue page's WebSocket listener
    conf = (
        conf.replace("127.0.0.1:1883", f"127.0.0.1:{port}")
        .replace("127.0.0.1:9001", f"127.0.0.1:{ws_port}")
        .replace("/etc/edge-queue/amqtt.passwd", str(tmp_path / "amqtt.passwd"))
    )
    # the user "guest": the same rules as "phone", under its own name
    lines = conf.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].lstrip().startswith("phone:"):
            block = [lines[i]]
            j = i + 1
            while j < len(lines) and lines[j].startswith(" " * (len(lines[i]) - len(lines[i].lstrip()) + 2)):
                block.append(lines[j])
                j += 1
            lines[j:j] = [b.replace("phone", "guest") for b in block]
    conf = "\n".join(lines) + "\n"
    (tmp_path / "amqtt.yaml").write_text(conf)
    env = {
        **os.environ,
        "EDGE_QUEUE_BROKER__CONFIG_FILE": str(tmp_path / "amqtt.yaml"),
        "EDGE_QUEUE_DATA_DIR": str(tmp_path / "b"),
    }
    with open(tmp_path / "broker.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "edge_queue", "broker"], env=env, stdout=log, stderr=log)
    wait_until(lambda: port_open("127.0.0.1", port) or proc.poll() is not None, 20, "amqtt")
    assert proc.poll() is None, (tmp_path / "broker.log").read_text()
    broker = Broker("127.0.0.1", port, "amqtt", proc)
    broker.ws_port = ws_port
    yield broker
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:  # a slow machine: the test is over, its broker must go
        proc.kill()
        proc.wait(10)


def make_ca(d: Path) -> dict[str, Path]:
    """A test CA and a server certificate for 127.0.0.1, made with the openssl command."""
    need(shutil.which("openssl") is not None, "openssl not installed")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    def self_signed(name: str, cn: str) -> None:
        run(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            f"/CN={cn}",
            "-keyout",
            str(d / f"{name}.key"),
            "-out",
            str(d / f"{name}.crt"),
        )

    self_signed("ca", "edge-queue test CA")
    run(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        str(d / "server.key"),
        "-out",
        str(d / "server.csr"),
    )
    (d / "ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run(
        "x509",
        "-req",
        "-in",
        str(d / "server.csr"),
        "-CA",
        str(d / "ca.crt"),
        "-CAkey",
        str(d / "ca.key"),
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        str(d / "ext"),
        "-out",
        str(d / "server.crt"),
    )
    self_signed("other", "another CA")
    return {"ca": d / "ca.crt", "cert": d / "server.crt", "key": d / "server.key", "other": d / "other.crt"}
