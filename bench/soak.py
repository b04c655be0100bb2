"""Soak: submit noop jobs with idempotency keys while the service is killed with SIGKILL at
random moments and restarted; then check that nothing acknowledged was lost or doubled.

Each service death costs the running jobs one attempt (PRODUCT 4.3); a job whose last
attempt (``max_attempts``, 3) is interrupted fails with ``worker_lost``, so a job that takes
the service down cannot loop forever. With kills milliseconds after restarts, a few jobs end
that way; they are terminal, as the checks require, and the summary counts them.

    .venv/bin/python bench/soak.py [--jobs 1000] [--kills 100] [--host 127.0.0.1 --port 1883]

Needs an MQTT broker (mosquitto) at --host/--port. Prints one summary line and writes it,
with the details, to bench/results/soak-<date>.json. Exit code 0 only when every check holds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

ROOT = Path(__file__).resolve().parent.parent


class Service:
    def __init__(self, data_dir: Path, base: str, host: str, port: int) -> None:
        self.env = {
            **os.environ,
            "EDGE_QUEUE_DATA_DIR": str(data_dir),
            "EDGE_QUEUE_MQTT__BASE_TOPIC": base,
            "EDGE_QUEUE_MQTT__CLIENT_ID": f"svc-{base}",
            "EDGE_QUEUE_MQTT__HOST": host,
            "EDGE_QUEUE_MQTT__PORT": str(port),
            "EDGE_QUEUE_LOG_LEVEL": "WARNING",
        }
        self.log = open(data_dir.parent / "service.log", "ab")  # noqa: SIM115 - kept for the run
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edge_queue", "serve"], env=self.env, stdout=subprocess.DEVNULL, stderr=self.log
        )

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


class Client:
    """Submits with an idempotency key and resends until answered, as our CLI does."""

    def __init__(self, host: str, port: int, base: str) -> None:
        self.base = base
        self.reply = f"{base}/reply/soak"
        self.answers: dict[str, dict] = {}
        self.cond = threading.Condition()
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="soak-" + uuid.uuid4().hex[:8])
        self.c.on_connect = lambda c, *a: c.subscribe(self.reply, 1)
        self.c.on_message = self._on_message
        self.c.connect(host, port)
        self.c.loop_start()

    def _on_message(self, client, userdata, msg) -> None:
        body = json.loads(msg.payload)
        with self.cond:
            self.answers.setdefault(body.get("transaction"), body)
            self.cond.notify_all()

    def submit(self, key: str, resend_s: float = 1.0) -> dict:
        body = json.dumps(
            {
                "kind": "noop",
                "options": {"sleep_s": 0.05},
                "idempotency_key": key,
                "transaction": key,
                "reply_to": self.reply,
            }
        )
        while True:
            self.c.publish(f"{self.base}/request/submit", body, qos=1)
            with self.cond:
                if self.cond.wait_for(lambda: key in self.answers, resend_s):
                    return self.answers[key]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=1883)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    rng = random.Random(seed)
    tmp = Path(tempfile.mkdtemp(prefix="edge-queue-soak-"))
    base = "soak" + uuid.uuid4().hex[:8]
    svc = Service(tmp / "data", base, args.host, args.port)
    svc.start()
    client = Client(args.host, args.port, base)
    acked: dict[str, str] = {}
    done = threading.Event()

    def submitter() -> None:
        for i in range(args.jobs):
            key = f"soak-{i}"
            resp = client.submit(key)
            assert resp["status"] == "ok", resp
            acked[key] = resp["data"]["jobs"][0]["job_id"]
        done.set()

    started = time.monotonic()
    thread = threading.Thread(target=submitter, daemon=True)
    thread.start()
    kills = 0
    # Spread the kills over the submissions: kill after a random number of new acks (0-2x
    # the even share) or a random pause, whichever comes first.
    share = max(1, args.jobs // max(args.kills, 1))
    while kills < args.kills:
        target = len(acked) + rng.randint(0, 2 * share)
        pause_end = time.monotonic() + rng.uniform(0.05, 3.0)
        while len(acked) < target and time.monotonic() < pause_end and not done.is_set():
            time.sleep(0.005)
        svc.kill()
        kills += 1
        svc.start()
    thread.join()
    # Let the last run finish everything, then stop it cleanly.
    db = tmp / "data" / "edge-queue.db"

    def unfinished() -> int:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as conn:
            return conn.execute(
                "SELECT count(*) FROM jobs WHERE state NOT IN ('succeeded','failed','cancelled')"
            ).fetchone()[0]

    deadline = time.monotonic() + 300
    while unfinished() and time.monotonic() < deadline:
        time.sleep(0.2)
    exit_code = svc.stop()
    elapsed = time.monotonic() - started
    with sqlite3.connect(db) as conn:
        jobs = dict(conn.execute("SELECT job_id, state FROM jobs").fetchall())
        outcomes = dict(
            conn.execute(
                "SELECT coalesce(json_extract(error, '$.code'), state), count(*) FROM jobs GROUP BY 1"
            ).fetchall()
        )
        keys = dict(conn.execute("SELECT key, job_ids FROM idempotency_keys").fetchall())
        successes = dict(
            conn.execute(
                "SELECT job_id, count(*) FROM job_events WHERE to_state = 'succeeded' GROUP BY job_id"
            ).fetchall()
        )
        attempts = conn.execute("SELECT max(attempt), sum(attempt > 1) FROM jobs").fetchone()
        integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
    lost = [k for k, j in acked.items() if j not in jobs]
    key_mismatch = [k for k, j in acked.items() if json.loads(keys.get(k, "[]")) != [j]]
    not_terminal = [j for j in acked.values() if jobs.get(j) not in ("succeeded", "failed", "cancelled")]
    double = [j for j, n in successes.items() if n > 1]
    checks = {
        "every acknowledged job exists": not lost,
        "one job per idempotency key": not key_mismatch and len(jobs) == len(acked) == args.jobs,
        "every job terminal": not not_terminal,
        "no job succeeded twice": not double,
        "database integrity ok": integrity == "ok",
        "clean stop exit 0": exit_code == 0,
    }
    ok = all(checks.values())
    summary = (
        f"soak: {len(acked)} acknowledged, {len(jobs)} jobs stored, {len(not_terminal)} not terminal, "
        f"outcomes {outcomes}, {len(lost)} lost, "
        f"{len(key_mismatch)} key mismatches, {len(double)} succeeded twice, {kills} kill -9 cycles, "
        f"{attempts[1] or 0} jobs needed >1 attempt (max {attempts[0]}), integrity {integrity}, "
        f"{elapsed:.0f} s, seed {seed}: {'PASS' if ok else 'FAIL'}"
    )
    print(summary)
    out = ROOT / "bench" / "results" / f"soak-{datetime.now(UTC):%Y-%m-%d}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "summary": summary,
                "checks": checks,
                "outcomes": outcomes,
                "jobs": args.jobs,
                "kills": kills,
                "seed": seed,
                "elapsed_s": round(elapsed, 1),
            },
            indent=2,
        )
        + "\n"
    )
    client.c.loop_stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
