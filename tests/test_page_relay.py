"""The queue page's WebSocket relay (``http.websocket_proxy``; docs/operations.md, "Behind a
reverse proxy or Home Assistant's ingress"): the page reaches the broker through its own
server's ``/mqtt``, so one origin serves both. Real MQTT clients over WebSocket (paho) and a
real browser, through the relay to a private mosquitto's WebSocket listener."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from edge_queue.config.http import HttpSettings
from edge_queue.http import relay as relay_rules
from edge_queue.http.page import MAX_CONNECTIONS_PER_ADDRESS, PageServer
from edge_queue.http.relay import MAX_RELAYS_PER_ADDRESS
from edge_queue.mqtt.embedded_broker import BrokerThread, broker_config

from .conftest import Broker, port_open, run_doctor, wait_until
from .helpers.handshakes import raw_handshake
from .helpers.page import Browser, browser_ready
from .helpers.ports import free_port


@pytest.fixture
def relay(ws_mosquitto: Broker) -> Iterator[PageServer]:
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


def test_mqtt_over_the_relay_and_more_pages_than_one_address_may_open(ws_mosquitto: Broker) -> None:
    """Behind Home Assistant's ingress every page comes from one address, the proxy's
    (``http.trusted_proxies``): its relayed WebSockets do not count against that address's
    connections nor its share of the relays, and the page's files are still served."""
    settings = HttpSettings(
        host="127.0.0.1",
        port=free_port(),
        websocket_port=ws_mosquitto.ws_port,
        websocket_proxy=True,
        trusted_proxies=["127.0.0.1"],
    )
    relay = PageServer(settings, "eqt-relay", "9.9.9", relay_to=("127.0.0.1", settings.websocket_port)).start()
    clients = [ws_client(relay.port) for _ in range(max(MAX_CONNECTIONS_PER_ADDRESS, MAX_RELAYS_PER_ADDRESS) + 4)]
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
        relay.stop()


def test_a_port_handed_to_another_test_process_is_not_handed_here(monkeypatch: pytest.MonkeyPatch) -> None:
    from .helpers import ports

    # Given another test process (a pytest-xdist worker, another run on the machine) that was
    # handed a port, and the same one coming up next here
    other = subprocess.Popen(
        [sys.executable, "-c", "from tests.helpers.ports import free_port; print(free_port(), flush=True); input()"],
        cwd=Path(ports.__file__).parent.parent.parent,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert other.stdout is not None
        taken = int(other.stdout.readline())
        offers = [taken]
        pick = ports.candidate_port
        monkeypatch.setattr(ports, "candidate_port", lambda: offers.pop() if offers else pick())
        # Then this process is handed another (before: the same; the relay's browser test then
        # opened another test's page, whose relay answered Chromium 403)
        assert free_port() != taken
    finally:
        other.kill()  # as a run that was killed: its file stays
        other.communicate(timeout=30)
    # And once that process has ended, its port may be handed out again
    assert (ports.PORTS_DIR / str(taken)).exists()
    monkeypatch.setattr(ports, "candidate_port", lambda: taken)
    assert free_port() == taken


def test_ports_handed_out_are_outside_the_range_of_outgoing_connections() -> None:
    from .helpers.ports import PORT_RANGE, ephemeral_low

    # (before: the kernel's pick, from the range it also takes the local port of every
    # connection from; a page's port was taken so before the page's server bound it)
    if not PORT_RANGE:
        pytest.skip("no room below the kernel's ephemeral range (net.ipv4.ip_local_port_range)")
    ports = [free_port() for _ in range(20)]
    assert all(port < ephemeral_low() for port in ports), ports
    for port in ports:  # each one free to listen on
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


@pytest.mark.slow
@pytest.mark.serial
def test_the_page_in_a_browser_through_the_relay(
    service_factory: Any,
    ws_mosquitto: Broker,
    tmp_path: Path,
) -> None:
    browser_ready()
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
    svc = service_factory(ws_mosquitto, [media], env).start()
    # the page Chromium opens is this service's (a port taken meanwhile: "cannot listen")
    assert f"queue page on http://127.0.0.1:{port}/" in svc.log(), svc.log()
    b = Browser(tmp_path / "browser.log")
    try:
        b.do("goto", url=f"http://127.0.0.1:{port}/")
        b.wait("page.connected && page.online === true", timeout=30)
        assert b.eval("wsUrl()") == f"ws://127.0.0.1:{port}/mqtt"
    finally:
        b.close()


def anonymous_connect() -> bytes:
    """An MQTT 3.1.1 CONNECT, clean session, keepalive 30 s, a client id of its own, no login."""
    client_id = uuid.uuid4().hex[:12].encode()
    body = b"\x00\x04MQTT\x04\x02\x00\x1e" + len(client_id).to_bytes(2, "big") + client_id
    return bytes([0x10, len(body)]) + body


CONNACK_ACCEPTED = b"\x20\x02\x00\x00"


def browser_ws(
    port: int, origin: str | None, path: str = "/mqtt", source: str = "127.0.0.1", headers: dict[str, str] | None = None
) -> Any:
    """A browser-like MQTT over WebSocket handshake from ``source`` with ``Origin: origin``
    and ``headers`` (the websockets library's client), open; raises ``InvalidStatus`` when refused."""
    from websockets.sync.client import connect

    sock = socket.socket()
    sock.settimeout(10)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    url = f"ws://127.0.0.1:{port}{path}"
    return connect(url, sock=sock, subprotocols=["mqtt"], origin=origin, additional_headers=headers, open_timeout=10)


def connack(
    port: int, origin: str | None, path: str = "/mqtt", source: str = "127.0.0.1", headers: dict[str, str] | None = None
) -> bytes:
    """:func:`browser_ws`, then an anonymous CONNECT: the broker's answer."""
    with browser_ws(port, origin, path, source, headers) as ws:
        ws.send(anonymous_connect())
        return bytes(ws.recv(timeout=10))


def test_a_foreign_origin_is_refused_by_the_relay_and_the_pages_own_connects(relay: PageServer) -> None:
    from websockets.exceptions import InvalidStatus

    # When a web site open in a browser reaches the page's relay (before: relayed to the broker)
    with pytest.raises(InvalidStatus) as refused:
        connack(relay.port, "http://evil.example")
    # Then it is refused in the handshake
    assert refused.value.response.status_code == 403
    # While the page's own origin, and clients that are no browser, get the broker's CONNACK
    assert connack(relay.port, f"http://127.0.0.1:{relay.port}") == CONNACK_ACCEPTED
    assert connack(relay.port, f"http://localhost:{relay.port}") == CONNACK_ACCEPTED
    assert connack(relay.port, None) == CONNACK_ACCEPTED


def test_a_reverse_proxys_headers_are_believed_from_its_address_only(
    ws_mosquitto: Broker,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from websockets.exceptions import InvalidStatus

    caplog.set_level(logging.WARNING)
    # Given the page's relay behind a reverse proxy at 127.0.0.2 (http.trusted_proxies)
    settings = HttpSettings(
        host="127.0.0.1",
        port=free_port(),
        websocket_port=ws_mosquitto.ws_port,
        websocket_proxy=True,
        trusted_proxies=["127.0.0.2"],
    )
    relay = PageServer(settings, "eqt-relay", "9.9.9", relay_to=("127.0.0.1", settings.websocket_port)).start()
    headers = {"X-Forwarded-Host": "ha.example.org", "X-Forwarded-Proto": "https"}
    try:
        # Then the proxy's page is relayed (Home Assistant's ingress passes the browser's Origin
        # and says which host the browser asked for)
        origin = "https://ha.example.org"
        assert connack(relay.port, origin, source="127.0.0.2", headers=headers) == CONNACK_ACCEPTED
        # While the same headers from another address are the client's own word (before: believed)
        with pytest.raises(InvalidStatus) as refused:
            connack(relay.port, origin, source="127.0.0.1", headers=headers)
        assert refused.value.response.status_code == 403
        # And a handshake with two Origin headers is refused (before: the first was relayed),
        # all in one line a minute
        own = f"Origin: http://127.0.0.1:{relay.port}"
        assert raw_handshake(relay.port, own, own, path="/mqtt") == 403
        lines = [r.getMessage() for r in caplog.records if "refused a relayed WebSocket" in r.getMessage()]
        assert len(lines) == 1 and "https://ha.example.org" in lines[0], lines
    finally:
        relay.stop()


def lan_relay(ws_port: int) -> PageServer:
    """The page on every address (0.0.0.0, the default), relaying to ``ws_port``."""
    settings = HttpSettings(host="0.0.0.0", port=free_port(), websocket_port=ws_port, websocket_proxy=True)
    return PageServer(settings, "eqt-relay", "9.9.9", relay_to=("127.0.0.1", ws_port)).start()


@pytest.mark.parametrize("any_user", [False, True], ids=["no-login", "any-user-name"])
def test_an_anonymous_broker_is_never_relayed_to_the_lan(caplog: pytest.LogCaptureFixture, any_user: bool) -> None:
    from websockets.exceptions import InvalidStatus

    caplog.set_level(logging.WARNING)
    # Given the embedded broker without passwords (`edge-queue up`'s default; or amqtt's
    # allow-anonymous false without a password file, which takes any user name) and the page
    # on every address with its relay (before: the LAN got the anonymous broker, as an admin)
    ws = free_port()
    config = broker_config("127.0.0.1", free_port(), websocket_port=ws)
    if any_user:
        config["plugins"] = {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": False}}
    broker = BrokerThread(config)
    broker.start()
    page = lan_relay(ws)
    try:
        # Then the page's own origin gets no relay, and one line says why, at start
        wait_until(
            lambda: any("/mqtt is not relayed" in r.getMessage() for r in caplog.records), 10, "the line at start"
        )
        with pytest.raises(InvalidStatus) as refused:
            connack(page.port, f"http://127.0.0.1:{page.port}")
        assert refused.value.response.status_code == 403
        lines = [r.getMessage() for r in caplog.records if "/mqtt is not relayed" in r.getMessage()]
        assert len(lines) == 1 and f"127.0.0.1:{ws} takes clients without a login" in lines[0], lines
    finally:
        page.stop()
        broker.stop()


@pytest.mark.slow
def test_a_broker_that_asks_for_a_login_is_relayed_to_the_lan(tmp_path: Path) -> None:
    from pwdlib import PasswordHash

    # Given the embedded broker with a password file, and the page on every address
    (tmp_path / "passwd").write_text("page:" + PasswordHash.recommended().hash("secret") + "\n")
    ws = free_port()
    broker = BrokerThread(broker_config("127.0.0.1", free_port(), websocket_port=ws, password_file=tmp_path / "passwd"))
    broker.start()
    page = lan_relay(ws)
    try:
        # Then a page that logs in is relayed
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="ws-" + uuid.uuid4().hex[:8], transport="websockets")
        c.ws_set_options(path="/mqtt")
        c.username_pw_set("page", "secret")
        codes: list[Any] = []
        c.on_connect = lambda client, userdata, flags, reason, props: codes.append(reason)
        c.connect("127.0.0.1", page.port, keepalive=30)
        c.loop_start()
        try:
            wait_until(lambda: codes, 10, "a CONNACK through the relay")
            assert not codes[0].is_failure, codes
        finally:
            c.loop_stop()
            c.disconnect()
    finally:
        page.stop()
        broker.stop()


def test_a_relay_that_sends_no_mqtt_connect_is_closed(relay: PageServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay_rules, "CONNECT_S", 1.0)
    # Given a page that logged in through the relay
    page = ws_client(relay.port)
    try:
        # When a client opens a relayed WebSocket and sends nothing (before: it held its slot
        # until the broker gave up on it, 60-120 s)
        silent = browser_ws(relay.port, None)
        t0 = time.monotonic()
        # Then the relay closes it after CONNECT_S
        from websockets.exceptions import ConnectionClosed

        with pytest.raises(ConnectionClosed):
            silent.recv(timeout=10)
        assert 0.5 <= time.monotonic() - t0 < 5, time.monotonic() - t0
        silent.close()
        # And a first frame that is not an MQTT CONNECT is closed at once
        with browser_ws(relay.port, None) as other:
            other.send(b"\x30\x05\x00\x01tx")  # a PUBLISH before any CONNECT
            with pytest.raises(ConnectionClosed):
                other.recv(timeout=0.9)
        # While the page that logged in keeps its relay past the deadline
        got: list[bytes] = []
        subscribed = threading.Event()
        page.on_message = lambda c, u, m: got.append(m.payload)
        page.on_subscribe = lambda *a: subscribed.set()
        page.subscribe("relay/deadline", qos=1)
        assert subscribed.wait(10)
        page.publish("relay/deadline", b"still here", qos=1).wait_for_publish(10)
        wait_until(lambda: got == [b"still here"], 10, "the logged-in page's message")
    finally:
        page.loop_stop()
        page.disconnect()


def test_one_address_holds_at_most_a_quarter_of_the_relays(relay: PageServer) -> None:
    from websockets.exceptions import InvalidStatus

    # Given one address holding its share of the relays, each logged in
    held = []
    try:
        for _ in range(MAX_RELAYS_PER_ADDRESS):
            ws = browser_ws(relay.port, None)
            held.append(ws)
            ws.send(anonymous_connect())
            assert ws.recv(timeout=10) == CONNACK_ACCEPTED
        # When it opens one more (before: it could take all 32, and everyone else got 503)
        with pytest.raises(InvalidStatus) as refused:
            connack(relay.port, None)
        # Then that one is refused, and another address still gets a relay
        assert refused.value.response.status_code == 503
        assert b"from this address" in refused.value.response.body
        assert connack(relay.port, None, source="127.0.0.2") == CONNACK_ACCEPTED
    finally:
        for ws in held:
            ws.close()


@pytest.mark.slow
def test_up_with_its_embedded_broker_refuses_foreign_origins_and_does_not_relay_it_to_the_lan(
    service_factory: Any, tmp_path: Path
) -> None:
    from websockets.exceptions import InvalidStatus

    from .conftest import Broker as TestBroker

    # Given `edge-queue up` with its embedded broker (anonymous: no broker.config_file), its
    # WebSocket listener for the page, and the page on every address with its relay
    media = tmp_path / "media"
    media.mkdir()
    page, ws = free_port(), free_port()
    env = {
        "EDGE_QUEUE_HTTP__ENABLED": "true",
        "EDGE_QUEUE_HTTP__HOST": "0.0.0.0",
        "EDGE_QUEUE_HTTP__PORT": str(page),
        "EDGE_QUEUE_HTTP__WEBSOCKET_PORT": str(ws),
        "EDGE_QUEUE_HTTP__WEBSOCKET_PROXY": "true",
        "EDGE_QUEUE_MQTT__PROTOCOL": "3.1.1",
    }
    svc = service_factory(TestBroker("127.0.0.1", free_port(), "amqtt"), [media], env)
    svc.command = "up"
    svc.start(wait_online=False)  # its broker comes up with it
    wait_until(lambda: port_open("127.0.0.1", ws) or svc.proc.poll() is not None, 60, "the broker's WebSocket")
    assert svc.proc.poll() is None, svc.log()
    # When a web site open in a browser on the box connects to the broker's WebSocket listener
    with pytest.raises(InvalidStatus) as refused:
        connack(ws, "http://evil.example", path="/")
    # Then it gets nothing (before: a CONNACK, then the media listing, submit, purge)
    assert refused.value.response.status_code == 403
    # While the page's own origin still connects
    assert connack(ws, f"http://127.0.0.1:{page}", path="/") == CONNACK_ACCEPTED
    # And the relay does not hand the anonymous broker to the LAN, and says so once at start
    wait_until(lambda: port_open("127.0.0.1", page) or svc.proc.poll() is not None, 60, "the queue page")
    with pytest.raises(InvalidStatus) as not_relayed:
        connack(page, f"http://127.0.0.1:{page}")
    assert not_relayed.value.response.status_code == 403
    wait_until(lambda: svc.log().count("/mqtt is not relayed") == 1, 10, "the line at start")


@pytest.mark.slow
def test_config_check_and_doctor_say_the_relay_will_not_carry_an_anonymous_broker(tmp_path: Path) -> None:
    # Given the page's relay on every address (http.host's default) and `up`'s embedded broker
    # without broker.config_file: anonymous (before: nothing warned, config check passed)
    ws, port = free_port(), free_port()
    env = {
        **os.environ,
        "EDGE_QUEUE_DATA_DIR": str(tmp_path / "data"),
        "EDGE_QUEUE_MEDIA_ROOTS": json.dumps([str(tmp_path)]),
        "EDGE_QUEUE_MQTT__PORT": str(port),
        "EDGE_QUEUE_MQTT__BASE_TOPIC": "eqt" + uuid.uuid4().hex[:8],
        "EDGE_QUEUE_HTTP__WEBSOCKET_PORT": str(ws),
        "EDGE_QUEUE_HTTP__WEBSOCKET_PROXY": "true",
    }
    env.pop("EDGE_QUEUE_CONFIG", None)
    # Then config check says so, and still passes: the queue runs, the relay refuses
    check = subprocess.run(
        [sys.executable, "-m", "edge_queue", "config", "check"], env=env, capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stderr
    assert "warning: http.websocket_proxy relays the broker's WebSocket to the LAN" in check.stderr
    local = subprocess.run(
        [sys.executable, "-m", "edge_queue", "config", "check"],
        env={**env, "EDGE_QUEUE_HTTP__HOST": "127.0.0.1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert local.returncode == 0 and "warning" not in local.stderr, local.stderr
    # And doctor, with that broker running, says the relay will not carry it
    broker = BrokerThread(broker_config("127.0.0.1", port, websocket_port=ws))
    broker.start()
    try:
        out = run_doctor(env)
        assert (
            f"warn  page relay: /mqtt is not relayed: the broker's WebSocket listener at 127.0.0.1:{ws}" in out.stdout
        )
    finally:
        broker.stop()
