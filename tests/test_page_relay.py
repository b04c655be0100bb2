"""The queue page's WebSocket relay (``http.websocket_proxy``; docs/operations.md, "Behind a
reverse proxy or Home Assistant's ingress"): the page reaches the broker through its own
server's ``/mqtt``, so one origin serves both. Real MQTT clients over WebSocket (paho) and a
real browser, through the relay to a private mosquitto's WebSocket listener."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from edge_queue.config import HttpSettings
from edge_queue.http.page import MAX_CONNECTIONS_PER_ADDRESS, PageServer

from .conftest import Broker, free_port, wait_until
from .test_page import Browser, _browser_ready, ws_mosquitto  # noqa: F401 (a fixture, by name)


@pytest.fixture
def relay(ws_mosquitto: Broker) -> Iterator[PageServer]:  # noqa: F811
    settings = HttpSettings(
        host="127.0.0.1", port=free_port(), websocket_port=ws_mosquitto.ws_port, websocket_proxy=True
    )
    srv = PageServer(settings, "eqt-relay", "9.9.9", relay_to=("127.0.0.1", settings.websocket_port)).start()
    yield srv
    srv.stop()


def ws_client(port: int, path: str = "/mqtt") -> mqtt.Client:
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="ws-" + uuid.uuid4().hex[:8], transport="websockets")
    c.ws_set_options(path=path)
    connected = threading.Event()
    c.on_connect = lambda *a: connected.set()
    c.connect("127.0.0.1", port, keepalive=30)
    c.loop_start()
    assert connected.wait(10), "no CONNACK through the relay"
    return c


def test_config_json_points_the_page_at_its_own_relay(relay: PageServer) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{relay.port}/config.json", timeout=5) as r:
        cfg = json.loads(r.read())
    assert cfg["websocket_path"] == "mqtt"
    with pytest.raises(urllib.error.HTTPError) as e:  # a plain GET of /mqtt is no WebSocket
        urllib.request.urlopen(f"http://127.0.0.1:{relay.port}/mqtt", timeout=5)
    assert e.value.code == 400
    e.value.close()


def test_no_relay_unless_asked(tmp_path: Path) -> None:
    srv = PageServer(HttpSettings(host="127.0.0.1", port=free_port()), "b", "1").start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/config.json", timeout=5) as r:
            assert json.loads(r.read())["websocket_path"] is None
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/mqtt", timeout=5)
        assert e.value.code == 404
        e.value.close()
    finally:
        srv.stop()


def test_mqtt_over_the_relay_and_more_pages_than_one_address_may_open(relay: PageServer) -> None:
    """Behind Home Assistant's ingress every page comes from one address: relayed WebSockets
    do not count against that address's connections, and the page's files are still served."""
    clients = [ws_client(relay.port) for _ in range(MAX_CONNECTIONS_PER_ADDRESS + 4)]
    try:
        got: list[bytes] = []
        subscribed = threading.Event()
        clients[0].on_message = lambda c, u, m: got.append(m.payload)
        clients[0].on_subscribe = lambda *a: subscribed.set()
        clients[0].subscribe("relay/test", qos=1)
        assert subscribed.wait(10)
        clients[-1].publish("relay/test", b"through the relay", qos=1).wait_for_publish(10)
        wait_until(lambda: got == [b"through the relay"], 10, "the message through two relayed connections")
        with urllib.request.urlopen(f"http://127.0.0.1:{relay.port}/", timeout=5) as r:
            assert r.status == 200
    finally:
        for c in clients:
            c.loop_stop()
            c.disconnect()


@pytest.mark.slow
@pytest.mark.serial
def test_the_page_in_a_browser_through_the_relay(
    service_factory: Any,
    ws_mosquitto: Broker,  # noqa: F811
    tmp_path: Path,
) -> None:
    _browser_ready()
    media = tmp_path / "media"
    media.mkdir()
    port = free_port()
    env = {
        "EDGE_QUEUE_HTTP__ENABLED": "true",
        "EDGE_QUEUE_HTTP__HOST": "127.0.0.1",
        "EDGE_QUEUE_HTTP__PORT": str(port),
        "EDGE_QUEUE_HTTP__WEBSOCKET_PORT": str(ws_mosquitto.ws_port),
        "EDGE_QUEUE_HTTP__WEBSOCKET_PROXY": "true",
    }
    service_factory(ws_mosquitto, [media], env).start()
    b = Browser(tmp_path / "browser.log")
    try:
        b.do("goto", url=f"http://127.0.0.1:{port}/")
        b.wait("page.connected && page.online === true", timeout=30)
        assert b.eval("wsUrl()") == f"ws://127.0.0.1:{port}/mqtt"
    finally:
        b.close()
