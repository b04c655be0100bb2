"""The queue page in a real browser (Debian's chromium driven by playwright-core, tests/browser/),
and what its tests run it on: a private mosquitto with a WebSocket listener, a media root, the
service with its page on."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..conftest import ROOT, Broker, ServiceProcess, need, port_open, wait_until
from .brokers import PrivateMosquitto
from .ports import free_port

BROWSER_DIR = ROOT / "tests" / "browser"
CHROMIUM = Path("/usr/bin/chromium")


class Browser:
    """tests/browser/driver.mjs: one chromium page, commanded over the driver's stdin."""

    def __init__(self, log: Path, width: int = 1100, height: int = 820) -> None:
        self.log = log
        self._err = open(log, "wb")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            ["node", str(BROWSER_DIR / "driver.mjs"), str(CHROMIUM), str(width), str(height)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            cwd=BROWSER_DIR,
        )
        self._id = 0
        self._lock = threading.Lock()
        hello = self._read(60)
        assert hello["ok"], hello
        self.version = hello["value"]

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout)
        if not box or not box[0]:
            raise AssertionError(f"the browser driver did not answer: {self.log.read_text(errors='replace')[-2000:]}")
        return json.loads(box[0])

    def do(self, op: str, timeout: float = 60, **args: Any) -> Any:
        with self._lock:
            self._id += 1
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"id": self._id, "op": op, **args}) + "\n")
            self.proc.stdin.flush()
            answer = self._read(timeout + 10)
        assert answer["id"] == self._id
        if not answer["ok"]:
            raise AssertionError(
                f"browser {op} {args}: {answer['error']}\n{self.log.read_text(errors='replace')[-2000:]}"
            )
        return answer["value"]

    def wait(self, js: str, timeout: float = 30) -> Any:
        """Wait until the page expression ``js`` is truthy; its value."""
        return self.do("wait", timeout=timeout, js=js, timeout_ms=int(timeout * 1000))

    def eval(self, js: str) -> Any:
        return self.do("eval", js=js)

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.do("close", timeout=20)
            self.proc.wait(20)
        except Exception:
            self.proc.kill()
            self.proc.wait(20)
        finally:
            for stream in (self.proc.stdin, self.proc.stdout, self._err):
                if stream is not None:
                    stream.close()


def browser_ready() -> None:
    need(CHROMIUM.is_file(), "chromium not installed (apt-get install chromium)")
    need(shutil.which("node") is not None, "node not installed (apt-get install nodejs npm)")
    need(
        (BROWSER_DIR / "node_modules" / "playwright-core").is_dir(),
        "playwright-core not installed (cd tests/browser && npm ci)",
    )


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    browser_ready()
    b = Browser(tmp_path / "browser.log")
    yield b
    b.close()


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    path = tmp_path / "artifacts"
    path.mkdir()
    return path


@pytest.fixture
def ws_mosquitto(tmp_path: Path) -> Iterator[Broker]:
    """A private mosquitto with the shipped delivery settings, anonymous, and a WebSocket
    listener as in broker/mosquitto.conf."""
    ws = free_port()
    broker = PrivateMosquitto(tmp_path / "mosquitto", extra=f"listener {ws}\nprotocol websockets\n")
    broker.ws_port = ws
    wait_until(lambda: port_open("127.0.0.1", ws), 10, "the WebSocket listener")
    yield broker
    if broker.proc is not None and broker.proc.poll() is None:
        broker.stop()


@pytest.fixture
def media(tmp_path: Path, speech: Path, long_speech: Path) -> Path:
    """A media root: ``speech/jfk.flac`` (11 s), ``speech/not-audio.wav`` (text, not audio) and
    ``long/long-speech.wav`` (about 100 s)."""
    root = tmp_path / "media"
    (root / "speech").mkdir(parents=True)
    (root / "long").mkdir()
    shutil.copy(speech / "jfk.flac", root / "speech" / "jfk.flac")
    (root / "speech" / "not-audio.wav").write_bytes(b"this is not audio\n" * 100)
    shutil.copy(long_speech, root / "long" / "long-speech.wav")
    return root


def page_service(
    service_factory: Any, broker: Broker, media: Path, ws_port: int, **env_over: str
) -> tuple[ServiceProcess, str]:
    port = broker.page_port or free_port()  # the embedded broker takes its own page's origin only
    env = {
        "EDGE_QUEUE_HTTP__ENABLED": "true",
        "EDGE_QUEUE_HTTP__HOST": "127.0.0.1",
        "EDGE_QUEUE_HTTP__PORT": str(port),
        "EDGE_QUEUE_HTTP__WEBSOCKET_PORT": str(ws_port),
        "EDGE_QUEUE_WORKERS": "1",
        # chunks of 5 s and one thread: the 11 s of jfk.flac report their progress more than
        # once (in one 120 s chunk, its one segment goes from 0 to 98 % at once)
        "EDGE_QUEUE_TRANSCRIBE__CHUNK_S": "5",
        "EDGE_QUEUE_TRANSCRIBE__CPU_THREADS": "1",
        **env_over,
    }
    svc = service_factory(broker, [media], env).start()
    return svc, f"http://127.0.0.1:{port}/"
