"""A node account attacking the hub while an honest node transcribes beside it (docs/nodes.md,
"What the hub takes from a node"), one command:

    .venv/bin/python bench/node_attack.py [--seconds 60]

On a private mosquitto, a hub with no workers of its own, an honest node (``edge-queue worker``,
1 slot) and a listed node account ``evil`` (a plain MQTT client) that, all at once:

- takes 8 jobs and sends 16 chunks of 4 MiB for each (kept chunks: bounded across all jobs);
- sends 20 heartbeats of about 4 MB listing 200,000 jobs it does not hold;
- sends 20,000 forged ``done`` messages, and 20 announcements with a 3.4 MB list of kinds.

Measured: the hub's peak memory (VmHWM), its longest loop turn (logged at its stop), the size of
its store, the lines it logged, and whether the honest node's transcriptions all succeeded.
Figures to bench/results/node-attack-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
import provenance  # noqa: E402
from harness import BENCH, HOST, Publisher, Service, Watcher, peak_rss_mb, speech, uid  # noqa: E402


def evil_node(base: str, stop: threading.Event, counts: dict[str, int]) -> None:
    """The attacking node account: takes jobs, floods chunks, heartbeats, forged outcomes and
    announcements."""
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="evil-" + uid("x"))
    held: list[tuple[str, int]] = []

    def on_message(cl: Any, u: Any, m: Any) -> None:
        msg = json.loads(m.payload)
        if msg.get("op") == "run":
            held.append((msg["job_id"], msg["attempt"]))

    c.on_message = on_message
    c.connect(HOST, harness.PORT, 60)
    c.loop_start()
    c.subscribe(f"{base}/nodes/evil/down", 1)
    up, node = f"{base}/nodes/evil/up", f"{base}/nodes/evil"
    c.publish(node, json.dumps({"v": 1, "state": "online", "kinds": ["transcribe"], "slots": 8}), 1, retain=True)
    chunk = {"segments": [{"id": 0, "start": 0, "end": 1, "text": "x" * (4 * 2**20 - 200)}]}
    big_beat = json.dumps({"v": 1, "op": "beat", "jobs": [[f"j{i}", 1] for i in range(200_000)], "free": 0})
    kinds = json.dumps({"v": 1, "state": "online", "slots": 8, "kinds": [f"k{i:07d}" for i in range(380_000)]})
    end = time.monotonic() + 20
    while time.monotonic() < end and len(held) < 8 and not stop.is_set():
        beat = {"v": 1, "op": "beat", "jobs": [list(h) for h in held], "free": 8 - len(held)}
        c.publish(up, json.dumps(beat), 1)
        time.sleep(0.5)
    counts["jobs_taken"] = len(held)
    for job_id, attempt in held:
        for index in range(16):
            msg = {"v": 1, "op": "chunk", "job_id": job_id, "attempt": attempt, "index": index, "data": chunk}
            c.publish(up, json.dumps(msg), 1)
            counts["chunks"] += 1
    for i in range(20):
        c.publish(up, big_beat, 1)
        c.publish(node, kinds, 1, retain=(i == 19))
        counts["big_beats"] += 1
    for i in range(20_000):
        c.publish(up, json.dumps({"v": 1, "op": "done", "job_id": f"forged{i}", "attempt": 1, "result": {}}), 1)
        counts["forged"] += 1
    while not stop.wait(1.0):  # keep its leases, as a node holding them would
        c.publish(up, json.dumps({"v": 1, "op": "beat", "jobs": [list(h) for h in held], "free": 0}), 1)
    c.loop_stop()
    c.disconnect()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="how long the attack runs")
    a = ap.parse_args()
    broker = harness.Broker(harness.shipped_broker_settings())
    harness.use_port(broker.port)
    media = Path(tempfile.mkdtemp(prefix="eqbench-attack-"))
    for i in range(12):
        shutil.copy(speech("jfk.flac"), media / f"talk-{i:02d}.flac")
    base = uid("atk")
    hub = Service(
        {"EDGE_QUEUE_WORKERS": "0", "EDGE_QUEUE_ACCESS__NODES": json.dumps(["good", "evil"]),
         "EDGE_QUEUE_KINDS__TRANSCRIBE__MAX_CONCURRENCY": "9",  # the two nodes' slots
         "EDGE_QUEUE_MEDIA_ROOTS": json.dumps([str(media)]), "EDGE_QUEUE_LOG_LEVEL": "INFO"},
        base=base,
    )  # fmt: skip
    good = Service(
        {"EDGE_QUEUE_NODES__NODE_ID": "good", "EDGE_QUEUE_WORKERS": "1",
         "EDGE_QUEUE_MEDIA_ROOTS": json.dumps([str(media)]), "EDGE_QUEUE_LOG_LEVEL": "INFO"},
        base=base, argv=[sys.executable, "-m", "edge_queue", "worker"],
    )  # fmt: skip
    stop = threading.Event()
    counts = {"chunks": 0, "big_beats": 0, "forged": 0}
    result: dict[str, Any] = {}
    try:
        hub.start()
        good.start(wait_online=False)
        watcher = Watcher(base)
        attacker = threading.Thread(target=evil_node, args=(base, stop, counts), daemon=True)
        attacker.start()
        time.sleep(2)
        pub = Publisher(base)
        for i in range(12):
            pub.submit({"input": str(media / f"talk-{i:02d}.flac")})
        t0 = time.monotonic()
        watcher.wait(lambda w: w.counts.get("succeeded", 0) >= 4, a.seconds)
        good_done = watcher.counts.get("succeeded", 0)
        result["honest_node_succeeded"] = good_done
        result["hub_peak_rss_mb"] = peak_rss_mb(hub.pid)
        result["store_mb"] = sum(p.stat().st_size for p in hub.data_dir.glob("edge-queue.db*")) / 2**20
        result["attack_seconds"] = time.monotonic() - t0
        stop.set()
        pub.close()
        watcher.close()
    finally:
        stop.set()
        good.stop()
        hub.stop()
        log = hub.tail(200_000)
        m = re.search(r"longest loop turn (\d+) ms", log)
        result["hub_longest_turn_ms"] = int(m.group(1)) if m else None
        result["hub_log_lines"] = log.count("\n")
        result["hub_warning_lines"] = log.count("WARNING")
        result["evil"] = counts
        hub.cleanup(clear=False)
        good.cleanup(clear=False)
        broker.stop()
        shutil.rmtree(media, ignore_errors=True)
    result["machine"] = provenance.machine()
    result["code"] = provenance.code_state()
    out = BENCH / "results" / f"node-attack-{datetime.now():%Y-%m-%d}.json"
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "code")}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
