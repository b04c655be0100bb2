"""A user on the LAN of the shipped mosquitto (broker/mosquitto.conf and broker/edge-queue.acl,
which compose's mosquitto runs: docs/install.md, "Compose"): its first job as docs/install.md
writes it, with the real ``mosquitto_sub`` and ``mosquitto_pub`` and a real service; and two
clients of one user at once."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import ssl
import subprocess
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from .conftest import Broker, stop_client, wait_until
from .helpers.deploy import USERS, connect, service_env
from .helpers.docs_text import read, section

#: The user of compose's example .env (container/compose.env.example) that the docs log in as.
LAN_USER = "phone"


def compose_commands() -> list[str]:
    """The ``mosquitto_sub`` and ``mosquitto_pub`` commands of docs/install.md's "Compose", in
    its code blocks and its inline code, in the order the page gives them."""
    text = section(read("install.md"), re.compile(r"^## Compose$"))
    found = re.finditer(r"^(mosquitto_(?:sub|pub) .*?)(?: &)?$|`(mosquitto_(?:sub|pub) [^`]*)`", text, re.M)
    return [m.group(1) or m.group(2) for m in found]


def as_typed(command: str, broker: Broker, media: Path, speech: Path) -> list[str]:
    """``command`` as the LAN user runs it against ``broker``: its box and password filled in
    (and its login added when the command has none: the broker refuses anonymous clients), the
    container's ``/media/...`` paths made files of ``media`` (copies of a real recording)."""
    args = shlex.split(command)
    out: list[str] = []
    for arg in args:
        if arg == "<box>":
            arg = broker.host
        elif arg == "<password>":
            arg = USERS[LAN_USER]
        elif arg.startswith("/media/"):
            local = media / arg.removeprefix("/media/")
            local.parent.mkdir(parents=True, exist_ok=True)
            if not local.exists():
                shutil.copy(speech / "jfk.flac", local)
            arg = str(local)
        out.append(arg)
    if "-h" not in out:
        out[1:1] = ["-h", broker.host]
    if "-u" not in out:
        out[1:1] = ["-u", LAN_USER, "-P", USERS[LAN_USER]]
    out[out.index("-h") + 2 : out.index("-h") + 2] = ["-p", str(broker.port)]
    return out


@pytest.mark.slow
def test_a_lan_users_first_job_as_install_md_writes_it_is_transcribed(
    mosquitto_with_acl: Broker, service_factory, speech: Path, tmp_path: Path, mosquitto_clients: None
) -> None:
    # Given the shipped mosquitto with its ACL and edge-queue on it, /media being the media root
    # (compose mounts MEDIA_DIR there)
    broker = mosquitto_with_acl
    media = tmp_path / "media"
    media.mkdir()
    svc = service_factory(broker, [media], service_env("edge-queue", USERS["edge-queue"]))
    svc.base = "edge-queue"
    svc.start(wait_online=False)
    commands = compose_commands()
    subs = [c for c in commands if c.startswith("mosquitto_sub")]
    pubs = [c for c in commands if c.startswith("mosquitto_pub") and "/request/submit" in c]
    assert pubs, "docs/install.md's Compose section shows no submit"
    # and the LAN user's own view of the jobs (what every user may read)
    reason, pair = connect(broker, LAN_USER, USERS[LAN_USER])
    assert reason == "Success", reason
    observer, box = pair
    box["subscriptions"] = ["edge-queue/status", "edge-queue/jobs/+"]
    for topic in box["subscriptions"]:
        observer.subscribe(topic, 1)
    wait_until(lambda: ("edge-queue/status", b"online") in box.get("messages", []), 60, "edge-queue online")
    watching: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        # When the user runs install.md's mosquitto_sub (in the background, as written there) ...
        for i, command in enumerate(subs[:1]):
            out = tmp_path / f"sub-{i}.out"
            with open(out, "wb") as f:
                sub = subprocess.Popen(as_typed(command, broker, media, speech), stdout=f, stderr=subprocess.STDOUT)
            watching.append((sub, out))
            _wait_subscribed(broker, out)
        # ... and each of its submits, exactly as written there
        for command in pubs:
            argv = as_typed(command, broker, media, speech)
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            print(f"{command!r}: exit {done.returncode} {done.stderr.strip()}")
            assert done.returncode == 0, done.stderr
            path = argv[argv.index("-m") + 1]
            # Then the file is transcribed: its job succeeds, with the recording's words
            job = wait_until(lambda path=path: _finished(box, path), 120, f"a finished job for {command!r}")
            assert job["state"] == "succeeded", job
            assert "ask not what your country" in job["result"]["text"].lower(), job
            assert job["submitted_by"] == LAN_USER, job
            # and install.md's mosquitto_sub printed the answer and the job's end
            for _, out in watching:
                wait_until(
                    lambda out=out, job=job: (
                        f"edge-queue/jobs/{job['job_id']} " in out.read_text()
                        and '"state":"succeeded"' in out.read_text().replace(" ", "")
                    ),
                    30,
                    "mosquitto_sub to print the finished job",
                )
                assert f"edge-queue/reply/{LAN_USER}/response/submit " in out.read_text()
    finally:
        for sub, _ in watching:
            sub.terminate()
            sub.wait(10)
        stop_client(observer)
    assert svc.stop() == 0


def _wait_subscribed(broker: Broker, out: Path) -> None:
    """Until the background ``mosquitto_sub`` prints a message the service sends on the user's
    reply topic (sent again until it does): then its subscriptions are in place."""
    reason, pair = connect(broker, "edge-queue", USERS["edge-queue"])
    assert reason == "Success", reason
    client = pair[0]
    marker = f"edge-queue/reply/{LAN_USER}/subscribed"

    def printed() -> bool:
        client.publish(marker, b"yes", qos=1).wait_for_publish(5)
        return marker in out.read_text()

    try:
        wait_until(printed, 30, "mosquitto_sub to subscribe", interval=0.2)
    finally:
        stop_client(client)


def _finished(box: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The last state of the job of input ``path`` that the observer saw, once it is final."""
    for topic, payload in reversed(list(box.get("messages", []))):
        if topic.startswith("edge-queue/jobs/") and payload:
            job = json.loads(payload)
            if job.get("input") == str(Path(path).resolve()) and job["state"] in ("succeeded", "failed", "cancelled"):
                return job
    return None


def test_two_clients_of_one_user_on_the_lan_stay_connected_side_by_side(mosquitto_with_acl: Broker) -> None:
    # Given the shipped mosquitto, and one user in two terminals on its LAN listener (TLS): a
    # subscriber to its answers and a second client (a mosquitto_pub, the queue page, ...)
    broker = mosquitto_with_acl
    clients = [_LanClient(broker, LAN_USER, f"phone-terminal-{n}") for n in (1, 2)]
    reason, pair = connect(broker, "edge-queue", USERS["edge-queue"])
    assert reason == "Success", reason
    service = pair[0]
    try:
        # When the service sends the user an answer, until both clients have it
        def both_have_it() -> bool:
            service.publish(f"edge-queue/reply/{LAN_USER}/response/kinds", b"{}", qos=1).wait_for_publish(5)
            return all(c.got for c in clients)

        wait_until(both_have_it, 30, "both clients of the user to get its answer", interval=0.2)
        # Then neither was ever put off the broker by the other: both connected once, and still are
        for c in clients:
            print(f"{c.client_id}: connects {c.connects}, disconnects {c.disconnects}")
            assert c.connects == 1 and c.disconnects == [] and c.client.is_connected(), (c.client_id, c.disconnects)
    finally:
        for c in clients:
            stop_client(c.client)
        stop_client(service)


class _LanClient:
    """A client of ``user`` on the broker's LAN listener (TLS with the test CA), subscribed to
    the user's reply topics; counts its connects and disconnects."""

    def __init__(self, broker: Broker, user: str, client_id: str) -> None:
        self.client_id = client_id
        self.connects = 0
        self.disconnects: list[str] = []
        self.got: list[bytes] = []
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id)
        self.client.username_pw_set(user, USERS[user])
        self.client.tls_set(ca_certs=str(broker.ca), cert_reqs=ssl.CERT_REQUIRED)  # type: ignore[attr-defined]

        def on_connect(c: mqtt.Client, u: object, f: object, reason: object, p: object) -> None:
            self.connects += 1
            c.subscribe(f"edge-queue/reply/{user}/#", 1)

        self.client.on_connect = on_connect
        self.client.on_disconnect = lambda c, u, f, reason, p: self.disconnects.append(str(reason))
        self.client.on_message = lambda c, u, m: self.got.append(bytes(m.payload))
        self.client.connect(broker.host, broker.tls_port)  # type: ignore[attr-defined]
        self.client.loop_start()
        wait_until(lambda: self.connects, 10, f"{client_id} connected")
