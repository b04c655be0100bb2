"""What parked MQTT sessions make the shipped mosquitto hold (docs/operations.md, "What one
user can make the broker hold"), with one command:

    .venv/bin/python bench/parked_sessions.py              # 50,000 stored jobs, 100 sessions
    .venv/bin/python bench/parked_sessions.py --jobs 5000 --sessions 20   # a quick look

A private mosquitto with the delivery settings of broker/mosquitto.conf and persistence in a
folder of its own holds the retained states of ``--jobs`` stored jobs on ``<base>/jobs/<id>``
(each a 700-byte job object, as edge-queue publishes them). Then ``--sessions`` clients of one
user each connect with a persistent session (MQTT 3.1.1, clean session off, client ids of
their choosing, as every listener of broker/mosquitto.conf allows), subscribe to
``<base>/jobs/+`` at QoS 1 and go away without reading, as a hostile or a forgetful client does.
Figures: mosquitto's resident memory before and after, and its persistence file once saved. Two cases, in the same run:

- ``no expiry``: every finished job's retained state stays on the broker (``mqtt.finished_expiry_s
  = 0``, and edge-queue before it);
- ``finished_expiry_s``: the default: the broker forgets a finished job's state a day after it
  ended, so only the last day's (``--last-day``, 500 by default) and the unfinished ones are
  sent to a new subscriber.

Writes bench/results/parked-sessions-<YYYY-MM-DD>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import socket
import struct
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import psutil
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import BENCH, HOST, Broker, shipped_broker_settings  # noqa: E402

BASE = "eqbench"
#: the size of a finished transcription's job object on <base>/jobs/<id> (bytes)
STATE_BYTES = 700


def _utf8(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("!H", len(raw)) + raw


def _packet(kind: int, body: bytes) -> bytes:
    out, n = bytearray([kind]), len(body)
    while True:
        n, digit = n // 128, n % 128
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out) + body


def park(port: int, client_id: str, topic: str) -> None:
    """Connect with a persistent session, subscribe to ``topic`` at QoS 1, and go away without
    reading a single message (raw MQTT 3.1.1 packets: no client library acknowledges anything)."""
    with socket.create_connection((HOST, port), 5) as s:
        s.sendall(_packet(0x10, _utf8("MQTT") + bytes([4, 0x00]) + struct.pack("!H", 60) + _utf8(client_id)))
        if s.recv(4)[:2] != b"\x20\x02":
            raise RuntimeError("no CONNACK")
        s.sendall(_packet(0x82, struct.pack("!H", 1) + _utf8(topic) + bytes([1])))
        time.sleep(0.05)  # the SUBACK and the first retained states are on their way; never read


def fill(port: int, jobs: int, last_day: int, expiry: bool) -> None:
    """``jobs`` retained job states; with ``expiry``, all but ``last_day`` of them expire at once
    (they ended more than ``mqtt.finished_expiry_s`` ago)."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="bench-fill", protocol=mqtt.MQTTv5)
    client.connect(HOST, port)
    client.loop_start()
    payload = json.dumps({"job_id": "x", "state": "succeeded", "result": {"text": "w" * STATE_BYTES}})[:STATE_BYTES]
    old = Properties(PacketTypes.PUBLISH)
    old.MessageExpiryInterval = 1
    infos = []
    for i in range(jobs):
        props = old if expiry and i >= last_day else None
        infos.append(client.publish(f"{BASE}/jobs/{i:016d}", payload, qos=1, retain=True, properties=props))
        if len(infos) >= 1000:
            for info in infos:
                info.wait_for_publish(30)
            infos.clear()
    for info in infos:
        info.wait_for_publish(30)
    client.disconnect()
    client.loop_stop()
    time.sleep(2.0)  # the expiring ones are past their interval


def settled_rss_mb(pid: int) -> float:
    """mosquitto's resident memory once it stopped changing for a second (MiB)."""
    proc, last = psutil.Process(pid), -1.0
    for _ in range(60):
        rss = proc.memory_info().rss / 2**20
        if abs(rss - last) < 0.05:
            return rss
        last = rss
        time.sleep(1.0)
    return last


def one_case(jobs: int, sessions: int, last_day: int, expiry: bool) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="eqparked-"))
    # (the later "persistence true" overrides the harness's "persistence false")
    # (as root, mosquitto would drop to the user "mosquitto", who cannot write the folder)
    user = pwd.getpwuid(os.geteuid()).pw_name
    broker = Broker(shipped_broker_settings() + f"user {user}\npersistence true\npersistence_location {folder}/\n")
    try:
        fill(broker.port, jobs, last_day, expiry)
        before = settled_rss_mb(broker.proc.pid)
        t0 = time.monotonic()
        for i in range(sessions):
            park(broker.port, f"parked-{i}", f"{BASE}/jobs/+")
        after = settled_rss_mb(broker.proc.pid)
        took = time.monotonic() - t0
        broker.proc.terminate()  # mosquitto saves its persistence file as it stops
        broker.proc.wait(60)
        db = folder / "mosquitto.db"
        return {
            "case": "finished_expiry_s" if expiry else "no expiry",
            "retained states sent to each new subscriber": last_day if expiry else jobs,
            "broker RSS before (MiB)": round(before, 1),
            "broker RSS after (MiB)": round(after, 1),
            "growth per parked session (MiB)": round((after - before) / sessions, 3),
            "persistence file (MB)": round(db.stat().st_size / 1e6, 1) if db.exists() else None,
            "parking took (s)": round(took, 1),
        }
    finally:
        broker.stop()
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=50_000, help="stored jobs (retained states)")
    parser.add_argument("--sessions", type=int, default=100, help="parked sessions of one user")
    parser.add_argument("--last-day", type=int, default=500, help="jobs that ended within the last day")
    args = parser.parse_args()
    rows = [one_case(args.jobs, args.sessions, args.last_day, expiry) for expiry in (False, True)]
    out = BENCH / "results" / f"parked-sessions-{date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"jobs": args.jobs, "sessions": args.sessions, "rows": rows}, indent=2) + "\n")
    for row in rows:
        print(" | ".join(f"{k}: {v}" for k, v in row.items()))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
