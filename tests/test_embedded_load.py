"""The embedded broker under load (docs/operations.md, "Load and back-pressure").

A real ``edge-queue up`` (service and embedded amqtt broker in one process) on a free port; one
client publishes QoS 1 submits as fast as it can; a second client, subscribed to ``<base>/#``,
counts every response, every event and every job's last retained state, and all of it is
compared with the job store, read with sqlite3. The burst of 50,000 is ``bench/embedded_burst.py``
(:func:`burst` is shared with it).
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from .conftest import Broker, ServiceProcess, Watcher, port_open, stop_client, wait_until
from .helpers.ports import free_port

#: Log lines at WARNING or above from the broker (amqtt's loggers, and edge-queue's own lines
#: about the broker), and traceback lines, that a burst on a healthy connection may cause.
BROKER_LINES_BOUND = 10
TERMINAL = {"succeeded", "failed", "cancelled"}


class Everything:
    """A subscriber of ``<base>/#`` (MQTT 3.1.1, QoS 1, clean session): how many times each
    transaction was answered and each event was sent, and each job's state of highest ``seq``."""

    def __init__(self, host: str, port: int, base: str) -> None:
        self.base = base
        self.answers: Counter[str] = Counter()
        self.events: Counter[int] = Counter()
        self.jobs: dict[str, tuple[int, str]] = {}
        self.last_at = 0.0
        self._lock = threading.Lock()
        ready = threading.Event()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="all-" + uuid.uuid4().hex[:8])
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *a: ready.set()
        self.client.on_connect = lambda c, *a: c.subscribe(f"{base}/#", 1)
        self.client.connect(host, port, keepalive=120)
        self.client.loop_start()
        assert ready.wait(10), f"could not subscribe to {base}/#"

    def _on_message(self, client: Any, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        topic = msg.topic[len(self.base) + 1 :]
        if not msg.payload or not (topic.startswith(("response/", "jobs/")) or topic == "events"):
            return
        body = json.loads(msg.payload)
        with self._lock:
            self.last_at = time.monotonic()
            if topic.startswith("response/"):
                self.answers[str(body.get("transaction"))] += 1
            elif topic == "events":
                if body.get("event_id") is not None:
                    self.events[body["event_id"]] += 1
            else:
                job_id = topic[len("jobs/") :]
                if body["seq"] >= self.jobs.get(job_id, (-1, ""))[0]:
                    self.jobs[job_id] = (body["seq"], body["state"])

    def snapshot(self) -> tuple[Counter[str], Counter[int], dict[str, str]]:
        with self._lock:
            return Counter(self.answers), Counter(self.events), {j: s for j, (_, s) in self.jobs.items()}

    def close(self) -> None:
        stop_client(self.client)


def submit_burst(host: str, port: int, base: str, n: int) -> None:
    """``n`` QoS 1 ``noop`` submits from one MQTT 3.1.1 client, as fast as it goes (fewer than
    20,000 unacknowledged: paho's message ids are 16-bit); returns once all are acknowledged."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="pub-" + uuid.uuid4().hex[:8])
    client.max_inflight_messages_set(0)
    client.max_queued_messages_set(0)
    client.connect(host, port, keepalive=120)
    client.loop_start()
    infos: list[mqtt.MQTTMessageInfo] = []
    try:
        for i in range(n):
            if len(infos) >= 20_000:
                infos[-20_000].wait_for_publish(120)
            body = {"kind": "noop", "idempotency_key": f"k{i}", "transaction": f"t{i}"}
            infos.append(client.publish(f"{base}/request/submit", json.dumps(body), qos=1))
        for info in infos[-20_000:]:
            info.wait_for_publish(120)
    finally:
        client.disconnect()
        client.loop_stop()


def store_view(db: Path) -> tuple[dict[str, str], set[int]]:
    """Each job's state, and the ids of the event log, read from the store with sqlite3."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        jobs = dict(conn.execute("SELECT job_id, state FROM jobs").fetchall())
        events = {row[0] for row in conn.execute("SELECT id FROM job_events")}
        return jobs, events
    finally:
        conn.close()


def broker_lines(log: str) -> list[str]:
    """The lines of a service log that the broker wrote at WARNING or above, and every
    traceback line (they start with ``  | ``, edge_queue.logfmt)."""
    pattern = re.compile(r"^(WARNING|ERROR|CRITICAL) (amqtt|transitions|websockets|edge_queue\.embedded_broker)")
    return [line for line in log.splitlines() if pattern.match(line) or line.startswith("  | ")]


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def burst(tmp: Path, n: int, timeout_s: float = 600) -> dict[str, Any]:
    """``edge-queue up`` with its embedded broker on a free port, ``n`` submits from one client,
    every message on ``<base>/#`` counted; stopped, then compared with its store. The figures
    (``lost_*``: in the store but never seen; ``duplicate_*``: seen more than once)."""
    svc = ServiceProcess(
        Broker("127.0.0.1", free_port(), "amqtt"),
        tmp,
        [tmp],
        {
            "EDGE_QUEUE_LOG_LEVEL": "INFO",
            "EDGE_QUEUE_BROKER__EMBEDDED": "true",
            "EDGE_QUEUE_MQTT__PROTOCOL": "3.1.1",
            "EDGE_QUEUE_HTTP__WEBSOCKET_PORT": str(free_port()),
        },
    )
    svc.command = "up"
    svc.start(wait_online=False)  # its broker comes up with it
    assert svc.proc is not None
    host, port = svc.broker.host, svc.broker.port
    seen: Everything | None = None
    try:
        wait_until(lambda: port_open(host, port) or svc.proc.poll() is not None, 30, "the embedded broker")
        online = Watcher(host, port, [f"{svc.base}/status"])
        try:
            wait_until(lambda: b"online" in online.on(f"{svc.base}/status"), 60, "the service to be online")
        finally:
            online.close()
        seen = Everything(host, port, svc.base)
        t0 = time.monotonic()
        submit_burst(host, port, svc.base, n)

        def settled() -> bool:
            assert seen is not None and svc.proc is not None
            answers, events, jobs = seen.snapshot()
            if svc.proc.poll() is not None:
                return True
            if len(answers) < n:
                return False
            stored, logged = store_view(svc.db)
            return (
                all(s in TERMINAL for s in stored.values())
                and logged <= set(events)
                and all(jobs.get(j) == s for j, s in stored.items())
            )

        try:
            wait_until(settled, timeout_s, f"{n} answers, events and final states", 0.5)
        except AssertionError:
            pass  # what is missing is counted below
        took = seen.last_at - t0
        assert svc.proc.poll() is None, svc.log()[-3000:]
        peak = peak_rss_mb(svc.proc.pid)
    finally:
        if seen is not None:
            seen.close()
        if svc.proc.poll() is None:
            svc.stop()
    answers, events, jobs = seen.snapshot()
    stored, logged = store_view(svc.db)
    log = svc.log()
    lines = broker_lines(log)
    return {
        "submits": n,
        "jobs_stored": len(stored),
        "jobs_not_final_in_store": sum(1 for s in stored.values() if s not in TERMINAL),
        "lost_answers": sum(1 for i in range(n) if not answers[f"t{i}"]),
        "duplicate_answers": sum(c - 1 for c in answers.values() if c > 1),
        "events_stored": len(logged),
        "lost_events": len(logged - set(events)),
        "duplicate_events": sum(c - 1 for c in events.values() if c > 1),
        "unknown_events": len(set(events) - logged),
        "final_states_missed": sum(1 for j, s in stored.items() if jobs.get(j) != s),
        "last_message_s": round(took, 1),
        "peak_rss_mib": round(peak),
        "log_lines": len(log.splitlines()),
        "broker_lines": len(lines),
        "broker_lines_sample": lines[:5],
        "puback_timeouts": log.count("Timeout waiting for PUBACK"),
        "late_pubacks": log.count("Received PUBACK for unknown pending message"),
    }


def assert_clean(figures: dict[str, Any]) -> None:
    """Nothing lost, nothing doubled (no connection broke: docs/topics.md promises each response
    once and each event once), every job final, and the broker quiet."""
    n = figures["submits"]
    assert figures["jobs_stored"] == n and figures["jobs_not_final_in_store"] == 0, figures
    for key in ("lost_answers", "duplicate_answers", "lost_events", "duplicate_events", "unknown_events"):
        assert figures[key] == 0, (key, figures)
    assert figures["final_states_missed"] == 0, figures
    assert figures["events_stored"] >= 2 * n, figures  # at least `new` and `end` per job
    assert figures["broker_lines"] <= BROKER_LINES_BOUND, figures


@pytest.mark.slow
def test_a_burst_of_10000_submits_through_the_embedded_broker_loses_nothing_and_logs_little(
    tmp_path: Path,
) -> None:
    figures = burst(tmp_path, 10_000)
    print("figures:", json.dumps(figures))
    assert_clean(figures)
