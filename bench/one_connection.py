"""Request latency of a client that publishes requests and reads the responses on one
connection, with and without Nagle's algorithm on the broker and on the client: the table
of docs/operations.md, "Requests answered 30-90 ms late".

    .venv/bin/python bench/one_connection.py [--requests 20] [--runs 3]

Two private mosquitto processes ("default": mosquitto's own default, Nagle's algorithm on;
"nodelay": ``set_tcp_nodelay true``, as broker/mosquitto.conf), an edge-queue service on
each, and a plain paho client (MQTT 5) that submits noop jobs one after another on one
connection, each once the previous response is in: paho as it comes, and with
``TCP_NODELAY`` set on its socket after ``connect``. Runs alternate; each figure is the median
over runs of the per-run median, in ms, with [min-max]. Writes
bench/results/one-connection-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import harness
import provenance

BENCH = Path(__file__).resolve().parent


def one_run(base: str, port: int, n: int, nodelay: bool) -> list[float]:
    """``n`` submits on one connection; publish -> response seen, ms."""
    c = harness.new_client("one")
    got: dict[str, float] = {}
    cond = threading.Condition()
    subscribed = threading.Event()

    def on_message(cl: Any, u: Any, m: Any) -> None:
        with cond:
            got[json.loads(m.payload).get("transaction")] = time.monotonic()
            cond.notify_all()

    c.on_message = on_message
    c.on_subscribe = lambda *a: subscribed.set()
    c.on_connect = lambda cl, *a: cl.subscribe(f"{base}/response/submit", 1)
    c.connect(harness.HOST, port)
    if nodelay:
        c.socket().setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    c.loop_start()
    try:
        if not subscribed.wait(10):
            raise RuntimeError("the client did not subscribe")
        out = []
        for i in range(n):
            tr = f"t{i}"
            t0 = time.monotonic()
            c.publish(f"{base}/request/submit", json.dumps({"kind": "noop", "transaction": tr}), qos=1)
            with cond:
                if not cond.wait_for(lambda tr=tr: tr in got, 10):
                    raise RuntimeError(f"no response to {tr}")
            out.append((got[tr] - t0) * 1000)
        return out
    finally:
        c.loop_stop()
        c.disconnect()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    shipped = harness.shipped_broker_settings()
    brokers = {
        "default": harness.Broker(shipped.replace("set_tcp_nodelay true\n", "")),
        "nodelay": harness.Broker(shipped),
    }
    services: dict[str, Any] = {}
    figs: dict[str, list[float]] = {}
    try:
        for name, b in brokers.items():
            harness.use_port(b.port)
            services[name] = harness.Service({"EDGE_QUEUE_DURABILITY": "full"})
            services[name].start()
        time.sleep(3.0)  # idle: workers up, start-up publishes done
        for r in range(a.runs):
            for name in brokers if r % 2 == 0 else list(brokers)[::-1]:
                for nodelay in (False, True) if r % 2 == 0 else (True, False):
                    key = f"broker {name}, client {'TCP_NODELAY' if nodelay else 'as it comes'}"
                    vals = one_run(services[name].base, brokers[name].port, a.requests, nodelay)
                    figs.setdefault(key, []).append(statistics.median(vals))
                    print(f"run {r + 1}/{a.runs} {key}: median {statistics.median(vals):.1f} ms", flush=True)
    finally:
        for s in services.values():
            s.cleanup()
        for b in brokers.values():
            b.stop()
    rows = {
        k: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v), "runs": v} for k, v in figs.items()
    }
    for k, v in rows.items():
        print(f"{k}: {v['median_ms']:.1f} [{v['min_ms']:.1f}-{v['max_ms']:.1f}] ms")
    out = BENCH / "results" / f"one-connection-{datetime.now():%Y-%m-%d}.json"
    out.write_text(
        json.dumps({"requests": a.requests, "runs": a.runs, "code": provenance.code_state(), "figures": rows}, indent=1)
        + "\n"
    )
    print(f"wrote {out.relative_to(BENCH.parent)}")


if __name__ == "__main__":
    main()
