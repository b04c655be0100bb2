"""P4: memory.

- service RSS idle (fresh service, 4 s after start) and with 10,000 jobs stored (a pre-filled
  store, after the service republished them all);
- worker RSS after 1 and after 200 noop jobs (one worker, so every job runs in the same
  process); growth = after 200 / after 1 - 1;
- long (once per invocation): a 1-hour 16 kHz mono WAV made of the real clips and silence,
  transcribed by edge-queue (peak = the worker's VmHWM, polled), and by faster-whisper alone,
  unchunked, in a separate process (its VmHWM).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
import wave
from pathlib import Path
from typing import Any

import numpy as np
import prefill
from harness import BENCH, Figure, Publisher, Service, Watcher, peak_rss_mb, speech, uid
from p3_transcribe import CLIPS


def small_run(root: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    svc = Service({"EDGE_QUEUE_WORKERS": "1", "EDGE_QUEUE_MAX_JOBS_PER_WORKER": "0"})
    try:
        svc.start()
        time.sleep(4.0)
        out["service idle"] = svc.rss_mb()
        w = Watcher(svc.base)
        pub = Publisher(svc.base)
        pub.submit({"kind": "noop", "input": "m0"})
        if not w.wait(lambda w: w.counts.get("succeeded", 0) >= 1, 30):
            raise RuntimeError(svc.tail())
        time.sleep(0.3)
        (worker,) = svc.workers()
        out["worker after 1 job"] = worker.memory_info().rss / 2**20
        pub.submit({"kind": "noop", "inputs": [f"m{i}" for i in range(1, 200)]})
        if not w.wait(lambda w: w.counts.get("succeeded", 0) >= 200, 120):
            raise RuntimeError(svc.tail())
        time.sleep(0.3)
        (w2,) = svc.workers()
        if w2.pid != worker.pid:
            raise RuntimeError("the worker was replaced between the two measurements")
        out["worker after 200 jobs"] = w2.memory_info().rss / 2**20
        out["worker growth 1->200"] = 100 * (out["worker after 200 jobs"] / out["worker after 1 job"] - 1)
        pub.close()
        w.close()
    finally:
        svc.cleanup()
    d = prefill.data_dir_with(10_000, root, root / uid("p4-"))
    svc = Service({}, data_dir=d)
    try:
        w = Watcher(svc.base)
        svc.start(wait_online=False)
        if not w.wait(lambda w: w.counts.get("succeeded", 0) >= 10_000, 300):
            raise RuntimeError(svc.tail())
        time.sleep(4.0)
        out["service with 10,000 jobs"] = svc.rss_mb()
        w.close()
    finally:
        svc.cleanup()
        shutil.rmtree(d, ignore_errors=True)
    return out


def run(runs: int, log: Any) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="eqp4-"))
    figs: dict[str, list[float]] = {}
    try:
        for r in range(runs):
            res = small_run(root)
            for k, v in res.items():
                figs.setdefault(k, []).append(v)
            log(f"P4 run {r + 1}/{runs}: " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"figures": {k: Figure(v, "%" if "growth" in k else "MiB") for k, v in figs.items()}}


# -- the 1-hour recording -------------------------------------------------------------------


def build_hour(path: Path, seconds: float = 3600.0, gap_s: float = 5.0) -> dict[str, float]:
    """Clips, each followed by ``gap_s`` of silence, repeated up to ``seconds``; 16 kHz s16 mono."""
    from faster_whisper import decode_audio

    sr = 16000
    clips = [decode_audio(str(speech(c)), sampling_rate=sr) for c in CLIPS]
    gap = np.zeros(int(gap_s * sr), dtype=np.float32)
    total = int(seconds * sr)
    speech_samples = 0
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(sr)
        written, i = 0, 0
        while written < total:
            for part, is_speech in ((clips[i % len(clips)], True), (gap, False)):
                part = part[: total - written]
                f.writeframes((np.clip(part, -1, 1) * 32767).astype("<i2").tobytes())
                written += len(part)
                speech_samples += len(part) if is_speech else 0
            i += 1
    return {"duration_s": total / sr, "speech_s": speech_samples / sr}


def long_run(log: Any) -> dict[str, Any]:
    d = Path(tempfile.mkdtemp(prefix="eqp4long-"))
    try:
        (d / "svc").mkdir()
        wav = d / "svc" / "hour.wav"  # inside the service's data dir, one of its media roots
        facts = build_hour(wav)
        log(f"P4 long: built {wav} ({facts['duration_s']:.0f} s, {facts['speech_s']:.0f} s speech)")
        svc = Service({"EDGE_QUEUE_WORKERS": "1"}, data_dir=d / "svc")
        res: dict[str, Any] = {"recording": facts}
        try:
            svc.start()
            w = Watcher(svc.base, responses=True)
            pub = Publisher(svc.base)
            t0 = time.monotonic()
            pub.submit({"kind": "transcribe", "input": str(wav), "transaction": "long"})
            if not w.wait(lambda w: "long" in w.responses, 30):
                raise RuntimeError(f"P4 long: no response: {svc.tail()}")
            if w.responses["long"][1]["status"] != "ok":
                raise RuntimeError(f"P4 long: submit refused: {w.responses['long'][1]}")
            peak = 0.0
            end = t0 + 3600
            while time.monotonic() < end:
                for p in svc.workers():
                    peak = max(peak, peak_rss_mb(p.pid) or 0)
                if w.wait(lambda w: any(b["state"] in ("succeeded", "failed") for b in w.last.values()), 0.5):
                    break
            job = next(iter(w.last.values()))
            if job["state"] != "succeeded":
                raise RuntimeError(f"P4 long: {job['state']} {job.get('error')}")
            res["edge-queue peak worker RSS"] = peak
            res["edge-queue elapsed_s"] = time.monotonic() - t0
            res["edge-queue segments"] = job["result"].get("segments")
            pub.close()
            w.close()
        finally:
            svc.cleanup()
        log(
            f"P4 long: edge-queue peak worker RSS {res['edge-queue peak worker RSS']:.0f} MiB "
            f"in {res['edge-queue elapsed_s']:.0f} s"
        )
        out = subprocess.run(
            [sys.executable, str(BENCH / "ref" / "fw_child.py"), "peak", str(wav)],
            capture_output=True,
            text=True,
            timeout=3600,
        )
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-1500:])
        fw = json.loads(out.stdout.strip().splitlines()[-1])
        res["faster-whisper peak RSS"] = fw["peak_rss_mb"]
        res["faster-whisper elapsed_s"] = fw["transcribe_s"] + fw["load_s"]
        res["faster-whisper segments"] = fw["segments"]
        log(
            f"P4 long: faster-whisper alone peak RSS {fw['peak_rss_mb']:.0f} MiB in "
            f"{res['faster-whisper elapsed_s']:.0f} s"
        )
        return res
    finally:
        shutil.rmtree(d, ignore_errors=True)
