"""The floor of P1: the same SQLite commits and MQTT publishes as edge-queue, no queue logic.

    python bench/ref/floor.py BASE N DB_PATH [full|normal]

Per job: INSERT queued (commit), UPDATE running (commit), UPDATE succeeded (commit), each
followed by a QoS 1 retained publish of a job-sized JSON on ``<BASE>/jobs/<id>``. WAL journal,
``synchronous`` FULL (or NORMAL). Prints ``{"t0": monotonic start}`` on stdout when it starts.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
import uuid

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion


def main() -> None:
    base, n, db_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    sync = sys.argv[4] if len(sys.argv) > 4 else "full"
    conn = sqlite3.connect(db_path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={sync.upper()}")
    conn.execute("CREATE TABLE jobs (job_id TEXT PRIMARY KEY, state TEXT, body TEXT, updated_at REAL)")
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="floor-" + uuid.uuid4().hex[:8], protocol=mqtt.MQTTv5)
    c.max_inflight_messages_set(1000)
    c.max_queued_messages_set(0)
    c.connect("127.0.0.1", int(os.environ.get("EQBENCH_PORT", "1883")))
    c.loop_start()
    time.sleep(0.3)
    print(json.dumps({"t0": time.monotonic()}), flush=True)
    last = None
    for i in range(n):
        jid = f"{i:016d}"
        job = {
            "v": 1,
            "job_id": jid,
            "seq": 1,
            "kind": "noop",
            "input": f"x{i}",
            "options": {},
            "batch_id": None,
            "priority": 0,
            "state": "queued",
            "stage": None,
            "progress": 0.0,
            "eta_s": None,
            "attempt": 0,
            "max_attempts": 3,
            "retry_at": None,
            "error": None,
            "result": None,
            "created_at": "2026-11-29T07:40:12.345Z",
            "started_at": None,
            "finished_at": None,
            "updated_at": "2026-11-29T07:40:12.345Z",
        }
        conn.execute("BEGIN")
        conn.execute("INSERT INTO jobs VALUES (?, ?, ?, ?)", (jid, "queued", json.dumps(job), time.time()))
        conn.execute("COMMIT")
        c.publish(f"{base}/jobs/{jid}", json.dumps(job), qos=1, retain=True)
        for state, attempt in (("running", 1), ("succeeded", 1)):
            job.update(state=state, attempt=attempt, seq=job["seq"] + 1)
            conn.execute("BEGIN")
            conn.execute(
                "UPDATE jobs SET state = ?, body = ?, updated_at = ? WHERE job_id = ?",
                (state, json.dumps(job), time.time(), jid),
            )
            conn.execute("COMMIT")
            last = c.publish(f"{base}/jobs/{jid}", json.dumps(job), qos=1, retain=True)
    if last is not None:
        last.wait_for_publish(60)
    c.loop_stop()
    c.disconnect()


if __name__ == "__main__":
    main()
