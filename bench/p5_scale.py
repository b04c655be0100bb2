"""P5: submit and claim latency with 0, 10,000 and 100,000 jobs in the store.

Each run starts a service on a copy of a pre-filled store (bench/prefill.py), waits until it has
republished every stored job (retained, docs/topics.md; that time is reported too), then
submits single noop jobs one at a time: submit = publish -> response seen, claim = publish ->
``running`` seen. Sizes are alternated within each run.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import prefill
from harness import Figure, Publisher, Service, Watcher, uid

SIZES = [0, 10_000, 100_000]


def wait_republished(w: Watcher, size: int, quiet_s: float = 15.0, limit_s: float = 600.0) -> tuple[float, int]:
    """(seconds from the watcher's start to the last republished job seen, jobs seen); gives up
    when no new job arrived for ``quiet_s``."""
    t0 = time.monotonic()
    seen, last = 0, t0
    while time.monotonic() - t0 < limit_s:
        if w.wait(lambda w: w.counts.get("succeeded", 0) >= size, 1.0):
            break
        n = w.counts.get("succeeded", 0)
        if n != seen:
            seen, last = n, time.monotonic()
        elif time.monotonic() - last > quiet_s:
            break
    times = [t for marks in list(w.seen.values()) for t in marks.values()]
    return ((max(times) - t0) if times else 0.0), w.counts.get("succeeded", 0)


def log_(msg: str) -> None:
    print(msg, flush=True)


def one(size: int, k: int, root: Path) -> tuple[float, float, float, int]:
    d = prefill.data_dir_with(size, root, root / uid("p5-"))
    svc = Service({"EDGE_QUEUE_DURABILITY": "full"}, data_dir=d)
    try:
        w = Watcher(svc.base, responses=True)
        svc.start(wait_online=False)
        republished = wait_republished(w, size)
        if republished[1] < size:
            log_(
                f"P5: BUG? only {republished[1]:,} of {size:,} stored jobs were republished "
                f"(retained) after start; measuring anyway"
            )
        svc.wait_online()
        time.sleep(4.0)  # past the start-up scan of retained job topics
        pub = Publisher(svc.base)
        subs, claims = [], []
        for i in range(k):
            tr = f"p5-{i}"
            t0 = time.monotonic()
            pub.submit({"kind": "noop", "input": f"scale{i}", "transaction": tr})
            if not w.wait(lambda w, tr=tr: tr in w.responses, 10):
                raise RuntimeError(f"no response: {svc.tail()}")
            jid = w.responses[tr][1]["data"]["jobs"][0]["job_id"]
            if not w.wait(lambda w, jid=jid: w.first(jid, "succeeded") is not None, 10):
                raise RuntimeError(f"not succeeded: {svc.tail()}")
            subs.append((w.responses[tr][0] - t0) * 1000)
            claims.append(((w.first(jid, "running") or w.first(jid, "succeeded")) - t0) * 1000)  # type: ignore[operator]
            time.sleep(0.01)
        pub.close()
        w.close()
        return statistics.median(subs), statistics.median(claims), republished[0], republished[1]
    finally:
        svc.cleanup()
        shutil.rmtree(d, ignore_errors=True)


def run(runs: int, k: int, log: Any) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="eqp5-"))
    try:
        t = time.monotonic()
        for s in SIZES:
            if s:
                prefill.build(s, root)
        log(f"P5 pre-filled stores in {time.monotonic() - t:.1f} s")
        figs: dict[str, list[float]] = {}
        for r in range(runs):
            for size in SIZES if r % 2 == 0 else SIDES_REV:
                sub, claim, rep, seen = one(size, k, root)
                figs.setdefault(f"republished jobs seen {size}", []).append(seen)
                figs.setdefault(f"submit {size}", []).append(sub)
                figs.setdefault(f"claim {size}", []).append(claim)
                figs.setdefault(f"start+republish {size}", []).append(rep)
                log(
                    f"P5 run {r + 1}/{runs} {size:,} jobs: submit {sub:.1f} ms, claim {claim:.1f} ms, "
                    f"start to republished {rep:.1f} s"
                )
        return {
            "figures": {
                k_: Figure(v, "s" if k_.startswith("start") else "jobs" if k_.startswith("republished") else "ms")
                for k_, v in figs.items()
            },
            "k": k,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


SIDES_REV = SIZES[::-1]
