"""Shared pieces of the benchmarks: a service under test, a plain paho watcher, statistics.

Times are ``time.monotonic()`` seconds. On Linux that clock (CLOCK_MONOTONIC) is one clock for
every process of the machine, so a child process may report its own start time with it.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import psutil
from paho.mqtt.enums import CallbackAPIVersion

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
# The recordings of P3 and P4 (long): ../shared/media beside the checkout, as for the tests, or
# the folder named by EQBENCH_MEDIA (a clone elsewhere, e.g. in /tmp).
MEDIA = Path(os.environ.get("EQBENCH_MEDIA") or ROOT.parent / "shared" / "media")
HOST, PORT = "127.0.0.1", 1883


class Broker:
    """A private mosquitto on a free loopback port with the config lines ``extra`` (the delivery
    settings of broker/mosquitto.conf: ``max_queued_messages 0``, so no message is dropped to a
    slow subscriber), without persistence or authentication. The system broker's default of 1,000 queued messages drops
    requests and retained state in bursts, which would make the figures wrong."""

    def __init__(self, extra: str = "") -> None:
        import socket

        with socket.socket() as s:
            s.bind((HOST, 0))
            self.port = s.getsockname()[1]
        self.dir = Path(tempfile.mkdtemp(prefix="eqbroker-"))
        conf = self.dir / "mosquitto.conf"
        conf.write_text(
            f"listener {self.port} {HOST}\nallow_anonymous true\npersistence false\nlog_dest none\n" + extra
        )
        self.proc = subprocess.Popen(
            ["mosquitto", "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        import socket as _s

        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                _s.create_connection((HOST, self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("private mosquitto did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def shipped_broker_settings() -> str:
    """The delivery settings of the project's broker/mosquitto.conf, as config lines."""
    keep = ("max_queued_messages", "max_inflight_messages", "set_tcp_nodelay", "max_queued_bytes")
    lines = (ROOT / "broker" / "mosquitto.conf").read_text().splitlines()
    return "".join(line.strip() + "\n" for line in lines if line.strip().split(" ")[0] in keep)


def speech(name: str) -> Path:
    """A recording of MEDIA/speech; a clear error at once when it is missing (instead of a
    service rejecting the input and a benchmark waiting for jobs that never come)."""
    path = MEDIA / "speech" / name
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: the speech recordings are read from ../shared/media beside the "
            "checkout; set EQBENCH_MEDIA to that folder when the checkout is elsewhere"
        )
    return path


def use_port(port: int) -> None:
    global PORT
    PORT = port
    os.environ["EQBENCH_PORT"] = str(port)


def uid(prefix: str = "bench") -> str:
    return prefix + uuid.uuid4().hex[:10]


# -- statistics -----------------------------------------------------------------------------


@dataclass
class Figure:
    """One figure: the runs it is the median of, with min and max."""

    runs: list[float]
    unit: str

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    def as_dict(self) -> dict[str, Any]:
        return {
            "median": self.median,
            "min": min(self.runs),
            "max": max(self.runs),
            "runs": self.runs,
            "unit": self.unit,
        }


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of a non-empty list."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(p / 100 * len(s) + 0.5) - 1))
    return s[k]


# -- the service under test -----------------------------------------------------------------


@dataclass
class Service:
    """One ``python -m edge_queue serve`` with its own base topic, client id and data dir."""

    env_extra: dict[str, str] = field(default_factory=dict)
    data_dir: Path | None = None
    base: str = field(default_factory=uid)
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    #: the folder whose ``edge_queue`` package runs (``python -m edge_queue`` from there): the
    #: checkout, or an earlier commit's tree (P1's "before" side, :mod:`p1_throughput`)
    root: Path = ROOT
    #: the command that runs the service (default ``python -m edge_queue serve``); P1's "stock
    #: paho" side runs bench/ref/stock_paho.py instead
    argv: list[str] = field(default_factory=lambda: [sys.executable, "-m", "edge_queue", "serve"])

    def __post_init__(self) -> None:
        self._own_dir = self.data_dir is None
        if self.data_dir is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix="eqbench-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.data_dir / "service.log"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_QUEUE_")}
        env.update(
            {
                "EDGE_QUEUE_DATA_DIR": str(self.data_dir),
                "EDGE_QUEUE_MQTT__BASE_TOPIC": self.base,
                "EDGE_QUEUE_MQTT__CLIENT_ID": "svc-" + self.base,
                "EDGE_QUEUE_MQTT__HOST": HOST,
                "EDGE_QUEUE_MQTT__PORT": str(PORT),
                "EDGE_QUEUE_LOG_LEVEL": "WARNING",
                "EDGE_QUEUE_MEDIA_ROOTS": json.dumps([str(MEDIA), str(self.data_dir)]),
            }
        )
        env.update(self.env_extra)
        return env

    def start(self, wait_online: bool = True, timeout_s: float = 60.0) -> float:
        """Start the process; with ``wait_online`` wait for retained ``<base>/status`` online.
        Returns the monotonic time just before the process was started."""
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed by the child's exit
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env(),
            stdout=subprocess.DEVNULL,
            stderr=log,
            cwd=str(self.root),
        )
        log.close()
        if wait_online:
            self.wait_online(timeout_s)
        return self.started_at

    def wait_online(self, timeout_s: float = 60.0) -> float:
        return wait_online(HOST, PORT, self.base, self.proc, self.tail, timeout_s)

    def tail(self, n: int = 1500) -> str:
        return log_tail(self.log_path, n)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def workers(self) -> list[psutil.Process]:
        """The service's worker processes: the children of its multiprocessing forkserver."""
        try:
            kids = psutil.Process(self.pid).children()
        except psutil.NoSuchProcess:
            return []
        out = []
        for k in kids:
            try:
                if "forkserver" in " ".join(k.cmdline()):
                    out.extend(k.children())
            except psutil.Error:
                pass
        return out

    def rss_mb(self) -> float:
        return psutil.Process(self.pid).memory_info().rss / 2**20

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; any worker left behind is killed too."""
        if self.proc is None:
            return
        kids = []
        try:
            kids = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        _, alive = psutil.wait_procs(kids, timeout=5)
        for k in alive:
            try:
                k.kill()
            except psutil.Error:
                pass

    def cleanup(self, clear: bool = True) -> None:
        self.stop()
        if clear:
            clear_retained(self.base)
        if self._own_dir and self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)


def log_tail(path: Path, n: int) -> str:
    """The last ``n`` characters of a log file ("" when it cannot be read)."""
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def wait_online(
    host: str,
    port: int,
    base: str,
    proc: subprocess.Popen[bytes] | None,
    tail: Callable[[], str],
    timeout_s: float = 60.0,
) -> float:
    """Wait for a retained ``online`` on ``<base>/status``; the monotonic time it was seen.
    Raises RuntimeError when ``proc`` exits first, TimeoutError after ``timeout_s`` seconds
    (both with ``tail()`` of the service's log)."""
    got = threading.Event()
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"bench-on-{uuid.uuid4().hex[:8]}")
    c.on_connect = lambda cl, *a: cl.subscribe(f"{base}/status", 1)
    c.on_message = lambda cl, u, m: got.set() if m.payload == b"online" else None
    c.connect(host, port)
    c.loop_start()
    try:
        end = time.monotonic() + timeout_s
        while not got.wait(0.05):
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"service exited {proc.returncode}: {tail()}")
            if time.monotonic() > end:
                raise TimeoutError(f"service not online after {timeout_s} s: {tail()}")
        return time.monotonic()
    finally:
        c.loop_stop()
        c.disconnect()


# -- MQTT -----------------------------------------------------------------------------------


def new_client(tag: str, protocol: int = mqtt.MQTTv5) -> mqtt.Client:
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"bench-{tag}-{uuid.uuid4().hex[:8]}", protocol=protocol)
    c.max_inflight_messages_set(1000)
    c.max_queued_messages_set(0)
    return c


class Watcher:
    """A plain paho subscriber on ``<base>/jobs/+`` (and ``<base>/events``,
    ``<base>/response/submit``): a state counts from whichever carries it first.

    For every job it keeps the monotonic time at which each (state, attempt) was first seen,
    and calls ``on_job`` hooks; ``wait`` blocks until a predicate over the watcher holds.
    """

    def __init__(self, base: str, responses: bool = False, events: bool = False) -> None:
        self.base = base
        self.seen: dict[str, dict[tuple[str, int], float]] = {}
        self.last: dict[str, dict[str, Any]] = {}
        self.counts: dict[str, int] = {}
        self.responses: dict[Any, tuple[float, dict[str, Any]]] = {}
        self.cond = threading.Condition()
        # events carry every transition (the retained topic coalesces states replaced within 20 ms)
        self._subs = (
            [(f"{base}/jobs/+", 1)]
            + ([(f"{base}/events", 1)] if events else [])
            + ([(f"{base}/response/submit", 1)] if responses else [])
        )
        self._ready = threading.Event()
        self.c = new_client("watch")
        self.c.on_connect = self._on_connect
        self.c.on_subscribe = lambda *a: self._ready.set()
        self.c.on_message = self._on_message
        self.c.connect(HOST, PORT, keepalive=60)
        self.c.loop_start()
        if not self._ready.wait(10):
            raise TimeoutError("watcher did not subscribe")

    def _on_connect(self, c: mqtt.Client, *a: Any) -> None:
        c.subscribe(self._subs)

    def _on_message(self, c: mqtt.Client, u: Any, m: mqtt.MQTTMessage) -> None:
        now = time.monotonic()
        if not m.payload:
            return
        body = json.loads(m.payload)
        with self.cond:
            if "/response/" in m.topic:
                self.responses[body.get("transaction")] = (now, body)
            else:
                if m.topic.endswith("/events"):
                    body = body["job"]
                jid, state = body["job_id"], body["state"]
                marks = self.seen.setdefault(jid, {})
                key = (state, body.get("attempt", 0))
                if key not in marks:
                    marks[key] = now
                    self.counts[state] = self.counts.get(state, 0) + 1
                self.last[jid] = body
            self.cond.notify_all()

    def wait(self, pred: Callable[[Watcher], bool], timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        with self.cond:
            while not pred(self):
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.5))
            return True

    def first(self, jid: str, state: str, attempt: int | None = None) -> float | None:
        for (s, a), t in self.seen.get(jid, {}).items():
            if s == state and (attempt is None or a == attempt):
                return t
        return None

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


class SucceededCounter:
    """P1's load generator and watcher in one thread: a publisher of QoS 1 requests and a
    subscriber on ``<base>/jobs/+``, two paho clients driven by the caller's thread with
    ``select`` (``loop_read``/``loop_write``/``loop_misc``), without paho's network threads, as
    the service drives its own client. On a 2-core machine the measuring side then takes as
    little CPU as it can from the side it measures (with a network thread per client and a
    condition variable woken per message, it took about 1 ms of CPU per job).

    :attr:`succeeded` maps a job id to the monotonic time its ``succeeded`` state was first
    seen. Raises ``TimeoutError`` when the subscription is not confirmed within 10 s.
    """

    def __init__(self, base: str) -> None:
        self.base = base
        self.succeeded: dict[str, float] = {}
        # MQTT 3.1.1: paho decodes no properties for it (two objects per message with MQTT 5,
        # an eighth of this side's CPU); it needs none
        self.pub = new_client("pub", mqtt.MQTTv311)
        self.sub = new_client("watch", mqtt.MQTTv311)
        self.sub.on_message = self._on_message
        subscribed: list[bool] = []
        self.sub.on_subscribe = lambda *a: subscribed.append(True)
        self.sub.on_connect = lambda c, *a: c.subscribe(f"{base}/jobs/+", 1)
        for c in (self.pub, self.sub):
            c.connect(HOST, PORT, keepalive=60)
        end = time.monotonic() + 10
        while not subscribed:
            if time.monotonic() > end:
                raise TimeoutError("watcher did not subscribe")
            self.pump(0.05)

    def _on_message(self, c: mqtt.Client, u: Any, m: mqtt.MQTTMessage) -> None:
        if b'"succeeded"' not in m.payload:  # cleared topics and other states
            return
        body = json.loads(m.payload)
        if body["state"] == "succeeded" and body["job_id"] not in self.succeeded:
            self.succeeded[body["job_id"]] = time.monotonic()

    def submit(self, body: dict[str, Any]) -> None:
        """Publish one request on ``<base>/request/submit`` at QoS 1 (paho holds it while 1,000
        are unacknowledged: :meth:`pump` reads the acknowledgements)."""
        self.pub.publish(f"{self.base}/request/submit", json.dumps(body), qos=1)

    def submit_noops(self, n: int, mode: str) -> None:
        """P1's load: ``n`` no-op jobs (distinct inputs) in submits of 100 inputs (``mode``
        ``"batch"``; ``n`` a multiple of 100) or one request per job (``"single"``)."""
        if mode == "batch":
            for b in range(n // 100):
                self.submit({"kind": "noop", "inputs": [f"b{b}-{i}" for i in range(100)]})
            return
        for i in range(n):
            self.submit({"kind": "noop", "input": f"s{i}"})
            if i % 200 == 199:  # take the acknowledgements: paho sends the rest as they come
                self.pump(0)

    def pump(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for either socket, then read, write and keep both alive."""
        clients = (self.pub, self.sub)
        socks = [c.socket() for c in clients]
        want = [c.socket() for c in clients if c.want_write()]
        readable, writable, _ = select.select([s for s in socks if s], [s for s in want if s], [], timeout_s)
        for c, s in zip(clients, socks, strict=True):
            if s in readable:
                c.loop_read(1000)
            if s in writable:
                c.loop_write()
            c.loop_misc()

    def wait(self, n: int, timeout_s: float) -> bool:
        """Drive both clients until ``n`` jobs were seen ``succeeded``; False after ``timeout_s``."""
        end = time.monotonic() + timeout_s
        while len(self.succeeded) < n:
            if time.monotonic() > end:
                return False
            self.pump(0.5)
        return True

    def close(self) -> None:
        for c in (self.pub, self.sub):
            c.disconnect()


class Publisher:
    """A plain paho client that publishes requests at QoS 1."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.c = new_client("pub")
        self.c.connect(HOST, PORT, keepalive=60)
        self.c.loop_start()

    def submit(self, body: dict[str, Any]) -> mqtt.MQTTMessageInfo:
        return self.c.publish(f"{self.base}/request/submit", json.dumps(body), qos=1)

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


def clear_retained(base: str, quiet_s: float = 0.7, timeout_s: float = 120.0) -> int:
    """Publish an empty retained message on every retained topic under ``<base>/``."""
    topics: set[str] = set()
    last = [time.monotonic()]
    lock = threading.Lock()

    def on_message(c: mqtt.Client, u: Any, m: mqtt.MQTTMessage) -> None:
        if m.retain and m.payload:
            with lock:
                topics.add(m.topic)
                last[0] = time.monotonic()

    c = new_client("clear")
    c.on_connect = lambda cl, *a: cl.subscribe(f"{base}/#", 0)
    c.on_message = on_message
    c.connect(HOST, PORT, keepalive=60)
    c.loop_start()
    end = time.monotonic() + timeout_s
    time.sleep(quiet_s)
    while time.monotonic() - last[0] < quiet_s and time.monotonic() < end:
        time.sleep(0.1)
    # In chunks: paho drops (MQTT_ERR_QUEUE_SIZE) a QoS 1 publish whose 16-bit message id is
    # still outstanding, so at most 65,535 may be unacknowledged at once.
    todo = sorted(topics)
    for start in range(0, len(todo), 10_000):
        infos = [c.publish(t, b"", qos=1, retain=True) for t in todo[start : start + 10_000]]
        for i in infos:
            i.wait_for_publish(60)
    c.loop_stop()
    c.disconnect()
    return len(topics)


def queue_payload(base: str, timeout_s: float = 5.0) -> dict[str, Any] | None:
    got: list[dict[str, Any]] = []
    ev = threading.Event()
    c = new_client("q")
    c.on_connect = lambda cl, *a: cl.subscribe(f"{base}/queue", 1)

    def on_message(cl: mqtt.Client, u: Any, m: mqtt.MQTTMessage) -> None:
        if m.payload:
            got.append(json.loads(m.payload))
            ev.set()

    c.on_message = on_message
    c.connect(HOST, PORT)
    c.loop_start()
    ev.wait(timeout_s)
    c.loop_stop()
    c.disconnect()
    return got[-1] if got else None


# -- processes ------------------------------------------------------------------------------


def peak_rss_mb(pid: int) -> float | None:
    """VmHWM of a live process, in MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def kill_tree(proc: subprocess.Popen[Any]) -> None:
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        kids = []
    for p in [*kids]:
        try:
            p.kill()
        except psutil.Error:
            pass
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


# -- machine facts --------------------------------------------------------------------------
