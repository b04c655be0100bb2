"""P6: restart after kill -9 with 1,000 queued and 2 running jobs.

noop jobs with ``sleep_s`` 5, 2 workers. When both running jobs are seen ``running``, the
service gets SIGKILL (its workers must end with it); it is started again on the same store,
base topic and client id. Figure: process start -> both orphaned jobs seen ``running`` with
attempt 2 on their retained topics.
"""

from __future__ import annotations

from typing import Any

import psutil
from harness import Figure, Publisher, Service, Watcher


def one() -> tuple[float, float, int]:
    svc = Service({"EDGE_QUEUE_DURABILITY": "full", "EDGE_QUEUE_WORKERS": "2"})
    try:
        svc.start()
        w = Watcher(svc.base, events=True)  # events carry every queued (the retained topic may skip it)
        pub = Publisher(svc.base)
        for b in range(10):
            pub.submit({"kind": "noop", "inputs": [f"r{b}-{i}" for i in range(100)], "options": {"sleep_s": 5}})
        if not w.wait(lambda w: w.counts.get("queued", 0) >= 1000 and w.counts.get("running", 0) >= 2, 120):
            raise RuntimeError(f"P6 setup: {w.counts}: {svc.tail()}")
        orphans = [j for j in w.seen if w.first(j, "running", 1)]
        kids = psutil.Process(svc.pid).children(recursive=True)
        svc.kill()
        _, alive = psutil.wait_procs(kids, timeout=5)
        for k in alive:  # the product says workers end with the service: count any that did not
            k.kill()
        t0 = svc.start(wait_online=False)
        ok = w.wait(lambda w: all(w.first(j, "running", 2) for j in orphans), 60)
        if not ok:
            raise RuntimeError(f"P6: orphans {orphans} not running again: {[w.last[j] for j in orphans]}")
        t1 = max(w.first(j, "running", 2) for j in orphans)  # type: ignore[type-var]
        t_online = svc.wait_online() - t0
        pub.close()
        w.close()
        return t1 - t0, t_online, len(alive)
    finally:
        svc.cleanup()


def run(runs: int, log: Any) -> dict[str, Any]:
    rec, onl, left = [], [], 0
    for r in range(runs):
        a, b, n = one()
        rec.append(a)
        onl.append(b)
        left += n
        log(f"P6 run {r + 1}/{runs}: orphans running again {a:.2f} s after restart (online at {b:.2f} s)")
    return {
        "figures": {"restart -> orphans running": Figure(rec, "s"), "restart -> online seen": Figure(onl, "s")},
        "workers_left_after_kill": left,
    }
