"""Hypothesis-generated payloads to every request topic of a running service (docs/topics.md, "Order of checks"):
it never dies, every request gets exactly one response, and the database stays intact."""

from __future__ import annotations

import json
import sqlite3
import uuid
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from paho.mqtt.enums import CallbackAPIVersion

from edge_queue.mqtt.topics import COMMANDS

from .conftest import wait_until

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=50),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=20,
)
FIELDS = [
    "kind",
    "input",
    "inputs",
    "options",
    "priority",
    "idempotency_key",
    "max_attempts",
    "timeout_s",
    "run_at",
    "job_id",
    "batch_id",
    "all",
    "state",
    "limit",
    "before",
    "older_than_s",
    "states",
]
request_objects = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6)
deep = st.integers(1, 3000).map(lambda n: "[" * n + "]" * n)
payloads = st.one_of(
    request_objects.map(lambda d: json.dumps(d).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=300),
    st.text(max_size=300).map(str.encode),
    deep.map(str.encode),
    st.integers(200_000, 400_000).map(lambda n: b'{"input": "' + b"a" * n + b'"}'),
    st.just(b""),
)
commands = st.one_of(st.sampled_from(COMMANDS), st.sampled_from(["", "x", "submit/extra", "ü", "get/"]))


@pytest.mark.slow
def test_fuzzed_requests_get_exactly_one_response(broker, service_factory, speech: Path) -> None:
    svc = service_factory(broker, [speech]).start()
    # (a command with a second level, "submit/extra", is the request of broker user "extra":
    # its response goes to <base>/reply/extra/response/submit; docs/topics.md)
    watcher = svc.watcher("response/#", "reply/+/response/#")
    pub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="fuzz-" + uuid.uuid4().hex[:8])
    pub.connect(broker.host, broker.port)
    pub.loop_start()
    sent = [0]

    def is_response(topic: str) -> bool:
        rest = topic.removeprefix(f"{svc.base}/")
        return rest.startswith("response/") or (rest.startswith("reply/") and "/response/" in rest)

    def responses() -> int:
        return sum(1 for t, *_ in watcher.messages if is_response(t))

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(command=commands, payload=payloads)
    def one_request(command: str, payload: bytes) -> None:
        pub.publish(f"{svc.base}/request/{command}", payload, qos=1).wait_for_publish(10)
        sent[0] += 1
        wait_until(lambda: responses() >= sent[0], 20, f"a response to {command!r}")
        assert svc.proc.poll() is None, svc.log()

    try:
        one_request()
        # exactly one each: a final request's response arrives after every earlier one, and
        # nothing beyond it
        pub.publish(f"{svc.base}/request/list", b'{"transaction": "last"}', qos=1).wait_for_publish(10)
        watcher.wait_json(f"{svc.base}/response/list", lambda m: m.get("transaction") == "last")
        assert responses() == sent[0] + 1
        for topic, raw, retain, _ in watcher.messages:
            if not is_response(topic):
                continue  # only the responses are checked here
            try:
                body = json.loads(raw)
            except ValueError:
                raise AssertionError(f"not JSON on {topic}: {raw[:200]!r}") from None
            assert body["v"] == 1 and body["status"] in ("ok", "error") and not retain
            if body["status"] == "error":
                assert body["error"]["code"] and body["error"]["message"]
    finally:
        pub.disconnect()
        pub.loop_stop()
    assert svc.proc.poll() is None
    with sqlite3.connect(f"file:{svc.db}?mode=ro", uri=True) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
