"""Roles and the boundaries between users, attacked from outside: the shipped broker
configurations (mosquitto 2.0.11 and the embedded amqtt, with the users the docs define) and a
real service (docs/topics.md, "Who sent a request"; docs/configuration.md, "[access]";
broker/README.md)."""

from __future__ import annotations

import json
import ssl
import uuid
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from .conftest import Broker, stop_client, wait_until
from .helpers.deploy import STATE_TOPICS, USERS, connect, service_env


class User:
    """One broker user's client: reads what the shipped ACLs let every user read and its own
    replies, and sends requests on its own request topic."""

    def __init__(self, broker: Broker, name: str, *, extra: tuple[str, ...] = ()) -> None:
        self.name = name
        self.messages: list[tuple[str, bytes]] = []
        self.suback: list[Any] = []
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"t-{name}-{uuid.uuid4().hex[:6]}")
        self.client.username_pw_set(name, USERS[name])
        self.subscriptions = [*STATE_TOPICS, f"edge-queue/reply/{name}/#", *extra]
        connected: list[str] = []

        def on_connect(c, u, f, reason, p) -> None:
            connected.append(str(reason))
            for topic in self.subscriptions:
                c.subscribe(topic, 1)

        self.client.on_connect = on_connect
        self.client.on_message = lambda c, u, m: self.messages.append((m.topic, bytes(m.payload)))
        self.client.on_subscribe = lambda c, u, mid, codes, p: self.suback.extend(codes)
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()
        wait_until(lambda: connected == ["Success"] or None, 10, f"{name} connected")
        wait_until(lambda: len(self.suback) >= len(self.subscriptions) or None, 10, f"{name}'s SUBACKs")

    def request(self, command: str, body: dict[str, Any], *, topic: str | None = None) -> dict[str, Any]:
        """Send on the user's own request topic (or ``topic``); the response on its reply topic."""
        tx = uuid.uuid4().hex
        self.client.publish(
            topic or f"edge-queue/request/{command}/{self.name}", json.dumps({**body, "transaction": tx}), qos=1
        )
        return wait_until(lambda: self._response(command, tx), 30, f"{self.name}'s {command} response")

    def _response(self, command: str, tx: str) -> dict[str, Any] | None:
        for t, p in list(self.messages):
            if t.endswith(f"/response/{command}") and p and json.loads(p).get("transaction") == tx:
                return json.loads(p)
        return None

    def seen(self, prefix: str) -> list[tuple[str, bytes]]:
        return [(t, p) for t, p in list(self.messages) if t.startswith(prefix)]

    def close(self) -> None:
        stop_client(self.client)


@pytest.mark.slow
@pytest.mark.parametrize("broker_fixture", ["mosquitto_with_acl", "amqtt_with_acl"])
def test_a_user_acts_on_its_own_jobs_only_and_no_one_can_answer_for_the_service(
    broker_fixture: str, request: pytest.FixtureRequest, service_factory, speech: Path
) -> None:
    # Given the shipped broker configuration, and edge-queue with roles: ordinary users are
    # "user", the shared request topics (Home Assistant's) "admin"
    broker = request.getfixturevalue(broker_fixture)
    env = {**service_env("edge-queue", USERS["edge-queue"]), "EDGE_QUEUE_ACCESS__DEFAULT_ROLE": "user"}
    env["EDGE_QUEUE_LIMITS__MAX_QUEUED_JOBS_PER_USER"] = "10"
    svc = service_factory(broker, [speech], env)
    svc.env.pop("EDGE_QUEUE_MQTT__CLIENT_ID")  # its default id, as installed
    svc.base = "edge-queue"
    svc.start(wait_online=False)
    phone = User(broker, "phone")
    wait_until(lambda: (("edge-queue/status", b"online") in phone.messages) or None, 60, "online")
    # a guest that also tries to read the phone's requests and answers
    guest = User(broker, "guest", extra=("edge-queue/reply/phone/#", "edge-queue/request/+/phone"))
    ha = User(broker, "homeassistant")
    # When the phone submits a job that waits (run_at in an hour), with an idempotency key
    later = {"kind": "noop", "run_at": "2099-01-01T00:00:00Z", "idempotency_key": "k1"}
    sub = phone.request("submit", later)
    assert sub["status"] == "ok", sub
    job_id = sub["data"]["jobs"][0]["job_id"]
    assert phone.request("get", {"job_id": job_id})["data"]["submitted_by"] == "phone"

    # Then the guest can neither see, cancel, retry nor purge it, nor pause the queue
    attempts = {
        "get": {"job_id": job_id},
        "cancel": {"job_id": job_id},
        "retry": {"job_id": job_id},
        "pause": {},
        "purge": {"older_than_s": 0},
        "republish": {},
    }
    for command, body in attempts.items():
        answer = guest.request(command, body)
        assert answer["status"] == "error" and answer["error"]["code"] == "forbidden", (command, answer)
    assert job_id not in [j["job_id"] for j in guest.request("list", {})["data"]["jobs"]]
    assert guest.request("cancel", {"all": True})["data"]["cancelled"] == []
    # its use of the phone's idempotency key makes a job of its own
    squat = guest.request("submit", later)["data"]["jobs"][0]
    assert squat["job_id"] != job_id and not squat["duplicate"]
    # and a lock key it holds forever does not lock the phone out
    held = {"kind": "noop", "run_at": "2099-01-01T00:00:00Z", "lock_key": "camera-1"}
    assert guest.request("submit", held)["status"] == "ok"
    assert phone.request("submit", {**held, "input": "mine"})["status"] == "ok"
    # nor does a flood of its jobs fill the queue for the others (limits.max_queued_jobs_per_user)
    flood = guest.request("submit", {"kind": "noop", "run_at": "2099-01-01T00:00:00Z", "inputs": ["a"] * 10})
    assert flood["status"] == "error" and flood["error"]["code"] == "queue_full", flood
    assert phone.request("submit", {**later, "idempotency_key": "k2"})["status"] == "ok"
    # a request on the phone's request topic does not reach the service (the ACL)
    _hostile_publish(broker, "guest", "edge-queue/request/cancel/phone", json.dumps({"job_id": job_id}))
    # a forged answer on the phone's reply topic does not reach the phone
    forged = {"status": "ok", "data": {"forged": True}, "transaction": "x"}
    _hostile_publish(broker, "guest", "edge-queue/reply/phone/response/get", json.dumps(forged))
    # nor can the guest take over the service's client id: it knows only the part <base>/info
    # publishes (the instance id), not the secret the id ends with
    info = json.loads(dict(guest.messages)["edge-queue/info"])
    taken = _take_client_id(broker, "guest", f"edge-queue-{info['instance_id']}")

    # nor can a sender on the shared topics (before: it made edge-queue publish its answer,
    # with a transaction of its choice, on the phone's private reply topic)
    planted = ha.request(
        "get", {"job_id": job_id, "reply_to": "edge-queue/reply/phone/response/get"}, topic="edge-queue/request/get"
    )
    assert planted["status"] == "error" and planted["error"]["field"] == "reply_to", planted
    # while a shared reply topic of its own still gets its copy
    shared = ha.request("list", {"limit": 1, "reply_to": "edge-queue/reply/ha-script"}, topic="edge-queue/request/list")
    assert shared["status"] == "ok", shared

    # while the phone still sees its own job, queued, and gets every answer (none forged)
    assert phone.request("get", {"job_id": job_id})["data"]["state"] == "queued"
    assert not [p for t, p in phone.seen("edge-queue/reply/phone/") if b"forged" in p]
    assert not [p for t, p in phone.seen("edge-queue/reply/phone/") if planted["transaction"].encode() in p]
    # and the guest saw nothing of the phone's requests and answers
    assert guest.seen("edge-queue/reply/phone/") == [] and guest.seen("edge-queue/request/") == []
    # an admin (Home Assistant on the shared topic) can cancel it
    cancelled = ha.request("cancel", {"job_id": job_id}, topic="edge-queue/request/cancel")
    assert cancelled["data"]["cancelled"] == [job_id], cancelled
    # the service stayed online, on one connection, throughout
    print(f"{broker.kind}: client id take-over by guest: {taken}")
    # (mosquitto let it in under that id, another session than the service's; amqtt refused
    # the edge-queue- prefix)
    assert taken == ("Success" if broker.kind == "mosquitto" else "Not authorized"), taken
    # and the service still hears requests after all those tries
    assert phone.request("kinds", {})["status"] == "ok"
    assert ("edge-queue/status", b"offline") not in phone.messages
    assert "disconnected from the broker" not in svc.log() and "taken over" not in svc.log(), svc.log()
    for user in (phone, guest, ha):
        user.close()
    assert svc.stop() == 0


def _hostile_publish(broker: Broker, user: str, topic: str, payload: str) -> None:
    """Publish as ``user`` on a connection of its own (the broker may close it for the try)."""
    reason, pair = connect(broker, user, USERS[user])
    assert reason == "Success", reason
    c = pair[0]
    try:
        c.publish(topic, payload, qos=1).wait_for_publish(5)
    except (RuntimeError, ValueError):
        pass  # mosquitto 2.0.11 closes the connection of a client that breaks the ACL
    c.disconnect()
    c.loop_stop()


def _take_client_id(broker: Broker, user: str, client_id: str) -> str:
    """Connect as ``user`` with ``client_id`` (the service's as far as ``user`` can know it), as
    a LAN client would (on mosquitto's TLS listener, on amqtt's only listener), once asking for
    a clean session and once for the stored one, and once more with a wrong password. Returns
    what the broker answered."""
    answers = []
    for clean, password in ((True, USERS[user]), (False, USERS[user]), (True, "wrong"), (False, "wrong")):
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=clean)
        c.username_pw_set(user, password)
        port = broker.port
        if broker.kind == "mosquitto":
            c.tls_set(ca_certs=str(broker.ca), cert_reqs=ssl.CERT_REQUIRED)  # type: ignore[attr-defined]
            port = broker.tls_port  # type: ignore[attr-defined]
        result: list[str] = []
        c.on_connect = lambda cl, u, f, reason, p, result=result: result.append(str(reason))
        c.connect(broker.host, port)
        c.loop_start()
        wait_until(lambda result=result: result or None, 10, "a CONNACK")
        c.disconnect()
        c.loop_stop()
        answers.append(result[0] if password == USERS[user] else "")
    return answers[0] if len(set(answers[:2])) == 1 else f"{answers[0]} / {answers[1]}"


@pytest.mark.slow
def test_requests_sent_while_the_service_is_stopped_run_when_it_comes_back(
    amqtt_with_acl: Broker, service_factory, speech: Path
) -> None:
    # Given the embedded broker with the shipped configuration, and the service stopped after
    # its first run (its session, with its subscription, stays on the broker)
    broker = amqtt_with_acl
    # (MQTT 3.1.1 and the default client id, as broker/README.md sets amqtt up)
    env = {**service_env("edge-queue", USERS["edge-queue"]), "EDGE_QUEUE_MQTT__PROTOCOL": "3.1.1"}
    svc = service_factory(broker, [speech], env)
    svc.env.pop("EDGE_QUEUE_MQTT__CLIENT_ID")
    svc.base = "edge-queue"
    svc.start(wait_online=False)
    phone = User(broker, "phone")
    wait_until(lambda: (("edge-queue/status", b"online") in phone.messages) or None, 60, "online")
    assert svc.stop() == 0
    wait_until(lambda: (("edge-queue/status", b"offline") in phone.messages) or None, 30, "offline")
    # When the phone submits meanwhile
    tx = uuid.uuid4().hex
    phone.client.publish("edge-queue/request/submit/phone", json.dumps({"kind": "noop", "transaction": tx}), qos=1)
    # Then the service runs it when it comes back (amqtt delivered it marked retained, which
    # edge-queue refuses as a retained request)
    svc.start(wait_online=False)
    answer = wait_until(lambda: phone._response("submit", tx), 60, "the answer to the submit sent while stopped")
    assert answer["status"] == "ok", answer
    phone.close()
    assert svc.stop() == 0
