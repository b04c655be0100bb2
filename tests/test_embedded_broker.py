"""QoS 1 deliveries of the embedded broker (edge_queue/mqtt/embedded_broker.py; docs/operations.md,
"Load and back-pressure"): a message waits for its PUBACK as long as the connection lasts, at
most ``INFLIGHT`` per client are unacknowledged, a client that acknowledges none of a full
window is disconnected, and amqtt's log lines of one kind are throttled. The broker runs in the test's
process (``BrokerThread``, as ``edge-queue up`` runs it), on a free port.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from edge_queue.mqtt import embedded_broker
from edge_queue.mqtt.embedded_broker import BrokerThread, broker_config

from .conftest import stop_client, wait_until
from .helpers.handshakes import raw_handshake
from .helpers.ports import free_port


@pytest.fixture
def port() -> Iterator[int]:
    port = free_port()
    broker = BrokerThread(broker_config("127.0.0.1", port))
    broker.start()
    yield port
    broker.stop()


class SlowAcker:
    """A subscriber that acknowledges each QoS 1 message only when told to (paho's manual ack)."""

    def __init__(self, port: int, topic: str) -> None:
        self.got: list[tuple[int, bytes]] = []  # (mid, payload)
        self.acked = 0
        self.disconnected = threading.Event()
        self._lock = threading.Lock()
        ready = threading.Event()
        self.client_id = "slow-" + uuid.uuid4().hex[:8]
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=self.client_id, manual_ack=True)
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *a: ready.set()
        self.client.on_connect = lambda c, *a: c.subscribe(topic, 1)
        self.client.on_disconnect = lambda *a: self.disconnected.set()
        self.client.connect("127.0.0.1", port, keepalive=120)
        self.client.loop_start()
        assert ready.wait(10)

    def _on_message(self, client: Any, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        with self._lock:
            self.got.append((msg.mid, bytes(msg.payload)))

    def payloads(self) -> list[bytes]:
        with self._lock:
            return [p for _, p in self.got]

    def ack_all(self) -> None:
        """Acknowledge every message not acknowledged yet."""
        with self._lock:
            mids = [m for m, _ in self.got[self.acked :]]
            self.acked = len(self.got)
        for mid in mids:
            self.client.ack(mid, 1)

    def close(self) -> None:
        stop_client(self.client)


def publish(port: int, topic: str, payloads: list[bytes]) -> None:
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="pub-" + uuid.uuid4().hex[:8])
    c.connect("127.0.0.1", port)
    c.loop_start()
    try:
        for info in [c.publish(topic, p, qos=1) for p in payloads]:
            info.wait_for_publish(10)
    finally:
        c.disconnect()
        c.loop_stop()


def broker_records(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("amqtt") and r.levelno >= logging.WARNING]


@pytest.mark.slow
def test_a_qos1_message_acknowledged_after_six_seconds_is_neither_given_up_nor_logged(
    port: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    # Given a subscriber that holds its PUBACKs, as a client behind a backlog does
    slow = SlowAcker(port, "t/slow")
    try:
        publish(port, "t/slow", [b"a", b"b", b"c"])
        wait_until(lambda: len(slow.got) == 3, 10, "three messages")
        # When it acknowledges them after 6 s (amqtt 0.12.1 gave up on a PUBACK after 5 s)
        time.sleep(6)
        slow.ack_all()
        # Then the broker, which still waits for those PUBACKs (at most INFLIGHT of them), takes
        # the next messages in, and logged neither a timeout nor an unknown PUBACK
        publish(port, "t/slow", [b"d"])
        wait_until(lambda: len(slow.got) == 4, 10, "the fourth message")
        assert slow.payloads() == [b"a", b"b", b"c", b"d"]
        time.sleep(0.2)
        assert broker_records(caplog) == []
    finally:
        slow.close()


def test_at_most_inflight_messages_await_a_clients_puback_and_the_rest_follow_in_order(
    port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(embedded_broker, "INFLIGHT", 5)
    # Given a subscriber that holds its PUBACKs
    slow = SlowAcker(port, "t/window")
    try:
        # When 12 QoS 1 messages are published to it
        publish(port, "t/window", [b"%d" % i for i in range(12)])
        # Then it gets 5, and the next ones only as it acknowledges, in order
        wait_until(lambda: len(slow.got) == 5, 10, "the first five")
        time.sleep(0.3)
        assert len(slow.got) == 5
        slow.ack_all()
        wait_until(lambda: len(slow.got) == 10, 10, "the next five")
        slow.ack_all()
        wait_until(lambda: len(slow.got) == 12, 10, "the last two")
        assert slow.payloads() == [b"%d" % i for i in range(12)]
    finally:
        slow.close()


def test_a_client_that_acknowledges_nothing_while_its_window_is_full_is_disconnected(
    port: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(embedded_broker, "INFLIGHT", 3)
    caplog.set_level(logging.WARNING)
    # Given a subscriber that reads but never acknowledges, whose window is full
    slow = SlowAcker(port, "t/stall")
    try:
        publish(port, "t/stall", [b"x"] * 5)
        wait_until(lambda: len(slow.got) == 3, 10, "a full window")
        # Then the broker disconnects it, and says why
        assert slow.disconnected.wait(10)
        assert any(f"'{slow.client_id}' has read nothing for 2 s" in r.getMessage() for r in caplog.records)
    finally:
        slow.close()


def test_a_client_that_acknowledges_nothing_with_room_in_its_window_stays(port: int) -> None:
    # Given a subscriber that reads but never acknowledges, with room in its window
    slow = SlowAcker(port, "t/room")
    try:
        publish(port, "t/room", [b"x"] * 5)
        wait_until(lambda: len(slow.got) == 5, 10, "five messages")
        # Then it stays connected: what it holds is bounded by the window
        assert not slow.disconnected.wait(5)
    finally:
        slow.close()


def test_amqtt_lines_of_one_kind_are_throttled_and_counted(
    port: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    amqtt_log = logging.getLogger("amqtt.mqtt.protocol.handler")
    kind = f"Received PUBACK for unknown pending message {uuid.uuid4().hex[:6]} Id: '%d'"
    # When amqtt logs 50 lines of one kind (numbers differ) and one of another
    for i in range(50):
        amqtt_log.warning(kind, i)
    amqtt_log.warning("something else")
    # Then 5 of the first kind are logged, and the other
    logged = broker_records(caplog)
    assert len([m for m in logged if m.startswith(kind[:50])]) == embedded_broker.BROKER_LINES_LOGGED
    assert "something else" in logged
    # And the first line of that kind in a later window says how many were left out
    monkeypatch.setattr(embedded_broker, "BROKER_LOG_WINDOW_S", 0.0)
    amqtt_log.warning(kind, 99)
    assert broker_records(caplog)[-1].endswith(
        f"({50 - embedded_broker.BROKER_LINES_LOGGED} more like it not logged in 0 s)"
    )


def test_the_service_is_never_disconnected_for_a_full_window(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given the embedded broker of `edge-queue up`, which trusts the service's client id, and the
    # service behind on its PUBACKs with a full window (a turn that takes longer than 2 s: before,
    # it was disconnected, and amqtt dropped the requests it had not acknowledged)
    monkeypatch.setattr(embedded_broker, "INFLIGHT", 3)
    port = free_port()
    broker = BrokerThread(broker_config("127.0.0.1", port))
    broker.start()
    try:
        slow = SlowAcker(port, "t/service")
        broker.trust(slow.client_id)
        try:
            publish(port, "t/service", [b"x"] * 5)
            wait_until(lambda: len(slow.got) == 3, 10, "a full window")
            # Then it stays connected, and gets the rest once it acknowledges
            assert not slow.disconnected.wait(5)
            slow.ack_all()
            wait_until(lambda: len(slow.got) == 5, 10, "the rest")
        finally:
            slow.close()
    finally:
        broker.stop()


def test_an_amqtt_configuration_of_an_earlier_release_still_names_the_plugin() -> None:
    # an amqtt.yaml copied from broker/ before the move names edge_queue.amqtt_plugins.ReservedClientIds
    import importlib

    from edge_queue.mqtt.amqtt_plugins import ReservedClientIds

    assert importlib.import_module("edge_queue.amqtt_plugins").ReservedClientIds is ReservedClientIds


#: An MQTT 3.1.1 CONNECT, clean session, keepalive 30 s, client id "ab", no login.
ANONYMOUS_CONNECT = bytes([0x10, 14, 0, 4]) + b"MQTT" + bytes([4, 2, 0, 30, 0, 2]) + b"ab"


def ws_connack(port: int, origin: str | None, path: str = "/") -> bytes:
    """A browser-like MQTT over WebSocket handshake with ``Origin: origin`` (the websockets
    library's client, as a browser sends it), then an anonymous CONNECT: the broker's answer."""
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{port}{path}", subprotocols=["mqtt"], origin=origin, open_timeout=10) as ws:
        ws.send(ANONYMOUS_CONNECT)
        return bytes(ws.recv(timeout=10))


def test_a_foreign_origin_gets_nothing_from_the_websocket_listener_and_the_pages_own_connects(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from websockets.exceptions import InvalidStatus

    from edge_queue.config.http import HttpSettings

    caplog.set_level(logging.WARNING)
    # Given the embedded broker as `edge-queue up` starts it: anonymous, with its WebSocket
    # listener for the queue page on 127.0.0.1, the page on its port
    port, ws, page = free_port(), free_port(), free_port()
    broker = BrokerThread(broker_config("127.0.0.1", port, websocket_port=ws), page=HttpSettings(port=page))
    broker.start()
    try:
        # When a web site open in a browser on the box connects (before: CONNACK, as an admin)
        with pytest.raises(InvalidStatus) as refused:
            ws_connack(ws, "http://evil.example")
        # Then it is refused in the handshake, and the log says so
        assert refused.value.response.status_code == 403
        assert any(
            "refused a WebSocket from 127.0.0.1 with Origin 'http://evil.example'" in r.getMessage()
            for r in caplog.records
        )
        with pytest.raises(InvalidStatus):
            ws_connack(ws, f"http://evil.example:{page}")  # DNS rebinding onto the page's port
        # While the page's own origins and clients that are no browser still connect
        assert ws_connack(ws, f"http://127.0.0.1:{page}") == b"\x20\x02\x00\x00"
        assert ws_connack(ws, f"http://localhost:{page}") == b"\x20\x02\x00\x00"
        assert ws_connack(ws, None) == b"\x20\x02\x00\x00"
    finally:
        broker.stop()


def test_the_listener_refuses_two_origins_and_a_proxys_headers_from_elsewhere_in_one_line_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from edge_queue.config.http import HttpSettings

    caplog.set_level(logging.INFO)
    # Given the embedded broker's WebSocket listener for the page on its port, no proxy trusted
    port, ws, page = free_port(), free_port(), free_port()
    broker = BrokerThread(broker_config("127.0.0.1", port, websocket_port=ws), page=HttpSettings(port=page))
    broker.start()
    try:
        # When a handshake has two Origin headers (before: 500, websockets' MultipleValuesError)
        own = f"Origin: http://127.0.0.1:{page}"
        assert raw_handshake(ws, own, "Origin: http://evil.example") == 403
        # Or says itself which host the browser asked for (before: believed from anyone)
        forged = ("Origin: http://evil.example", "X-Forwarded-Host: evil.example", "X-Forwarded-Proto: http")
        assert raw_handshake(ws, *forged) == 403
        # And 50 more handshakes come, half refused, half taken
        codes = [raw_handshake(ws, "Origin: http://evil.example" if i % 2 else own) for i in range(50)]
        assert codes == [101, 403] * 25
        # Then one line says they were refused (one a minute), and the websockets library says
        # nothing per connection (before: one INFO line per handshake)
        refused = [r for r in caplog.records if "refused a WebSocket" in r.getMessage()]
        assert len(refused) == 1 and "more than one Origin" in refused[0].getMessage(), refused
        library = [r.getMessage() for r in caplog.records if r.name.startswith("websockets")]
        assert library == [], library[:5]
    finally:
        broker.stop()
