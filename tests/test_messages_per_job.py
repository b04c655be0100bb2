"""What one job costs the service in MQTT messages and in objects its loop builds, in steady
state (docs/topics.md, "Messages per job"): a guard, so that a change that adds work per job
fails here.

A real service runs in the test's own thread against a private mosquitto (MQTT 5); a client
submits `noop` jobs and waits for each job's retained final state. What the service hands to
the broker is counted where it leaves (``FastClient.publish_qos1`` and paho's ``publish``,
wrapped), by topic kind; the paho ``Properties`` and ``ReasonCode`` objects made are counted by
wrapping their constructors. The 20 ms coalescing of non-final retained states is wall-clock
(its own test is in tests/test_e2e.py): here it is set long, so that the counts do
not depend on the machine's speed."""

from __future__ import annotations

import json
import math
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from .conftest import Watcher, stop_client, wait_until
from .helpers.brokers import PrivateMosquitto

#: jobs measured in each mode, after the warm-up
JOBS = 60
#: inputs of one batch submit
BATCH = 20
#: seconds between two tries on a topic nobody reads (docs/topics.md, "Messages per job")
TRY_S = 1.0


def kind_of(base: str, topic: str) -> str:
    """``events``, ``jobs``, ``response/submit``, ``ha/finished``, ... : the topic without the
    base and without its ids."""
    rest = topic[len(base) + 1 :] if topic.startswith(base + "/") else topic
    for prefix in ("jobs/", "batches/"):
        if rest.startswith(prefix):
            return prefix[:-1]
    return rest


class Counted:
    """What the service publishes, by topic kind, and the paho objects it makes: on the
    service's thread (this one), not while :meth:`aside` (the test's own clients)."""

    def __init__(self, base: str, monkeypatch: pytest.MonkeyPatch) -> None:
        from edge_queue.mqtt.paho_client import FastClient

        self.base = base
        self.published: Counter[str] = Counter()
        self.objects: Counter[str] = Counter()
        self.thread, self.away = threading.get_ident(), False
        fast_publish, paho_publish = FastClient.publish_qos1, mqtt.Client.publish
        props_init, reason_init = Properties.__init__, ReasonCode.__init__

        def publish_qos1(client: Any, topic: str, *args: Any) -> int:
            self.published[kind_of(base, topic)] += 1
            return fast_publish(client, topic, *args)

        def publish(client: Any, topic: str, *args: Any, **kwargs: Any) -> Any:
            self.published[kind_of(base, topic)] += 1
            return paho_publish(client, topic, *args, **kwargs)

        def properties(obj: Any, *args: Any, **kwargs: Any) -> None:
            if self.counting():
                self.objects["Properties"] += 1
            props_init(obj, *args, **kwargs)

        def reason_code(obj: Any, *args: Any, **kwargs: Any) -> None:
            if self.counting():
                self.objects["ReasonCode"] += 1
            reason_init(obj, *args, **kwargs)

        monkeypatch.setattr(FastClient, "publish_qos1", publish_qos1)
        monkeypatch.setattr(FastClient, "publish", publish)
        monkeypatch.setattr(Properties, "__init__", properties)
        monkeypatch.setattr(ReasonCode, "__init__", reason_code)

    def counting(self) -> bool:
        return threading.get_ident() == self.thread and not self.away

    @contextmanager
    def aside(self) -> Iterator[None]:
        """What the test's own clients do inside is not counted."""
        self.away = True
        try:
            yield
        finally:
            self.away = False

    def reset(self) -> None:
        self.published.clear()
        self.objects.clear()


class Client:
    """A requester: submits on ``<base>/request/submit`` and follows ``<base>/jobs/+``."""

    def __init__(self, host: str, port: int, base: str, counted: Counted) -> None:
        self.base, self.counted = base, counted
        self.final: set[str] = set()
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id="req-" + uuid.uuid4().hex[:8], protocol=mqtt.MQTTv5
        )
        self.client.on_message = self._on_message
        self.client.connect(host, port)
        self.client.loop_start()
        self.client.subscribe(f"{base}/jobs/+", 1)

    def _on_message(self, client: Any, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        if msg.payload and json.loads(msg.payload)["state"] == "succeeded":
            self.final.add(msg.topic.rsplit("/", 1)[1])

    def submit(self, body: dict[str, Any]) -> None:
        with self.counted.aside():
            self.client.publish(f"{self.base}/request/submit", json.dumps(body), qos=1)

    def close(self) -> None:
        stop_client(self.client)


@pytest.fixture
def service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from edge_queue.config.settings import Settings
    from edge_queue.publish import publisher
    from edge_queue.service import Service

    monkeypatch.setattr(publisher, "COALESCE_S", 3600.0)  # see the module's docstring
    broker = PrivateMosquitto(tmp_path / "mosquitto")
    media = tmp_path / "media"
    media.mkdir()
    for i in range(BATCH):
        (media / f"in{i}.wav").write_bytes(b"RIFF")
    base = "eqm" + uuid.uuid4().hex[:8]
    settings = Settings(
        data_dir=tmp_path / "data",
        media_roots=[media],
        workers=2,
        mqtt={"host": broker.host, "port": broker.port, "base_topic": base},
    )
    svc = Service(settings)
    svc.boot()
    svc.test_broker, svc.test_media = broker, media
    try:
        yield svc
    finally:
        try:
            svc.stop_now = True
            svc.shutdown()
        finally:
            broker.stop()


def run_until(svc: Any, done: Callable[[], bool], timeout: float, what: str) -> None:
    """The service's loop, in this thread, until ``done()``."""
    wait_until(lambda: svc.step(max_wait_s=0.02) or done(), timeout, what, interval=0)


def settled(svc: Any) -> bool:
    """Connected, every message of ours acknowledged, nothing to take, no republish."""
    b = svc.bridge
    return bool(b.connected and not b.inbox and not b.backlog and not b.unacked and not svc.republisher.active)


def settle(svc: Any) -> None:
    run_until(svc, lambda: settled(svc), 30, "the service to settle")
    # a few more turns: the acknowledgements just read are acted upon
    for _ in range(5):
        svc.step(max_wait_s=0.02)


def one_per_request(svc: Any, client: Client, n: int) -> None:
    """``n`` jobs, one request each, one after the other (each job has ended, as its retained
    state says, before the next is submitted)."""
    for _ in range(n):
        want = len(client.final) + 1
        client.submit({"kind": "noop"})
        run_until(svc, lambda want=want: len(client.final) >= want, 30, "the job's retained final state")
    settle(svc)


def batches(svc: Any, client: Client, n: int) -> None:
    """``n`` jobs in submits of :data:`BATCH` inputs, one batch after the other."""
    inputs = [str(p) for p in sorted(svc.test_media.iterdir())]
    for _ in range(n // BATCH):
        want = len(client.final) + BATCH
        client.submit({"kind": "noop", "inputs": inputs})
        run_until(svc, lambda want=want: len(client.final) >= want, 60, "the batch's jobs' final states")
    settle(svc)


def probes(elapsed_s: float) -> int:
    """Messages on a topic nobody reads that the contract allows in ``elapsed_s``: one try every
    :data:`TRY_S` (docs/topics.md, "Messages per job")."""
    return math.ceil(elapsed_s / TRY_S) + 1


@pytest.mark.parametrize("mode", ["one_per_request", "batches"])
def test_messages_and_objects_per_job_in_steady_state(service: Any, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    svc, base = service, service.topics.base
    broker = svc.test_broker
    run = one_per_request if mode == "one_per_request" else batches
    counted = Counted(base, monkeypatch)
    client = Client(broker.host, broker.port, base, counted)
    try:
        settle(svc)
        # Given a service that has run jobs already (steady state), with a requester that
        # follows the job topics and nobody on <base>/events or <base>/ha/finished
        run(svc, client, BATCH)
        counted.reset()
        started = time.monotonic()
        # When N more jobs run
        run(svc, client, JOBS)
        elapsed = time.monotonic() - started
        got = dict(counted.published)
        requests = JOBS if mode == "one_per_request" else JOBS // BATCH
        # Then each job costs what docs/topics.md, "Messages per job", says:
        # its final retained state, once (queued and running coalesced away)
        assert got.pop("jobs") == JOBS, counted.published
        # one response per submit request, and one retained ha/submit per turn that answered
        # one (here one request at a time: one per request)
        assert got.pop("response/submit") == requests, counted.published
        assert got.pop("ha/submit") == requests, counted.published
        # ha/last at most once per loop turn in which jobs ended: once per job one after the other
        ha_last = got.pop("ha/last")
        if mode == "one_per_request":
            assert ha_last == JOBS, counted.published
        else:
            assert 0 < ha_last <= JOBS, counted.published
        # no message nobody reads: events and ha/finished only as the tries of their way back
        assert got.pop("events", 0) <= probes(elapsed), (counted.published, elapsed)
        assert got.pop("ha/finished", 0) <= probes(elapsed), (counted.published, elapsed)
        # and the summaries throttled in time, not per job
        assert got.pop("queue", 0) <= elapsed / 1.0 + 1, (counted.published, elapsed)
        # (each batch at most once per 0.5 s, and its last state)
        assert got.pop("batches", 0) <= requests * (elapsed / 0.5 + 2) * (mode == "batches"), counted.published
        assert got == {}, f"a message per job that docs/topics.md does not list: {got}"
        # And the loop builds no paho Properties nor ReasonCode for them (shared, read-only ones:
        # the finished state's Message Expiry, the PUBACKs' reason codes)
        assert counted.objects == {}, counted.objects
    finally:
        client.close()


def test_a_turn_of_submits_sends_one_ha_submit_the_turns_last(service: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    svc, base = service, service.topics.base
    broker = svc.test_broker
    counted = Counted(base, monkeypatch)
    client = Client(broker.host, broker.port, base, counted)
    try:
        settle(svc)
        # Given five submits on the shared request topic, all arrived
        for i in range(5):
            client.submit({"kind": "noop", "input": f"burst{i}"})
        inbox = svc.bridge.inbox.items
        wait_until(lambda: svc.bridge.pump(time.monotonic()) or len(inbox) >= 5, 10, "the requests", interval=0)
        counted.reset()
        # When one loop turn takes them
        svc.step(max_wait_s=0)
        assert not inbox
        # Then each has its response, and <base>/ha/submit is sent once: the turn's last
        assert counted.published["response/submit"] == 5, counted.published
        assert counted.published["ha/submit"] == 1, counted.published
        settle(svc)
        with Watcher(broker.host, broker.port, [f"{base}/ha/submit"], mqtt.MQTTv5) as w:
            last = w.wait_json(f"{base}/ha/submit", lambda m: True, 10)
        assert last["input"] == "burst4" and last["summary"].startswith("queued "), last
        assert json.loads(svc.job_store().meta_text("ha_submit") or "null") == last  # for the next start
    finally:
        client.close()


def unheard(svc: Any, client: Any, counted: Any, jobs: int) -> None:
    """``jobs`` jobs, one request each, with nobody subscribed (the broker answers "no matching
    subscribers" and the topics go unheard), then ``jobs`` more counted afresh."""
    settle(svc)
    one_per_request(svc, client, jobs)
    counted.reset()
    one_per_request(svc, client, jobs)


def test_a_subscriber_that_comes_later_gets_every_topic_again(service: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    svc, base = service, service.topics.base
    broker = svc.test_broker
    counted = Counted(base, monkeypatch)
    client = Client(broker.host, broker.port, base, counted)
    try:
        # Given a service that stopped sending <base>/events and <base>/ha/finished: nobody read them
        unheard(svc, client, counted, 5)
        assert counted.published["events"] < 15 and counted.published["ha/finished"] < 5, counted.published
        # When a subscriber comes for both, and the way back's try has had its time
        with Watcher(broker.host, broker.port, [f"{base}/events", f"{base}/ha/finished"], mqtt.MQTTv5) as w:
            until = time.monotonic() + TRY_S
            while time.monotonic() < until:
                one_per_request(svc, client, 1)
            one_per_request(svc, client, 1)
            counted.reset()
            seen = len(w.messages)
            # Then every job's events (new, running, end) and its ha/finished reach it again
            one_per_request(svc, client, 10)
            assert counted.published["events"] == 30, counted.published
            assert counted.published["ha/finished"] == 10, counted.published
            run_until(svc, lambda: len(w.messages) >= seen + 40, 10, "the watcher to get them")
    finally:
        client.close()


def test_a_request_other_than_submit_brings_events_back_at_once(service: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    svc, base = service, service.topics.base
    broker = svc.test_broker
    counted = Counted(base, monkeypatch)
    client = Client(broker.host, broker.port, base, counted)
    svc.publisher.events_heard.retry_s = 3600.0  # no try in this test: only the request brings them back
    try:
        # Given a service that stopped sending <base>/events: nobody read them
        unheard(svc, client, counted, 3)
        assert counted.published["events"] == 0, counted.published
        # When a client subscribes to them and then asks something (the queue page asks list)
        with Watcher(broker.host, broker.port, [f"{base}/events"], mqtt.MQTTv5) as w:
            with counted.aside():
                client.client.publish(f"{base}/request/list", "{}", qos=1)
            run_until(svc, lambda: svc.dispatcher.requests_seen >= 7, 10, "the list request")
            counted.reset()
            # Then the events of the next jobs reach it, every one
            one_per_request(svc, client, 3)
            assert counted.published["events"] == 9, counted.published
            run_until(svc, lambda: len(w.json_on(f"{base}/events")) >= 9, 10, "the watcher to get them")
    finally:
        client.close()
