"""P3: 20 short real clips transcribed, three ways, alternated run by run.

- edge-queue: a service whose workers already ran a transcription (warm), all clips submitted
  as one batch; first publish -> every job ``succeeded`` seen.
- direct: one process that loads the model once (not timed) and transcribes the clips in a loop.
- per file: one new ``python`` process per clip, run one after another (timed whole).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

from harness import BENCH, Figure, Publisher, Service, Watcher, speech

CLIPS = ["jfk.flac", "librivox-0870.wav", "librivox-0890.wav", "librivox-0930.wav"]
FW = str(BENCH / "ref" / "fw_child.py")


def clip_list(n: int) -> list[str]:
    paths = [str(speech(c)) for c in CLIPS]
    return [paths[i % len(paths)] for i in range(n)]


def edge_queue_run(files: list[str]) -> float:
    svc = Service({"EDGE_QUEUE_DURABILITY": "full"})
    try:
        svc.start()
        w = Watcher(svc.base)
        pub = Publisher(svc.base)
        # Warm: one transcription per worker slot (max_concurrency 1 runs them one by one).
        pub.submit({"kind": "transcribe", "inputs": files[:2]})
        if not w.wait(lambda w: w.counts.get("succeeded", 0) >= 2, 120):
            raise RuntimeError(f"warm-up failed: {w.counts} {svc.tail()}")
        warm = set(w.seen)
        time.sleep(0.5)
        t0 = time.monotonic()
        pub.submit({"kind": "transcribe", "inputs": files})
        n = len(files)
        if not w.wait(lambda w: sum(1 for j in w.seen if j not in warm and w.first(j, "succeeded")) >= n, 600):
            bad = [w.last[j].get("error") for j in w.seen if w.last[j]["state"] == "failed"]
            raise RuntimeError(f"edge-queue P3: {w.counts} {bad[:2]} {svc.tail()}")
        t1 = max(w.first(j, "succeeded") or 0 for j in w.seen if j not in warm)
        pub.close()
        w.close()
        return t1 - t0
    finally:
        svc.cleanup()


def direct_run(files: list[str]) -> float:
    out = subprocess.run([sys.executable, FW, "loop", *files], capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-1500:])
    return json.loads(out.stdout.strip().splitlines()[-1])["transcribe_s"]


def per_file_run(files: list[str]) -> float:
    t0 = time.monotonic()
    for f in files:
        subprocess.run([sys.executable, FW, "one", f], capture_output=True, check=True, timeout=300)
    return time.monotonic() - t0


SIDES = {"edge-queue": edge_queue_run, "direct loop": direct_run, "process per file": per_file_run}


def run(runs: int, n: int, log: Any) -> dict[str, Any]:
    files = clip_list(n)
    got: dict[str, list[float]] = {s: [] for s in SIDES}
    names = list(SIDES)
    for r in range(runs):
        for side in names if r % 2 == 0 else names[::-1]:
            v = SIDES[side](files)
            got[side].append(v)
            log(f"P3 run {r + 1}/{runs} {side}: {v:.2f} s for {n} clips")
    return {"figures": {s: Figure(v, "s") for s, v in got.items()}, "n": n}
