"""P2: idle latency, one noop job at a time on an idle service.

Per job: publish -> response seen, publish -> ``running`` seen, publish -> ``succeeded`` seen
(all by a plain paho subscriber of the job topics and ``<base>/events``, which carries every
transition; the retained job topic coalesces a ``running`` that lasts under 20 ms), and
``finished_at`` (the service's wall clock, ms) ->
``succeeded`` seen. p50/p90/p95/p99 per run; each figure is the median over runs.

Celery on Redis (issue 56's reference for P2), in the same runs, its order alternated with the
brokers': a Celery worker with one prefork child on a fresh private redis-server with Redis's
default persistence (bench/redis_server.py), Redis its broker and result backend, Celery from
bench/.venv-ref (bench/ref_env.py). Per task, ``delay()`` -> the result seen by the client
(``AsyncResult.get()``, notified by the result backend's pub/sub), the same measure as
edge-queue's submit->succeeded, one task at a time, 10 ms apart (bench/ref/celery_latency.py).
The target: edge-queue's submit->succeeded p50 at most Celery's.

The floor, in the same runs on each broker: publish -> response seen through an MQTT echo
(bench/ref/echo.py, its own process) with the same publishing and watching clients, so the
figures can be read on a machine of another speed: what the service adds is the difference.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import BENCH, HOST, Figure, Publisher, Service, Watcher, percentile, uid
from redis_server import RedisServer
from ref_env import ensure_ref_venv, ref_versions

from edge_queue.store import parse_iso

METRICS = ["submit->response", "submit->running", "submit->succeeded", "finished_at->succeeded seen"]


def one_run(n: int, log: Any, root: Path | None = None) -> dict[str, list[float]]:
    """One service (this checkout's, or the tree at ``root``), ``n`` jobs one at a time."""
    svc = Service({"EDGE_QUEUE_DURABILITY": "full"}, **({"root": root} if root else {}))
    out: dict[str, list[float]] = {m: [] for m in METRICS}
    try:
        svc.start()
        w = Watcher(svc.base, responses=True, events=True)
        pub = Publisher(svc.base)
        time.sleep(4.0)  # idle: workers up, start-up publishes and the 3 s retained scan done
        for i in range(n):
            tr = f"t{i}"
            wall0, t0 = time.time(), time.monotonic()
            pub.submit({"kind": "noop", "input": f"lat{i}", "transaction": tr})
            if not w.wait(lambda w, tr=tr: tr in w.responses, 10):
                raise RuntimeError(f"no response to {tr}: {svc.tail()}")
            t_resp, body = w.responses[tr]
            jid = body["data"]["jobs"][0]["job_id"]
            if not w.wait(lambda w, jid=jid: w.first(jid, "succeeded") is not None, 10):
                raise RuntimeError(f"job {jid} not succeeded: {svc.tail()}")
            t_run, t_ok = w.first(jid, "running"), w.first(jid, "succeeded")
            fin = parse_iso(w.last[jid]["finished_at"])
            out["submit->response"].append((t_resp - t0) * 1000)
            out["submit->running"].append(((t_run or t_ok) - t0) * 1000)  # type: ignore[operator]
            out["submit->succeeded"].append((t_ok - t0) * 1000)  # type: ignore[operator]
            out["finished_at->succeeded seen"].append(((t_ok - t0) + wall0 - fin) * 1000)  # type: ignore[operator]
            time.sleep(0.01)  # let the service go idle again
        pub.close()
        w.close()
    finally:
        svc.cleanup()
    return out


def echo_run(n: int, port: int) -> list[float]:
    """``n`` requests, one at a time, through bench/ref/echo.py: publish -> response seen, ms."""
    base = uid("echo")
    echo = subprocess.Popen(
        [sys.executable, str(BENCH / "ref" / "echo.py"), HOST, str(port), base], stdout=subprocess.PIPE, text=True
    )
    out: list[float] = []
    try:
        if echo.stdout is None or echo.stdout.readline().strip() != "ready":
            raise RuntimeError("the echo did not subscribe")
        w = Watcher(base, responses=True)
        pub = Publisher(base)
        time.sleep(1.0)
        for i in range(n):
            tr = f"e{i}"
            t0 = time.monotonic()
            pub.submit({"transaction": tr})
            if not w.wait(lambda w, tr=tr: tr in w.responses, 10):
                raise RuntimeError(f"no echo of {tr}")
            out.append((w.responses[tr][0] - t0) * 1000)
            time.sleep(0.01)
        pub.close()
        w.close()
    finally:
        echo.kill()
        echo.wait()
    return out


def celery_run(py: Path, n: int) -> list[float]:
    """``n`` Celery tasks, one at a time, on a fresh private redis-server (RDB, Redis's
    default): ``delay()`` -> result seen, ms each (bench/ref/celery_latency.py)."""
    with RedisServer("rdb") as redis, tempfile.TemporaryDirectory(prefix="eqcelery-") as d:
        out = subprocess.run(
            [str(py), str(BENCH / "ref" / "celery_latency.py"), str(n), redis.url, d],
            capture_output=True,
            text=True,
            timeout=120 + n,
        )
        if out.returncode != 0:
            raise RuntimeError(f"celery: {out.stderr[-1500:]}")
        got: list[float] = json.loads(out.stdout.strip().splitlines()[-1])["submit->succeeded"]
        return got


def run(runs: int, n: int, log: Any, brokers: dict[str, int], baseline: str | None = None) -> dict[str, Any]:
    """``brokers``: name -> port; every run measures on each broker, alternating the order.
    ``baseline``: a commit whose service is measured too, alternated with this tree's
    (figures ``<broker> base: ...``)."""
    import harness
    from p1_throughput import before_tree

    py = ensure_ref_venv(log)
    with tempfile.TemporaryDirectory(prefix="eqbase-") as d:
        base = before_tree(Path(d), log, baseline) if baseline else None
        res = _run(runs, n, log, brokers, base, py)
        res["baseline"] = baseline if base is not None else None
        res["celery_version"] = (ref_versions(py) or {}).get("celery", "?")
        harness.use_port(brokers[next(iter(brokers))])
        return res


PERCENTILES = (50, 90, 95, 99)


def _run(runs: int, n: int, log: Any, brokers: dict[str, int], base: Path | None, py: Path) -> dict[str, Any]:
    import harness

    figs: dict[str, list[float]] = {}
    names = ["celery", *brokers]
    for r in range(runs):
        for b in names if r % 2 == 0 else names[::-1]:
            if b == "celery":
                lat = celery_run(py, n)
                for p in PERCENTILES:
                    figs.setdefault(f"celery: submit->succeeded p{p}", []).append(percentile(lat, p))
                log(
                    f"P2 run {r + 1}/{runs} [celery on redis]: submit->succeeded "
                    f"p50 {percentile(lat, 50):.1f}, p90 {percentile(lat, 90):.1f} ms"
                )
                continue
            harness.use_port(brokers[b])
            trees = [("", None), (" base", base)] if base is not None else [("", None)]
            for tag, root in trees if r % 2 == 0 else trees[::-1]:
                res = one_run(n, log, root)
                for m, vals in res.items():
                    for p in PERCENTILES:
                        figs.setdefault(f"{b}{tag}: {m} p{p}", []).append(percentile(vals, p))
                ps = [percentile(res["submit->running"], p) for p in (50, 95, 99)]
                ok = [percentile(res["submit->succeeded"], p) for p in (50, 90)]
                log(
                    f"P2 run {r + 1}/{runs} [{b}{', baseline' if tag else ''}]: submit->running "
                    f"p50 {ps[0]:.1f}, p95 {ps[1]:.1f}, p99 {ps[2]:.1f} ms; submit->succeeded "
                    f"p50 {ok[0]:.1f}, p90 {ok[1]:.1f} ms"
                )
            echo = echo_run(n, brokers[b])  # the floor, on the same broker
            for p in (50, 95, 99):
                figs.setdefault(f"{b}: echo floor p{p}", []).append(percentile(echo, p))
            log(f"P2 run {r + 1}/{runs} [{b}]: echo floor p50 {percentile(echo, 50):.2f} ms")
    harness.use_port(next(iter(brokers.values())))
    return {"figures": {k: Figure(v, "ms") for k, v in figs.items()}, "n": n}
