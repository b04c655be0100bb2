"""P8: the HTTP API (docs/http-api.md), side by side with MQTT in one run.

- **HTTP against MQTT, end to end**: one recording of ``minutes_one`` minutes (the four speech
  clips, repeated, 16 kHz mono WAV). HTTP: ``POST /asr?output=srt`` with the file, until the
  answer is read. MQTT: ``submit`` of the same file, until its retained ``succeeded`` is seen
  and its srt file read. Alternated run by run; each run's recording differs in its last
  sample, so neither side is answered from an earlier run's job. Target: HTTP at most 1.05×.
- **Bazarr's burst**: ``uploads`` Bazarr-shaped calls at once (raw 16-bit PCM at 16 kHz, no
  key, ``/asr?task=transcribe&language=en&output=srt&encode=false``), each of ``minutes_burst``
  minutes of the clips in an order of its own, so that each answer can be told apart. Once a
  quarter are answered the service is killed with SIGKILL and started again, and the calls it
  took down are sent again: every answer must be its own order of clips or an error, never
  another's. The service process's memory (RSS, sampled every 50 ms; workers not counted) from
  before the calls to its peak, for the process killed and the one after: target at most 50 MiB.
"""

from __future__ import annotations

import itertools
import json
import shutil
import tempfile
import threading
import time
import wave
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
from harness import Figure, Service, Watcher, speech, uid

CLIPS = ["jfk.flac", "librivox-0870.wav", "librivox-0890.wav", "librivox-0930.wav"]
#: a word of each clip that the others do not have: tells the clips' order in an answer
MARKERS = {
    "jfk.flac": "americans",
    "librivox-0870.wav": "dashwood",
    "librivox-0890.wav": "selfish",
    "librivox-0930.wav": "amiable",
}


def _decoded() -> dict[str, np.ndarray]:
    from faster_whisper import decode_audio

    return {name: decode_audio(str(speech(name))) for name in CLIPS}


def _pcm(clips: dict[str, np.ndarray], order: tuple[str, ...], minutes: float, tail: int = 0) -> bytes:
    gap = np.zeros(8000, dtype=np.float32)
    one = np.concatenate([np.concatenate([clips[n], gap]) for n in order])
    reps = max(1, int(np.ceil(minutes * 60 * 16000 / len(one))))
    audio = np.concatenate([one] * reps + [np.full(1 + tail, 1e-4, dtype=np.float32)])
    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()


def _wav(path: Path, pcm: bytes) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm)
    return path


def _service(folder: Path, port: int) -> Service:
    return Service(
        {
            "EDGE_QUEUE_WORKERS": "2",
            "EDGE_QUEUE_MEDIA_ROOTS": json.dumps([str(folder)]),
            "EDGE_QUEUE_API__ENABLED": "true",
            "EDGE_QUEUE_API__HOST": "127.0.0.1",
            "EDGE_QUEUE_API__PORT": str(port),
            "EDGE_QUEUE_API__ANONYMOUS_USER": "bazarr",
            "EDGE_QUEUE_API__CALLS_PER_MINUTE": "10000",
            "EDGE_QUEUE_HTTP__ENABLED": "false",
        },
        base=uid("p8"),
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _mqtt_side(svc: Service, wav: Path) -> float:
    from harness import Publisher

    watcher = Watcher(svc.base)
    pub = Publisher(svc.base)
    try:
        t0 = time.monotonic()
        pub.submit({"input": str(wav), "options": {"language": "en"}})

        def ours(w: Watcher) -> dict[str, Any] | None:
            return next((b for b in w.last.values() if b.get("input") == str(wav) and b["state"] == "succeeded"), None)

        assert watcher.wait(lambda w: ours(w) is not None, 600), "the MQTT job did not succeed"
        job = ours(watcher)
        assert job is not None
        Path(job["result"]["outputs"]["srt"]).read_bytes()
        return time.monotonic() - t0
    finally:
        pub.close()
        watcher.close()


def _http_side(url: str, wav: Path) -> float:
    t0 = time.monotonic()
    with open(wav, "rb") as f:
        r = httpx.post(
            url + "/asr", params={"output": "srt", "language": "en"}, files={"audio_file": (wav.name, f)}, timeout=600
        )
    assert r.status_code == 200 and r.text.startswith("1\n"), r.text[:300]
    return time.monotonic() - t0


def end_to_end(runs: int, minutes: float, folder: Path, log: Any) -> dict[str, Any]:
    clips = _decoded()
    port = _free_port()
    svc = _service(folder, port)
    svc.start()
    url = f"http://127.0.0.1:{port}"
    got: dict[str, list[float]] = {"HTTP /asr": [], "MQTT submit": []}
    try:
        for r in range(runs):
            wav = _wav(folder / f"one-{r}.wav", _pcm(clips, tuple(CLIPS), minutes, tail=r + 1))
            sides = ["HTTP /asr", "MQTT submit"]
            for name in sides if r % 2 == 0 else sides[::-1]:
                got[name].append(_http_side(url, wav) if name == "HTTP /asr" else _mqtt_side(svc, wav))
                log(f"P8 run {r + 1}/{runs} {name}: {got[name][-1]:.2f} s")
    finally:
        svc.cleanup()
    return {name: Figure(v, "s") for name, v in got.items()}


def burst(uploads: int, minutes: float, folder: Path, log: Any) -> dict[str, Any]:
    """``uploads`` Bazarr-shaped calls at once; once a quarter of them are answered the service is
    killed with SIGKILL and started again, and every call whose connection it took down is sent
    again, as Bazarr sends a subtitle search again. Each answer must be the caller's own text (or
    an error, never someone else's). Service RSS growth from before the calls to the peak, for
    the process killed and for the one after it."""
    clips = _decoded()
    orders = list(itertools.permutations(CLIPS))[:uploads]
    files = []
    for i, order in enumerate(orders):
        path = folder / f"burst-{i}.pcm"
        path.write_bytes(_pcm(clips, order, minutes, tail=i))
        files.append((path, order))
    port = _free_port()
    svc = _service(folder, port)
    svc.start()
    url = f"http://127.0.0.1:{port}"
    answers: list[Any] = [None] * len(files)

    def call(i: int) -> None:
        path, _ = files[i]
        try:
            with open(path, "rb") as f:
                answers[i] = httpx.post(
                    url + "/asr",
                    params={"task": "transcribe", "language": "en", "output": "srt", "encode": "false"},
                    files={"audio_file": ("audio_file", f)},
                    timeout=httpx.Timeout(7200, connect=5),
                )
        except httpx.HTTPError as e:  # the service went away under the call
            answers[i] = e

    def ok(a: Any) -> bool:
        return isinstance(a, httpx.Response) and a.status_code == 200

    def calls(which: list[int]) -> list[threading.Thread]:
        threads = [threading.Thread(target=call, args=(i,)) for i in which]
        for t in threads:
            t.start()
        return threads

    t0 = time.monotonic()
    growth: list[float] = []
    resent = 0
    try:
        with RssPeak(svc.pid) as first:
            threads = calls(list(range(len(files))))
            while sum(ok(a) for a in answers) < max(1, len(files) // 4) and any(t.is_alive() for t in threads):
                time.sleep(0.5)
        growth.append(first.peak - first.before)
        killed_at = time.monotonic() - t0
        svc.kill()
        for t in threads:
            t.join()
        gone = [i for i, a in enumerate(answers) if not ok(a)]
        answered = len(files) - len(gone)
        log(f"P8 burst: killed with SIGKILL after {killed_at:.0f} s, {answered} answered; resending {len(gone)}")
        svc.start()
        resent = len(gone)
        with RssPeak(svc.pid) as second:
            for t in calls(gone):
                t.join()
        growth.append(second.peak - second.before)
    finally:
        svc.cleanup()
    took = time.monotonic() - t0
    own = wrong = refused = 0
    for answer, (_, order) in zip(answers, files, strict=True):
        if not ok(answer):
            refused += 1
            continue
        text = answer.text.lower()
        seen = sorted(order, key=lambda n: text.find(MARKERS[n]) if MARKERS[n] in text else 1 << 30)
        if tuple(seen) == order:
            own += 1
        else:
            wrong += 1
    log(
        f"P8 burst: {own}/{len(files)} answered with their own subtitles, {wrong} with another's, "
        f"{refused} refused, in {took:.0f} s; RSS growth {growth[0]:.0f} MiB before the kill, "
        f"{growth[1]:.0f} MiB after"
    )
    return {
        "uploads": len(files),
        "own": own,
        "wrong": wrong,
        "refused": refused,
        "resent_after_kill": resent,
        "killed_after_s": killed_at,
        "seconds": took,
        "growth": Figure([max(growth)], "MiB"),
        "growth_before_kill_mb": growth[0],
        "growth_after_restart_mb": growth[1],
        "upload_mb": files[0][0].stat().st_size / 1e6,
    }


class RssPeak:
    """The peak RSS (MiB) of process ``pid`` sampled every 50 ms inside the block, and its RSS
    one second after the block begins (``before``)."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.stop = threading.Event()
        self.before = self.peak = 0.0

    def __enter__(self) -> RssPeak:
        time.sleep(1.0)
        self.before = self.peak = self.proc.memory_info().rss / 2**20
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.wait(0.05):
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss / 2**20)
            except psutil.Error:
                return

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def run(runs: int, minutes_one: float, uploads: int, minutes_burst: float, log: Any) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="eqbench-http-"))
    try:
        figures = end_to_end(runs, minutes_one, folder, log)
        result = burst(uploads, minutes_burst, folder, log)
        figures["burst: service RSS growth"] = result.pop("growth")
        return {"figures": figures, "minutes_one": minutes_one, "minutes_burst": minutes_burst, **result}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
