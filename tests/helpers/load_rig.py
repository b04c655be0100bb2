"""A real service under a systemd-like watchdog, with a publisher of requests and a subscriber of
its answers (the load and hostile-client tests); a job store of many succeeded jobs."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from ..conftest import (
    Broker,
    ServiceProcess,
    stop_client,
    wait_until,
)

#: WatchdogSec of the watchdog the tests run the service under (the shipped unit says 30).
WATCHDOG_S = 10.0


class Watchdog:
    """systemd's side of sd_notify: READY=1, WATCHDOG=1 pings, and a kill (SIGABRT) when the
    pings stop for longer than ``watchdog_s`` after READY."""

    def __init__(self, folder: Path, watchdog_s: float = WATCHDOG_S) -> None:
        self.path = str(folder / f"notify-{uuid.uuid4().hex[:6]}.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.watchdog_s = watchdog_s
        self.pid: int | None = None
        self.ready = threading.Event()
        self.last_ping = 0.0
        self.fired = False
        self.longest_gap = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def env(self) -> dict[str, str]:
        return {"NOTIFY_SOCKET": self.path, "WATCHDOG_USEC": str(int(self.watchdog_s * 1_000_000))}

    def watch(self, pid: int) -> None:
        """Watch a new process (after a restart): it must send READY=1 again."""
        self.pid = pid
        self.ready.clear()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096).decode()
            except TimeoutError:
                data = ""
            now = time.monotonic()
            if "READY=1" in data:
                self.ready.set()
                self.last_ping = now
            if "WATCHDOG=1" in data:
                self.longest_gap = max(self.longest_gap, now - self.last_ping)
                self.last_ping = now
            if "STOPPING=1" in data:
                self.ready.clear()
            if self.ready.is_set() and self.pid and now - self.last_ping > self.watchdog_s:
                self.fired = True
                self.ready.clear()
                try:
                    os.kill(self.pid, signal.SIGABRT)
                except ProcessLookupError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


class Subscriber:
    """A paho client subscribed to one topic filter (subscription confirmed on return); the
    subclass's ``_on_message`` takes what arrives, on paho's thread."""

    def __init__(self, broker: Broker, topic: str, qos: int) -> None:
        ready = threading.Event()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="sub-" + uuid.uuid4().hex[:8])
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *a: ready.set()
        self.client.on_connect = lambda c, *a: c.subscribe(topic, qos)
        self.client.connect(broker.host, broker.port, keepalive=120)
        self.client.loop_start()
        assert ready.wait(10), f"could not subscribe to {topic}"

    def _on_message(self, client: Any, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        raise NotImplementedError

    def close(self) -> None:
        stop_client(self.client)


class Responses(Subscriber):
    """A subscriber on ``<base>/response/#``: how many answers each transaction got."""

    def __init__(self, broker: Broker, base: str) -> None:
        self.count: Counter[Any] = Counter()
        self.bodies: dict[Any, dict[str, Any]] = {}
        self.last_at = 0.0
        self._lock = threading.Lock()
        super().__init__(broker, f"{base}/response/#", 1)

    def _on_message(self, client: Any, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        body = json.loads(msg.payload)
        tx = body.get("transaction")
        with self._lock:
            self.count[tx if not isinstance(tx, list) else tuple(tx)] += 1
            self.bodies[tx if not isinstance(tx, list) else tuple(tx)] = body
            self.last_at = time.monotonic()

    def answered(self, txs: list[Any]) -> int:
        with self._lock:
            return sum(1 for t in txs if self.count[t])


class Publisher:
    """A paho client that publishes QoS 1 requests as fast as it can, keeping fewer than
    20,000 unacknowledged (paho's message ids are 16-bit)."""

    def __init__(self, broker: Broker, base: str) -> None:
        self.base = base
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id="pub-" + uuid.uuid4().hex[:8], protocol=mqtt.MQTTv5
        )
        self.client.max_inflight_messages_set(0)
        self.client.max_queued_messages_set(0)
        self.client.connect(broker.host, broker.port, keepalive=120)
        self.client.loop_start()
        self.infos: list[mqtt.MQTTMessageInfo] = []

    def request(self, command: str, body: dict[str, Any] | bytes) -> None:
        if len(self.infos) >= 20_000:
            self.infos[-20_000].wait_for_publish(60)
        payload = body if isinstance(body, bytes) else json.dumps(body)
        self.infos.append(self.client.publish(f"{self.base}/request/{command}", payload, qos=1))

    def submits(self, n: int, prefix: str) -> list[str]:
        txs = []
        for i in range(n):
            tx = f"{prefix}{i}"
            self.request("submit", {"kind": "noop", "idempotency_key": tx, "transaction": tx})
            txs.append(tx)
        return txs

    def close(self) -> None:
        for info in self.infos[-20_000:]:
            info.wait_for_publish(60)
        stop_client(self.client)


class Rig:
    """One service under test with its watchdog, a subscriber of its responses and a
    publisher; the ``rig`` fixture ends all of them (and ``cleanups``), whatever the outcome."""

    def __init__(
        self, broker: Broker, folder: Path, tmp: Path, env: dict[str, str] | None = None, store: Path | None = None
    ) -> None:
        self.broker = broker
        self.dog = Watchdog(tmp)
        self.svc = service(broker, folder, self.dog, env)
        if store is not None:  # start on a copy of this job store
            self.svc.data_dir.mkdir(parents=True)
            shutil.copy(store, self.svc.db)
        self.responses: Responses | None = None
        self.pub: Publisher | None = None
        self.cleanups: list[Callable[[], Any]] = []

    def start(self) -> tuple[ServiceProcess, Responses, Publisher]:
        """Start the service under the watchdog; it, its response subscriber and a publisher."""
        start(self.svc, self.dog)
        self.responses = Responses(self.broker, self.svc.base)
        self.pub = Publisher(self.broker, self.svc.base)
        return self.svc, self.responses, self.pub

    def restart(self) -> float:
        """Start the (stopped or killed) service again; the seconds until it was online."""
        return start(self.svc, self.dog)

    def close(self) -> None:
        for client in (self.pub, self.responses):
            if client is not None:
                try:
                    client.close()
                except Exception:  # a test that failed midway may leave it half-closed
                    pass
        if self.svc.proc is not None and self.svc.proc.poll() is None:
            try:
                self.svc.stop()
            except subprocess.TimeoutExpired:
                pass  # stop() killed it
        self.dog.close()
        for cleanup in self.cleanups:
            cleanup()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Callable[..., Rig]]:
    """``rig(broker, folder, env=None, store=None)``: a :class:`Rig` whose service keeps its
    data in ``folder`` (starting from a copy of the job store ``store``). At the end it stops
    everything and fails the test if the watchdog fired."""
    made: list[Rig] = []

    def make(broker: Broker, folder: Path, env: dict[str, str] | None = None, store: Path | None = None) -> Rig:
        made.append(Rig(broker, folder, tmp_path, env, store))
        return made[-1]

    yield make
    for r in made:
        r.close()
    # "No test here may end with the watchdog having fired" (tests/test_load.py's docstring)
    assert not any(r.dog.fired for r in made), "the watchdog killed the service"


def service(broker: Broker, tmp: Path, dog: Watchdog, env: dict[str, str] | None = None) -> ServiceProcess:
    media = tmp / "media"  # the data stays in tmp (a test's small disk), outside the media root
    media.mkdir(exist_ok=True)
    svc = ServiceProcess(broker, tmp, [media], {"EDGE_QUEUE_LOG_LEVEL": "INFO", **dog.env(), **(env or {})})
    svc.log_path = Path(dog.path).parent / svc.log_path.name  # never on a disk a test fills
    return svc


def start(svc: ServiceProcess, dog: Watchdog) -> float:
    """Start the service under the watchdog; the seconds until it was online."""
    t0 = time.monotonic()
    svc.start(wait_online=False)
    assert svc.proc is not None
    dog.watch(svc.proc.pid)
    svc_online(svc)
    return time.monotonic() - t0


def svc_online(svc: ServiceProcess, timeout: float = 60) -> None:
    got = threading.Event()
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="on-" + uuid.uuid4().hex[:8])
    c.on_connect = lambda cl, *a: cl.subscribe(f"{svc.base}/status", 1)
    c.on_message = lambda cl, u, m: got.set() if m.payload == b"online" else None
    c.connect(svc.broker.host, svc.broker.port)
    c.loop_start()
    try:
        wait_until(lambda: got.is_set() or svc.proc.poll() is not None, timeout, "the service to be online")
        assert svc.proc.poll() is None, svc.log()[-3000:]
    finally:
        c.loop_stop()
        c.disconnect()


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def stop_and_longest_turn_ms(svc: ServiceProcess) -> float:
    assert svc.stop() == 0, svc.log()[-3000:]
    found = re.findall(r"longest loop turn (\d+) ms", svc.log())
    assert found, svc.log()[-2000:]
    return float(found[-1])


def succeeded_store(path: Path, count: int, input_prefix: str) -> Path:
    """A job store at ``path`` holding ``count`` succeeded noop jobs whose inputs are
    ``<input_prefix><n>``, written 1,000 per transaction and checkpointed; returns ``path``."""
    from edge_queue.store import JobSpec, Store, iso

    store = Store(path, "normal")
    now = time.time()
    for first in range(0, count, 1000):
        batch = range(first, min(first + 1000, count))
        store.submit([JobSpec("noop", f"{input_prefix}{i}", {}) for i in batch], now)
    at = iso(now)
    store.conn.execute(
        "UPDATE jobs SET state = 'succeeded', attempt = 1, seq = 3, started_at = ?, finished_at = ?, updated_at = ?",
        [at, at, at],
    )
    store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    return path
