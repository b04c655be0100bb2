"""A request delivered twice takes effect once (docs/topics.md, "Requests delivered twice").

Between the service and a private mosquitto sits a TCP proxy that, when armed, drops the
service's next PUBACK and cuts the connection, as a flaky Wi-Fi link or a NAT timeout would.
mosquitto then delivers the request again, with the DUP flag, when the service reconnects.
Requests carry no idempotency key, as `mosquitto_pub` and Home Assistant send them.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import publish, wait_until
from .helpers.brokers import PrivateMosquitto
from .helpers.ports import free_port

PUBACK = 0x40


class AckDroppingProxy:
    """Forwards TCP between clients and ``upstream``; :meth:`arm` makes it drop the next PUBACK
    a client sends and close that connection (the broker never learns the request was taken)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.server = socket.create_server(("127.0.0.1", self.port))
        self.armed = threading.Event()
        self.armed_back = threading.Event()  # drop the broker's next PUBACK instead
        self.dropped = 0
        self.connections = 0
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self) -> None:
        self.armed.set()

    def arm_back(self) -> None:
        self.armed_back.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:  # the broker is down (restarting): as if it refused the client
                client.close()
                continue
            self.connections += 1
            self._open += [client, upstream]
            threading.Thread(target=self._to_broker, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._to_client, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.close()
            except OSError:
                pass

    def _to_broker(self, src: socket.socket, dst: socket.socket) -> None:
        """Client -> broker, packet by packet, so that one PUBACK can be dropped."""
        self._forward(src, dst, self.armed)

    def _to_client(self, src: socket.socket, dst: socket.socket) -> None:
        """Broker -> client, the same way (:attr:`armed_back`)."""
        self._forward(src, dst, self.armed_back)

    def _forward(self, src: socket.socket, dst: socket.socket, armed: threading.Event) -> None:
        buf = b""
        try:
            while data := src.recv(65536):
                buf += data
                out = b""
                while (packet := _next_packet(buf)) is not None:
                    buf = buf[len(packet) :]
                    if packet[0] & 0xF0 == PUBACK and armed.is_set():
                        armed.clear()
                        self.dropped += 1
                        dst.sendall(out)
                        raise ConnectionAbortedError("PUBACK dropped")
                    out += packet
                if out:
                    dst.sendall(out)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass

    def cut(self) -> None:
        """Close every connection it forwards, as a lost link would; new ones are accepted."""
        for s in self._open:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass
        self._open.clear()

    def close(self) -> None:
        self.server.close()
        for s in self._open:
            try:
                s.close()
            except OSError:
                pass


def _next_packet(buf: bytes) -> bytes | None:
    """The first whole MQTT packet of ``buf``, or None when it is not all there yet."""
    if len(buf) < 2:
        return None
    length, mult, i = 0, 1, 1
    while True:
        if i >= len(buf):
            return None
        byte = buf[i]
        length += (byte & 0x7F) * mult
        mult *= 128
        i += 1
        if not byte & 0x80:
            break
    return buf[: i + length] if len(buf) >= i + length else None


@pytest.fixture
def flaky(tmp_path: Path, service_factory: Callable[..., Any]) -> Iterator[tuple[Any, AckDroppingProxy]]:
    """A service that reaches a private mosquitto through an :class:`AckDroppingProxy`."""
    broker = PrivateMosquitto(tmp_path / "broker")
    proxy = AckDroppingProxy(broker.port)
    svc = service_factory(broker, [tmp_path])
    svc.env["EDGE_QUEUE_MQTT__PORT"] = str(proxy.port)
    try:
        svc.start()
        yield svc, proxy
        assert svc.stop() == 0
    finally:
        proxy.close()
        broker.stop()


def _after_a_lost_ack(svc: Any, proxy: AckDroppingProxy, command: str, body: dict[str, Any]) -> None:
    """Publish ``body`` (no idempotency key) while the proxy drops the service's PUBACK, and
    wait until the service has reconnected and the broker has delivered the request again."""
    before = svc.log().count("connected to")
    proxy.arm()
    publish(svc.broker, f"{svc.base}/request/{command}", json.dumps(body))
    wait_until(lambda: proxy.dropped >= 1, 30, "the PUBACK to be dropped")
    wait_until(lambda: svc.log().count("connected to") > before, 30, "the service to reconnect")


def _responses(watcher: Any, svc: Any, command: str, transaction: str) -> list[dict[str, Any]]:
    return [r for r in watcher.json_on(f"{svc.base}/response/{command}") if r.get("transaction") == transaction]


def _settled(svc: Any, watcher: Any) -> None:
    """A later request answered: whatever the redelivery did is done."""
    marker = watcher.json_on(f"{svc.base}/response/get")
    publish(svc.broker, f"{svc.base}/request/get", json.dumps({"job_id": "nosuchjob0000000", "transaction": "m"}))
    wait_until(lambda: len(watcher.json_on(f"{svc.base}/response/get")) > len(marker), 30, "the marker's answer")


@pytest.mark.parametrize("shape", ["single", "batch"])
def test_a_submit_delivered_again_makes_its_jobs_once(flaky, shape: str) -> None:
    svc, proxy = flaky
    watcher = svc.watcher("response/#", "jobs/+")
    # Given a submit without an idempotency key whose PUBACK is lost (the job ran already)
    body: dict[str, Any] = {"kind": "noop", "transaction": "t1"}
    body.update({"input": "one"} if shape == "single" else {"inputs": ["a", "b", "c"]})
    _after_a_lost_ack(svc, proxy, "submit", body)
    _settled(svc, watcher)
    # Then the broker's second delivery made no second job: every response names the same jobs
    answers = _responses(watcher, svc, "submit", "t1")
    assert answers and all(a["status"] == "ok" for a in answers), answers
    assert len({json.dumps(a["data"], sort_keys=True) for a in answers}) == 1, answers
    created = {t for t, p, *_ in watcher.messages if t.startswith(f"{svc.base}/jobs/") and p}
    assert len(created) == (1 if shape == "single" else 3), created
    assert "delivered again after a lost acknowledgement" in svc.log()


def test_a_retry_delivered_again_runs_the_job_once_more_only(flaky) -> None:
    svc, proxy = flaky
    watcher = svc.watcher("response/#", "jobs/+", "events")
    # Given a failed job
    resp = svc.request("submit", {"kind": "test_fail", "options": {"code": "unsupported_media"}}, watcher)
    job_id = resp["data"]["jobs"][0]["job_id"]
    watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] == "failed")
    # When a retry of it is delivered twice
    _after_a_lost_ack(svc, proxy, "retry", {"job_id": job_id, "transaction": "r1"})
    _settled(svc, watcher)
    wait_until(lambda: watcher.job_events(svc.base, job_id)[-1]["state"] == "failed", 30, "the retried run to end")
    # Then the job ran once more, not twice
    runs = [e for e in watcher.job_events(svc.base, job_id) if e["state"] == "running"]
    assert len(runs) == 2, runs
    assert all(a["status"] == "ok" for a in _responses(watcher, svc, "retry", "r1"))


@pytest.mark.slow
@pytest.mark.parametrize("command", ["cancel", "pause", "resume", "purge"])
def test_other_requests_delivered_again_are_answered_with_their_first_response(flaky, command: str) -> None:
    svc, proxy = flaky
    watcher = svc.watcher("response/#", "jobs/+")
    body: dict[str, Any] = {"transaction": "c1"}
    if command == "cancel":
        resp = svc.request("submit", {"kind": "test_hang"}, watcher)
        body["job_id"] = resp["data"]["jobs"][0]["job_id"]
        watcher.wait_json(f"{svc.base}/jobs/{body['job_id']}", lambda m: m["state"] == "running")
    if command == "purge":
        resp = svc.request("submit", {"kind": "noop"}, watcher)
        watcher.wait_json(f"{svc.base}/jobs/{resp['data']['jobs'][0]['job_id']}", lambda m: m["state"] == "succeeded")
        body["older_than_s"] = 0
    # When the request is delivered twice
    _after_a_lost_ack(svc, proxy, command, body)
    _settled(svc, watcher)
    # Then every answer is the first one (a second cancel would say the job already ended)
    answers = _responses(watcher, svc, command, "c1")
    assert answers and all(a == answers[0] for a in answers), answers
    assert answers[0]["status"] == "ok", answers


def test_records_of_an_ended_session_cannot_answer_new_requests(tmp_path: Path, service_factory) -> None:
    # Given a service that executed a submit, recorded for redelivery, on a broker without
    # persistence
    import sqlite3

    broker = PrivateMosquitto(tmp_path / "broker")
    broker.conf.write_text(broker.conf.read_text().replace("persistence true", "persistence false"))
    broker.stop()
    broker.start()
    svc = service_factory(broker, [tmp_path])
    try:
        svc.start()
        watcher = svc.watcher("response/#")
        assert svc.request("submit", {"kind": "noop", "input": "same"}, watcher)["status"] == "ok"

        def records() -> int:
            with sqlite3.connect(svc.db) as conn:
                return int(conn.execute("SELECT count(*) FROM delivered_requests").fetchone()[0])

        assert records() == 1
        # When the broker restarts and loses the service's session (its packet ids start at 1
        # again, so a new request may carry the id of a recorded one)
        before = svc.log().count("connected to")
        broker.stop()
        broker.start()
        wait_until(lambda: svc.log().count("connected to") > before, 30, "the reconnect")
        # Then the records of the old session are gone: no new request can be answered with one
        wait_until(lambda: records() == 0, 10, "the records of the ended session to be dropped")
        assert "session present: False" in svc.log().splitlines()[-1] or "session present: False" in svc.log()
        watcher.close()
        assert svc.stop() == 0
    finally:
        broker.stop()


def test_publishes_cut_off_by_a_lost_connection_are_sent_again(flaky) -> None:
    """The service's QoS 1 publishes that the broker had not acknowledged when the connection
    broke are sent again after the reconnect (MQTT 5.0 section 4.4), so a subscriber misses
    no event (docs/topics.md, "<base>/events": every transition of every job)."""
    svc, proxy = flaky
    watcher = svc.watcher("events", "response/#")
    # Given a burst of jobs, the service publishing three events for each
    resp = svc.request("submit", {"kind": "noop", "inputs": [f"x{i}" for i in range(600)]}, watcher)
    job_ids = {j["job_id"] for j in resp["data"]["jobs"]}
    before = svc.log().count("connected to")
    # When, in the middle of it, the broker's acknowledgement is lost and the connection cut
    wait_until(lambda: len(watcher.json_on(f"{svc.base}/events")) >= 300, 30, "the burst to be under way")
    proxy.arm_back()
    wait_until(lambda: proxy.dropped >= 1, 30, "the broker's PUBACK to be dropped")
    wait_until(lambda: svc.log().count("connected to") > before, 30, "the service to reconnect")

    # Then every job's end reaches the subscriber, and so does every other transition
    def ends() -> set[str]:
        return {e["job"]["job_id"] for e in watcher.json_on(f"{svc.base}/events") if e["type"] == "end"}

    wait_until(lambda: ends() >= job_ids, 60, "an end event for every job")
    kinds = {(e["job"]["job_id"], e["type"]) for e in watcher.json_on(f"{svc.base}/events")}
    assert all((j, t) in kinds for j in job_ids for t in ("new", "update", "end"))


def test_a_connection_lost_with_a_full_inbox_comes_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given the service's bridge with a full inbox (a burst of requests read and not yet taken;
    # the limit lowered from 2,000 to 50 for the test), reaching a private mosquitto through
    # a proxy
    from edge_queue.config.settings import MqttSettings
    from edge_queue.mqtt import bridge as bridge_module
    from edge_queue.mqtt import inbox as inbox_module
    from edge_queue.mqtt.topics import Topics

    monkeypatch.setattr(inbox_module, "INBOX_HIGH", 50)
    broker = PrivateMosquitto(tmp_path / "broker")
    proxy = AckDroppingProxy(broker.port)
    base = "eqt" + uuid.uuid4().hex[:10]
    settings = MqttSettings(host="127.0.0.1", port=proxy.port, base_topic=base, protocol="5")
    b = bridge_module.Bridge(settings, Topics(base), client_id="svc-" + base)
    try:
        b.connect(10)
        for i in range(120):
            publish(broker, f"{base}/request/submit", json.dumps({"kind": "noop", "transaction": i}))

        def pumped(until: Callable[[], bool]) -> bool:
            b.pump(time.monotonic())
            return until()

        wait_until(lambda: pumped(lambda: len(b.inbox) >= 50), 20, "the inbox to fill")
        first = b.connection
        # When the connection drops (a Wi-Fi link, a NAT timeout) while nothing was taken, and
        # the service learns it from its next publish
        proxy.cut()

        def publish_and_pump() -> bool:
            if b.connected and b.connection == first:
                b.publish(f"{base}/probe", b"x")  # a write to the closed connection ends it
            return pumped(lambda: not (b.connected and b.connection == first))

        wait_until(publish_and_pump, 20, "the bridge to see the connection end")
        # Then it reconnects although the requests of the old connection still fill the inbox
        # (they are taken only once the new connection is accepted: docs/operations.md, "Load
        # and back-pressure"); before, it never read the broker's CONNACK and spun for ever
        wait_until(lambda: pumped(lambda: b.connected and b.connection > first), 20, "the bridge to reconnect")
    finally:
        b.close(timeout_s=2)
        proxy.close()
        broker.stop()
