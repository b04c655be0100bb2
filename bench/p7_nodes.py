"""P7: worker nodes (docs/nodes.md), side by side in one run, alternated run by run.

- **Throughput**: ``n`` no-op jobs, one request each (P1's load generator), first publish ->
  every ``succeeded`` seen, with (a) the hub's own 2 workers, (b) a hub with ``workers = 0``
  and 1 node of 2 slots, (c) a hub with ``workers = 0`` and 2 nodes of 1 slot each.
- **Hand-out latency**: submit -> ``running`` seen and submit -> ``succeeded`` seen, one job
  at a time, on the hub's own worker and on a node (p50, p99): what a hand-out over MQTT adds.
- **Transcription batch**: ``k`` copies of ../shared/media/speech/jfk.flac, submit -> all
  ``succeeded``, on the hub alone (1 worker) and on the hub plus 1 node (1 slot each,
  ``kinds.transcribe.max_concurrency = 2``).

Every "box" here is a process on this one machine (the nodes read the hub's media folder
directly, an identity path map): the figures show what the node protocol costs, and what a
second box adds only as far as this machine's cores allow (on a 2-core box, two
transcriptions share the same two cores). Nodes send heartbeats every 5 s (the default).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import HOST, PORT, Figure, Publisher, Service, SucceededCounter, Watcher, percentile, speech, uid


def _hub(base: str, workers: int, nodes: list[str], extra: dict[str, str] | None = None) -> Service:
    return Service(
        {
            "EDGE_QUEUE_DURABILITY": "full",
            "EDGE_QUEUE_WORKERS": str(workers),
            "EDGE_QUEUE_ACCESS__NODES": json.dumps(nodes),
            "EDGE_QUEUE_LOG_LEVEL": "INFO",
            **(extra or {}),
        },
        base=base,
    )


def _node(base: str, node_id: str, slots: int, media: list[str]) -> Service:
    return Service(
        {
            "EDGE_QUEUE_NODES__NODE_ID": node_id,
            "EDGE_QUEUE_WORKERS": str(slots),
            "EDGE_QUEUE_MEDIA_ROOTS": json.dumps(media),
            "EDGE_QUEUE_LOG_LEVEL": "INFO",
        },
        base=base,
        argv=[sys.executable, "-m", "edge_queue", "worker"],
    )


def _setup(
    workers: int, nodes: dict[str, int], extra: dict[str, str] | None = None, media: list[str] | None = None
) -> tuple[Service, list[Service]]:
    """A hub and its nodes, started; returns once the hub logged every node online."""
    base = uid("p7")
    hub = _hub(base, workers, list(nodes), extra)
    hub.start()
    procs = []
    for node_id, slots in nodes.items():
        n = _node(base, node_id, slots, media or [str(hub.data_dir)])
        n.start(wait_online=False)
        procs.append(n)
    end = time.monotonic() + 60
    while not all(f"node {n} online" in hub.tail(100_000) for n in nodes):
        if time.monotonic() > end:
            raise RuntimeError(f"nodes not online: {hub.tail()}")
        time.sleep(0.05)
    time.sleep(1.0)  # start-up publishes done
    return hub, procs


def _teardown(hub: Service, nodes: list[Service]) -> None:
    for n in nodes:
        n.stop()
        n.cleanup(clear=False)
    hub.cleanup()


SIDES = {
    "hub, 2 workers": (2, {}),
    "hub 0 workers + 1 node (2 slots)": (0, {"node1": 2}),
    "hub 0 workers + 2 nodes (1 slot each)": (0, {"node1": 1, "node2": 1}),
}


def throughput(side: str, n: int) -> float:
    workers, nodes = SIDES[side]
    hub, procs = _setup(workers, nodes)
    try:
        load = SucceededCounter(hub.base)
        load.pump(0)
        t0 = time.monotonic()
        load.submit_noops(n, "single")
        if not load.wait(n, 600):
            raise RuntimeError(f"{side}: only {len(load.succeeded)} of {n} succeeded: {hub.tail()}")
        t1 = max(load.succeeded.values())
        load.close()
        return n / (t1 - t0)
    finally:
        _teardown(hub, procs)


def latency(where: str, n: int) -> dict[str, list[float]]:
    hub, procs = _setup(1, {}) if where == "hub" else _setup(0, {"node1": 1})
    out: dict[str, list[float]] = {"submit->running": [], "submit->succeeded": []}
    try:
        w = Watcher(hub.base, responses=True, events=True)
        pub = Publisher(hub.base)
        time.sleep(1.0)
        for i in range(n):
            tr = f"t{i}"
            t0 = time.monotonic()
            pub.submit({"kind": "noop", "input": f"lat{i}", "transaction": tr})
            if not w.wait(lambda w, tr=tr: tr in w.responses, 10):
                raise RuntimeError(f"no response to {tr}: {hub.tail()}")
            jid = w.responses[tr][1]["data"]["jobs"][0]["job_id"]
            if not w.wait(lambda w, jid=jid: w.first(jid, "succeeded") is not None, 10):
                raise RuntimeError(f"job {jid} not succeeded: {hub.tail()}")
            t_run, t_ok = w.first(jid, "running"), w.first(jid, "succeeded")
            out["submit->running"].append(((t_run or t_ok) - t0) * 1000)  # type: ignore[operator]
            out["submit->succeeded"].append((t_ok - t0) * 1000)  # type: ignore[operator]
            time.sleep(0.02)
        pub.close()
        w.close()
    finally:
        _teardown(hub, procs)
    return out


def transcriptions(where: str, k: int, folder: Path) -> float:
    files = [str(p) for p in sorted(folder.glob("*.flac"))][:k]
    extra = {"EDGE_QUEUE_KINDS": json.dumps({"transcribe": {"max_concurrency": 2}})}
    media = [str(folder)]
    extra["EDGE_QUEUE_MEDIA_ROOTS"] = json.dumps(media)
    hub, procs = _setup(1, {}, extra, media) if where == "hub" else _setup(1, {"node1": 1}, extra, media)
    try:
        w = Watcher(hub.base, responses=True, events=True)
        pub = Publisher(hub.base)
        t0 = time.monotonic()
        pub.submit({"kind": "transcribe", "inputs": files, "options": {"formats": ["txt"]}, "transaction": "b"})
        if not w.wait(lambda w: "b" in w.responses, 30):
            raise RuntimeError(f"no response: {hub.tail()}")
        ids = [j["job_id"] for j in w.responses["b"][1]["data"]["jobs"]]
        if not w.wait(lambda w: all(w.first(j, "succeeded") is not None for j in ids), 900):
            raise RuntimeError(f"transcriptions not done: {hub.tail()}")
        took = max(w.first(j, "succeeded") for j in ids) - t0  # type: ignore[type-var]
        pub.close()
        w.close()
        return took
    finally:
        _teardown(hub, procs)


def run(runs: int, n: int, k: int, log: Any) -> dict[str, Any]:
    figs: dict[str, list[float]] = {}
    folder = Path(tempfile.mkdtemp(prefix="eqp7-media-"))
    try:
        for i in range(k):
            shutil.copy(speech("jfk.flac"), folder / f"jfk-{i:02d}.flac")
        for r in range(runs):
            for side in SIDES:
                v = throughput(side, n)
                figs.setdefault(f"noop jobs/s: {side}", []).append(v)
                log(f"P7 run {r + 1}: {side}: {v:,.0f} jobs/s")
            for where in ("hub", "node"):
                lat = latency(where, 50 if n < 1000 else 200)
                for metric, values in lat.items():
                    for p in (50, 99):
                        figs.setdefault(f"{metric} p{p}: {where}", []).append(percentile(values, p))
                log(f"P7 run {r + 1}: hand-out on {where}: running p50 {percentile(lat['submit->running'], 50):.1f} ms")
            for where, label in (("hub", "hub alone (1 worker)"), ("node", "hub (1 worker) + 1 node (1 slot)")):
                took = transcriptions(where, k, folder)
                figs.setdefault(f"{k} transcriptions wall s: {label}", []).append(took)
                log(f"P7 run {r + 1}: {k} transcriptions, {label}: {took:.1f} s")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    units = {"noop": "jobs/s", "submit": "ms", f"{k} ": "s"}
    return {
        "n": n,
        "k": k,
        "figures": {
            key: Figure(v, next(u for prefix, u in units.items() if key.startswith(prefix))) for key, v in figs.items()
        },
        "broker": f"{HOST}:{PORT}",
    }
