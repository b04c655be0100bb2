"""P1: no-op jobs through MQTT, first publish -> every job ``succeeded`` seen by a subscriber.

Sides, alternated run by run: edge-queue (batches of 100 and single requests, durability
full and normal), edge-queue before its hot path was rebuilt (the service of commit
:data:`BEFORE_COMMIT`, taken from this repository's history with ``git archive``, single
requests, durability full), Huey + SqliteHuey with one worker process, Dramatiq on Redis
(RedisBroker, one worker process with Dramatiq's default 8 threads, one ``send`` per job; a
fresh private redis-server per run, bench/redis_server.py: Redis's default persistence, RDB
snapshots, and, informative, ``appendonly yes`` + ``appendfsync always``, durable as
edge-queue's ``full``), Celery on Redis (RDB; one prefork child, one ``delay()`` per job;
informative), all three in their own venv (bench/.venv-ref, bench/ref_env.py), and the
floor (bench/ref/floor.py: the same SQLite commits and retained publishes, no queue).

Dramatiq's completion is what its client can see: a middleware of the worker counts each
message processed without error in a Redis key after the actor returns (where Dramatiq's
Results middleware stores a result; bench/ref/dramatiq_tasks.py), and the client polls that key
every 5 ms, as Huey's side polls its result store; Celery's worker counts in the same way on
its ``task_success`` signal, sent after the result is stored. Issue 56's targets: edge-queue with one
request per job at least 1.5x Dramatiq on RDB, with batches at least 2x.

The "before" side shows what the rebuilt hot path gained on the machine at hand, measured the
same way as the others. P1's targets keep the figures they were set with: 2,160 jobs/s (ten
times the 216 that code ran where the targets were set, at 2.67 ms of service CPU per job,
with the load generator of that day) and 0.3 ms. Without git or the commit (a shallow clone),
the side is skipped.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from harness import BENCH, Figure, Service, SucceededCounter, clear_retained, uid
from redis_server import RedisServer
from ref_env import ensure_ref_venv, ref_versions

#: The last commit before the hot path was rebuilt (2026-11-29): P1's "before" side.
BEFORE_COMMIT = "99beaa1"


def before_tree(dest: Path, log: Any, commit: str = BEFORE_COMMIT) -> Path | None:
    """The ``edge_queue`` package of ``commit`` (default :data:`BEFORE_COMMIT`) unpacked under
    ``dest`` (from this repository's git history), or None when git or the commit is missing
    (logged)."""
    try:
        archive = subprocess.run(
            ["git", "-C", str(BENCH.parent), "archive", commit, "edge_queue"],
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        log(f"P1: the side of commit {commit} is skipped: no tree of it ({e})")
        return None
    return dest


def edge_queue_run(
    n: int, durability: str, mode: str, timeout_s: float = 300.0, root: Path | None = None, stock: bool = False
) -> tuple[float, float]:
    """One run on a fresh service: ``(jobs per second, service CPU ms per job)``. Jobs per
    second: from the first request published to the last job seen ``succeeded`` on its retained
    topic (:class:`harness.SucceededCounter`). CPU: user + system time of the service process
    (all its threads, not its workers) over the same span, divided by ``n``. ``root``: the
    folder whose ``edge_queue`` runs (default: this checkout). ``stock``: the service runs with
    paho's own client in place of its short paths (bench/ref/stock_paho.py)."""
    extra: dict[str, Any] = {"root": root} if root else {}
    if stock:
        extra["argv"] = [sys.executable, str(BENCH / "ref" / "stock_paho.py"), "serve"]
    svc = Service({"EDGE_QUEUE_DURABILITY": durability}, **extra)
    try:
        svc.start()
        load = SucceededCounter(svc.base)
        time.sleep(0.3)
        load.pump(0)
        proc = psutil.Process(svc.proc.pid)
        c0 = proc.cpu_times()
        t0 = time.monotonic()
        load.submit_noops(n, mode)
        if not load.wait(n, timeout_s):
            raise RuntimeError(f"only {len(load.succeeded)} succeeded after {timeout_s} s: {svc.tail()}")
        c1 = proc.cpu_times()
        t1 = max(load.succeeded.values())
        load.close()
        cpu_ms = (c1.user + c1.system - c0.user - c0.system) * 1000 / n
        return n / (t1 - t0), cpu_ms
    finally:
        svc.cleanup()


def floor_run(n: int, sync: str = "full") -> float:
    base = uid("floor")
    load = SucceededCounter(base)  # the same watcher as edge-queue's side; the floor publishes itself
    with tempfile.TemporaryDirectory(prefix="eqfloor-") as d:
        p = subprocess.Popen(
            [sys.executable, str(BENCH / "ref" / "floor.py"), base, str(n), str(Path(d) / "floor.db"), sync],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            t0 = json.loads(p.stdout.readline())["t0"]  # type: ignore[union-attr]
            if not load.wait(n, 300):
                raise RuntimeError(f"floor: only {len(load.succeeded)} succeeded")
            t1 = max(load.succeeded.values())
            p.wait(60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    load.close()
    clear_retained(base)
    return n / (t1 - t0)


def huey_run(py: Path, n: int) -> float:
    with tempfile.TemporaryDirectory(prefix="eqhuey-") as d:
        out = subprocess.run(
            [str(py), str(BENCH / "ref" / "huey_drain.py"), str(n), d], capture_output=True, text=True, timeout=900
        )
        if out.returncode != 0:
            raise RuntimeError(f"huey: {out.stderr[-1500:]}")
        res = json.loads(out.stdout.strip().splitlines()[-1])
        if res["done"] < n:
            raise RuntimeError(f"huey drained only {res['done']} of {n}")
        return res["jobs_per_s"]


def redis_ref_run(py: Path, n: int, queue: str, persistence: str) -> float:
    """One run of ``queue`` (``dramatiq`` or ``celery``: bench/ref/<queue>_drain.py) on a fresh
    private redis-server with the persistence ``persistence`` (``rdb`` or ``aof-always``:
    bench/redis_server.py): jobs per second from the first send to the worker's counter of
    processed jobs seen at ``n``."""
    with RedisServer(persistence) as redis, tempfile.TemporaryDirectory(prefix=f"eq{queue}-") as d:
        out = subprocess.run(
            [str(py), str(BENCH / "ref" / f"{queue}_drain.py"), str(n), redis.url, d],
            capture_output=True,
            text=True,
            timeout=900,
        )
        if out.returncode != 0:
            raise RuntimeError(f"{queue} ({persistence}): {out.stderr[-1500:]}")
        res = json.loads(out.stdout.strip().splitlines()[-1])
        if res["done"] < n:
            raise RuntimeError(f"{queue} ({persistence}) processed only {res['done']} of {n}")
        return float(res["jobs_per_s"])


SIDES = [
    "eq batch full",
    "eq batch normal",
    "eq single full",
    "eq single normal",
    "before single full",
    "stock batch full",
    "stock single full",
    "huey",
    "dramatiq rdb",
    "dramatiq aof-always",
    "celery rdb",
    "floor full",
]
#: with a baseline commit (``bench/run.py --baseline``): that commit's service, same modes
BASE_SIDES = ["base batch full", "base single full"]


def run(runs: int, n: int, log: Any, baseline: str | None = None) -> dict[str, Any]:
    """P1's sides, alternated run by run. ``baseline``: a commit whose service runs beside this
    tree's, batch and single, durability full (a change measured against the code before it)."""
    py = ensure_ref_venv(log)
    with tempfile.TemporaryDirectory(prefix="eqbefore-") as d, tempfile.TemporaryDirectory(prefix="eqbase-") as b:
        before = before_tree(Path(d), log)
        base = before_tree(Path(b), log, baseline) if baseline else None
        sides = [s for s in SIDES if before is not None or not s.startswith("before ")]
        if base is not None:
            sides += BASE_SIDES
        res = _run(runs, n, log, py, sides, before, base)
        res["baseline"] = baseline if base is not None else None
        return res


def _run(
    runs: int, n: int, log: Any, py: Path, sides: list[str], before: Path | None, base: Path | None = None
) -> dict[str, Any]:
    got: dict[str, list[float]] = {s: [] for s in sides}
    cpu: dict[str, list[float]] = {s: [] for s in sides if s.startswith(("eq ", "before ", "stock ", "base "))}
    for r in range(runs):
        order = sides if r % 2 == 0 else sides[::-1]
        for side in order:
            if side == "huey":
                v = huey_run(py, n)
            elif side.startswith(("dramatiq ", "celery ")):
                queue, persistence = side.split()
                v = redis_ref_run(py, n, queue, persistence)
            elif side == "floor full":
                v = floor_run(n, "full")
            else:
                who, mode, dur = side.split()
                if who == "before":  # about 10 times slower: 5,000 jobs take 25 s on a fast machine
                    v, ms = edge_queue_run(n, dur, mode, 900.0, before)
                elif who == "base":
                    v, ms = edge_queue_run(n, dur, mode, 300.0, base)
                else:
                    v, ms = edge_queue_run(n, dur, mode, stock=who == "stock")
                cpu[side].append(ms)
            got[side].append(v)
            log(
                f"P1 run {r + 1}/{runs} {side}: {v:,.0f} jobs/s"
                + (f", service CPU {ms:.3f} ms/job" if side in cpu else "")
            )
    refs = ref_versions(py) or {}
    figures = {s: Figure(v, "jobs/s") for s, v in got.items()}
    figures.update({f"{s} cpu": Figure(v, "ms/job") for s, v in cpu.items()})
    return {
        "figures": figures,
        "n": n,
        "huey_version": refs.get("huey", "?"),
        "dramatiq_version": refs.get("dramatiq", "?"),
        "celery_version": refs.get("celery", "?"),
        "before_commit": BEFORE_COMMIT if before else None,
    }
