"""The pieces of the soak (bench/soak.py): a mosquitto of its own, the service as a real process
under a systemd-like watchdog, the peers that publish and subscribe like a household, and the
probe that times a request through it all."""

from __future__ import annotations

import json
import os
import pwd
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import harness
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"


class Hang(Exception):
    """The service stopped answering (or the run is out of time); the soak gives up with FAIL."""


class Stalled(Exception):
    """Requests stay unanswered while the service still answers the probe: they were lost on
    the way (a broker that dropped them, a response never sent); the soak gives up with FAIL."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def shipped_delivery_settings() -> str:
    """The delivery and persistence lines of broker/mosquitto.conf (not its listener,
    authentication or log settings)."""
    keep = ("max_queued_messages", "max_inflight_messages", "max_queued_bytes", "set_tcp_nodelay", "autosave_interval")
    lines = (ROOT / "broker" / "mosquitto.conf").read_text().splitlines()
    return "".join(line.strip() + "\n" for line in lines if line.strip().split(" ")[0] in keep)


class Broker:
    """A private mosquitto with persistence on a free loopback port, restartable on that port."""

    def __init__(self, work: Path) -> None:
        with socket.socket() as s:
            s.bind((HOST, 0))
            self.port = s.getsockname()[1]
        self.dir = work / "broker"
        self.dir.mkdir(parents=True)
        self.conf = self.dir / "mosquitto.conf"
        self.settings = shipped_delivery_settings()
        # ``user``: mosquitto started by root would switch to the user "mosquitto", which could
        # not write its persistence file (nor its log) in this folder.
        self.conf.write_text(
            f"listener {self.port} {HOST}\nallow_anonymous true\nuser {pwd.getpwuid(os.getuid()).pw_name}\n"
            f"persistence true\npersistence_location {self.dir}/\n"
            f"log_dest file {self.dir / 'mosquitto.log'}\n" + self.settings
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.down_s: list[float] = []

    def start(self) -> None:
        with open(self.dir / "stderr.log", "ab") as err:
            self.proc = subprocess.Popen(["mosquitto", "-c", str(self.conf)], stdout=subprocess.DEVNULL, stderr=err)
        end = time.monotonic() + 15
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited {self.proc.returncode}: {self.tail()}")
            try:
                socket.create_connection((HOST, self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"mosquitto not listening on {self.port} after 15 s: {self.tail()}")

    def stop(self) -> None:
        """SIGTERM (mosquitto writes its persistence file on the way out), SIGKILL after 30 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self, down_s: float) -> None:
        t0 = time.monotonic()
        self.stop()
        time.sleep(down_s)
        self.start()
        self.restarts += 1
        self.down_s.append(time.monotonic() - t0)

    def tail(self, n: int = 1500) -> str:
        return "".join(harness.log_tail(self.dir / name, n) for name in ("stderr.log", "mosquitto.log"))[-n:]


class Service:
    def __init__(self, data_dir: Path, base: str, host: str, port: int) -> None:
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_QUEUE_")}
        self.env.update(
            {
                "EDGE_QUEUE_DATA_DIR": str(data_dir),
                "EDGE_QUEUE_MQTT__BASE_TOPIC": base,
                "EDGE_QUEUE_MQTT__CLIENT_ID": f"svc-{base}",
                "EDGE_QUEUE_MQTT__HOST": host,
                "EDGE_QUEUE_MQTT__PORT": str(port),
                "EDGE_QUEUE_LOG_LEVEL": "WARNING",
                # SIGABRT dumps every thread's stack to the log: what a hung service was doing.
                "PYTHONFAULTHANDLER": "1",
            }
        )
        self.base = base
        self.host, self.port = host, port
        self.log_path = data_dir.parent / "service.log"
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - kept for the run
        self.proc: subprocess.Popen[bytes] | None = None
        self.unexpected_exits: list[int] = []

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edge_queue", "serve"],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
            cwd=str(ROOT),
        )

    def check_exited(self) -> bool:
        """True (and restarted) when the service exited although nobody stopped it."""
        if self.proc is not None and self.proc.poll() is not None:
            self.unexpected_exits.append(self.proc.returncode)
            log(f"service exited by itself ({self.proc.returncode}); restarting it")
            self.start()
            return True
        return False

    def kill(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            self.unexpected_exits.append(self.proc.returncode)
            return
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self, timeout_s: float = 60) -> int | None:
        """SIGTERM; the exit code, or None (stacks dumped, killed) when it did not exit in time."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            return self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.dump_and_kill()
            return None

    def ensure_dead(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def dump_and_kill(self) -> None:
        """SIGABRT (faulthandler writes the stacks to the log), then SIGKILL."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGABRT)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def wait_online(self, timeout_s: float = 60) -> None:
        harness.wait_online(self.host, self.port, self.base, self.proc, self.tail, timeout_s)

    def tail(self, n: int = 4000) -> str:
        return harness.log_tail(self.log_path, n)


class Peer:
    """One MQTT 5 client with a persistent session: publishes requests at QoS 1 (every
    publish kept, to see its PUBACK), and collects the responses sent to its reply topic."""

    def __init__(self, name: str, host: str, port: int, base: str, max_inflight: int = 1000) -> None:
        self.base = base
        self.reply = f"{base}/reply/{name}"
        self.cond = threading.Condition()
        # transaction -> [(monotonic time, status, job_id of the first job)]
        self.responses: dict[str, list[tuple[float, str, str | None]]] = {}
        self.pubs: dict[str, list[mqtt.MQTTMessageInfo]] = {}
        self.distinct = 0  # transactions answered at least once
        self.puback_codes: Counter[str] = Counter()
        self.connects = 0
        self.c = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=f"soak-{name}-{uuid.uuid4().hex[:8]}", protocol=mqtt.MQTTv5
        )
        self.c.max_inflight_messages_set(max_inflight)
        self.c.max_queued_messages_set(0)
        self.c.reconnect_delay_set(1, 2)
        self.c.on_connect = self._on_connect
        self.c.on_message = self._on_message
        self.c.on_publish = self._on_publish
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 3600
        self.c.connect(host, port, keepalive=30, clean_start=False, properties=props)
        self.c.loop_start()

    def _on_connect(self, c: mqtt.Client, *a: Any) -> None:
        self.connects += 1
        c.subscribe(self.reply, 1)

    def _on_publish(self, c: mqtt.Client, u: Any, mid: int, reason: Any, props: Any) -> None:
        self.puback_codes[str(reason)] += 1

    def _on_message(self, c: mqtt.Client, u: Any, msg: mqtt.MQTTMessage) -> None:
        now = time.monotonic()
        try:
            body = json.loads(msg.payload)
            data = body.get("data") or {}
            jobs = data.get("jobs") if isinstance(data, dict) else None
            job_id = jobs[0]["job_id"] if jobs and body.get("status") == "ok" and "batch_id" in data else None
            entry = (now, str(body.get("status")), job_id)
            tx = str(body.get("transaction"))
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            entry, tx = (now, "unreadable", None), "?"
        with self.cond:
            if tx not in self.responses:
                self.distinct += 1
            self.responses.setdefault(tx, []).append(entry)
            self.cond.notify_all()

    def publish(self, command: str, body: dict[str, Any]) -> mqtt.MQTTMessageInfo:
        tx = body["transaction"]
        info = self.c.publish(f"{self.base}/request/{command}", json.dumps({**body, "reply_to": self.reply}), qos=1)
        with self.cond:
            self.pubs.setdefault(tx, []).append(info)
        return info

    def answered(self, tx: str) -> bool:
        with self.cond:
            return tx in self.responses

    def first_response(self, tx: str) -> tuple[float, str, str | None] | None:
        with self.cond:
            r = self.responses.get(tx)
            return r[0] if r else None

    def acked(self, tx: str) -> int:
        """PUBACKs received for the publishes of ``tx``."""
        with self.cond:
            infos = list(self.pubs.get(tx, []))
        return sum(1 for i in infos if puback(i))

    def unanswered(self) -> list[str]:
        """Transactions with fewer responses than PUBACKed publishes (every request gets one)."""
        with self.cond:
            txs = list(self.pubs)
        return [t for t in txs if len(self.responses.get(t, [])) < self.acked(t)]

    def not_acked(self) -> int:
        with self.cond:
            infos = [i for v in self.pubs.values() for i in v]
        return sum(1 for i in infos if not puback(i))

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


def puback(info: mqtt.MQTTMessageInfo) -> bool:
    """True once the broker's PUBACK arrived. (``is_published()`` raises for a message
    published while disconnected, although paho sends it after the reconnect.)"""
    return bool(info._published)  # noqa: SLF001 - set by paho on PUBACK whatever rc says


def submit_body(key: str, sleep_s: float | None) -> dict[str, Any]:
    body: dict[str, Any] = {"kind": "noop", "idempotency_key": key, "transaction": key}
    if sleep_s is not None:
        body["options"] = {"sleep_s": sleep_s}
    return body


class Probe:
    """A ``list`` request every second; the wait for each answer is the service's liveness."""

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.sent: list[tuple[str, float]] = []  # (transaction, monotonic time), in order
        self.stop_ev = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        n = 0
        while not self.stop_ev.is_set():
            tx = f"probe-{n}"
            self.sent.append((tx, time.monotonic()))
            self.peer.publish("list", {"limit": 1, "transaction": tx})
            n += 1
            self.stop_ev.wait(1.0)

    def stop(self) -> None:
        self.stop_ev.set()
        self.thread.join(10)

    def waits(self, now: float) -> list[float]:
        """Each probe's wait: until its first answer, or until now when unanswered."""
        out = []
        for tx, t in list(self.sent):
            r = self.peer.first_response(tx)
            out.append((r[0] if r else now) - t)
        return out

    def silent_s(self, now: float) -> float:
        """How long the service has been silent: the age of the oldest probe sent after the
        newest answered one. (A probe lost on the way, and never answered, while later ones
        are, is a missing response, counted by the checks, not silence.)"""
        sent = list(self.sent)
        i = len(sent)
        while i > 0 and not self.peer.answered(sent[i - 1][0]):
            i -= 1
        return now - sent[i][1] if i < len(sent) else 0.0
