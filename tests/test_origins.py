"""The rules of who may open a WebSocket to the broker and hold the page's relay, as plain
functions (edge_queue/mqtt/origins.py, edge_queue/http/relay.py; docs/operations.md, "Which
pages may connect to the broker"): milliseconds, no socket."""

from __future__ import annotations

import pytest

from edge_queue.config.http import HttpSettings
from edge_queue.config.values import canonical_address, is_loopback
from edge_queue.http import relay
from edge_queue.http.relay import Login, LoginGate, RelaySlots
from edge_queue.mqtt.origins import origin_refusal, page_origins, parse_origin
from edge_queue.rules.rates import REFUSAL_LOG_S, RefusalLog

ORIGINS = page_origins(
    HttpSettings(
        host="0.0.0.0", port=8099, allowed_origins=["https://nas.example.org"], trusted_proxies=["172.30.32.2"]
    ),
    hostname="mybox",
)


def refusal(
    origin: str | list[str] | None,
    local: tuple[str, int] | None = ("127.0.0.1", 9001),
    remote: str | None = "127.0.0.1",
    **headers: str,
) -> str | None:
    return origin_refusal(
        ORIGINS, origin, local=local, remote=remote, headers={k.replace("_", "-"): v for k, v in headers.items()}
    )


@pytest.mark.parametrize(
    "origin",
    [
        None,  # not a browser: paho, mosquitto_sub, Home Assistant
        "http://127.0.0.1:8099",
        "http://localhost:8099",
        "http://[::1]:8099",
        "http://mybox:8099",
        "http://MyBox.local:8099",
        "https://nas.example.org",  # http.allowed_origins
        "http://127.0.0.1:9001",  # paho's: the address it connects to
    ],
)
def test_the_pages_own_origins_and_clients_without_one_are_taken(origin: str | None) -> None:
    assert refusal(origin) is None


@pytest.mark.parametrize(
    "origin",
    [
        "http://evil.example",
        "http://evil.example:8099",  # DNS rebinding: a foreign name on the page's port
        "http://evil.example:9001",
        "https://127.0.0.1:8099",  # the page itself is plain http
        "http://127.0.0.1:8100",
        "http://192.168.1.9:8099",  # an address that is not the one the connection reached
        "null",  # a sandboxed frame, a file:// page
        "file://",
        "http://127.0.0.1:8099/path",
        "",
    ],
)
def test_other_origins_are_refused(origin: str) -> None:
    assert refusal(origin) is not None


def test_the_box_address_the_connection_reached_is_the_pages_on_the_lan() -> None:
    assert refusal("http://192.168.1.5:8099", local=("192.168.1.5", 9001)) is None
    assert refusal("http://192.168.1.5:8099", local=("::ffff:192.168.1.5", 9001)) is None
    assert refusal("http://192.168.1.5:8099", local=("192.168.1.6", 9001)) is not None


def test_a_reverse_proxy_says_which_origin_the_browser_asked_for() -> None:
    # Home Assistant's ingress (http.trusted_proxies) passes the browser's Origin and sets both headers
    ha = {"x_forwarded_host": "ha.example.org", "x_forwarded_proto": "https", "remote": "172.30.32.2"}
    assert refusal("https://ha.example.org", **ha) is None
    assert refusal("https://ha.example.org", **{**ha, "remote": "::ffff:172.30.32.2"}) is None
    assert refusal("https://evil.example", **ha) is not None
    assert refusal("http://ha.example.org", **ha) is not None  # another scheme is another origin
    assert refusal("http://ha.local:8123", x_forwarded_host="ha.local:8123", remote="172.30.32.2") is None


def test_a_reverse_proxys_headers_are_believed_from_a_trusted_proxy_only() -> None:
    # Given a script on the LAN that sends the headers itself (before: believed from anyone)
    forged = {"x_forwarded_host": "evil.example", "x_forwarded_proto": "http"}
    # Then its Origin is refused, from any address but the proxy's
    assert refusal("http://evil.example", remote="192.168.1.9", **forged) is not None
    assert refusal("http://evil.example", remote="127.0.0.1", **forged) is not None
    assert refusal("http://evil.example", remote=None, **forged) is not None
    assert refusal("http://evil.example", remote="172.30.32.2", **forged) is None


def test_more_than_one_origin_is_refused() -> None:
    # Given a handshake with two Origin headers (before: the relay took the first, the
    # embedded broker's listener answered 500)
    assert refusal(["http://127.0.0.1:8099", "http://evil.example"]) == "it sends more than one Origin"
    assert refusal(["http://127.0.0.1:8099", "http://127.0.0.1:8099"]) == "it sends more than one Origin"
    # While one is judged as ever, and none is a client that is no browser
    assert refusal(["http://127.0.0.1:8099"]) is None
    assert refusal(["http://evil.example"]) is not None
    assert refusal([]) is None


def test_a_trailing_dot_is_another_origin_as_in_the_browser() -> None:
    # A browser keeps the dot: http://localhost.:8099 is not http://localhost:8099's origin
    # (before: taken as localhost)
    assert parse_origin("http://localhost.:8099") == ("http", "localhost.", 8099)
    assert refusal("http://localhost.:8099") is not None
    assert refusal("http://mybox.:8099") is not None
    listed = page_origins(HttpSettings(port=8099, allowed_origins=["http://localhost.:8099"]), hostname="x")
    assert origin_refusal(listed, "http://localhost.:8099", local=None, remote=None, headers={}) is None


def test_the_configured_host_is_one_of_the_pages() -> None:
    origins = page_origins(HttpSettings(host="192.168.1.5", port=8099), hostname="x")
    assert origin_refusal(origins, "http://192.168.1.5:8099", local=None, remote=None, headers={}) is None
    assert "0.0.0.0" not in ORIGINS.hosts


def test_parse_origin() -> None:
    assert parse_origin("http://[::1]:8099") == ("http", "::1", 8099)
    assert parse_origin("https://Nas.Example.org") == ("https", "nas.example.org", 443)
    assert parse_origin("http://a:99999") is None
    assert parse_origin("ws://a") is None


def test_the_websocket_librarys_connection_lines_show_at_debug_only() -> None:
    import logging

    from edge_queue.mqtt.ws_listener import library_log_level

    assert library_log_level(logging.DEBUG) == logging.DEBUG
    assert library_log_level(logging.INFO) == logging.WARNING
    assert library_log_level(logging.ERROR) == logging.WARNING


def test_refused_handshakes_are_logged_once_a_minute_with_a_count() -> None:
    log = RefusalLog()
    assert log.line("refused", 0.0) == "refused"
    assert [log.line("refused", t) for t in (1.0, 2.0, 3.0)] == [None, None, None]
    assert (
        log.line("refused", REFUSAL_LOG_S + 1)
        == f"refused (3 more refused in the {REFUSAL_LOG_S + 1:.0f} s since the last line)"
    )


#: An MQTT 3.1.1 CONNECT, as the page sends it in its first WebSocket message.
CONNECT = bytes([0x10, 12, 0, 4]) + b"MQTT" + bytes([4, 2, 0, 30, 0, 0])


def test_a_relay_logs_in_with_a_connect_and_an_answer_in_time() -> None:
    login = Login(start=100.0)
    assert not login.connect_seen
    assert login.client_sent(CONNECT)
    assert login.connect_seen and not login.done
    login.broker_sent()  # the CONNACK
    assert login.done and login.overdue(10_000.0) is None and login.next_deadline() is None


def test_a_relay_without_connect_or_answer_is_overdue() -> None:
    login = Login(start=100.0)
    assert login.overdue(100.0 + relay.CONNECT_S - 0.01) is None
    assert "CONNECT" in (login.overdue(100.0 + relay.CONNECT_S) or "")
    login.client_sent(CONNECT)
    assert login.overdue(100.0 + relay.ANSWER_S - 0.01) is None
    assert "answer" in (login.overdue(100.0 + relay.ANSWER_S) or "")
    # a first message that is not an MQTT CONNECT (a text message, a PUBLISH, nothing) ends it at once
    assert not Login(0.0).client_sent(CONNECT, binary=False)
    assert not Login(0.0).client_sent(bytes([0x30, 0x05, 0x00, 0x01]) + b"tx")
    assert not Login(0.0).client_sent(b"")


def test_one_address_gets_a_quarter_of_the_relay_slots_unless_it_is_a_trusted_proxy() -> None:
    slots = RelaySlots(trusted=frozenset({"172.30.32.2"}))
    assert [slots.take("10.0.0.1") for _ in range(relay.MAX_RELAYS_PER_ADDRESS)] == [None] * 8
    assert slots.take("10.0.0.1") == "too many relayed connections from this address"
    assert slots.take("10.0.0.2") is None
    slots.give_back("10.0.0.1")
    assert slots.take("10.0.0.1") is None
    # the proxy takes what is left, and the relay as a whole stays bounded
    left = relay.MAX_RELAYS - slots.taken
    assert [slots.take("172.30.32.2") for _ in range(left)] == [None] * left
    assert slots.take("10.0.0.3") == "too many relayed connections"


def test_the_login_gate_asks_the_broker_and_holds_its_verdict() -> None:
    now = [0.0]
    asked: list[tuple[str, int]] = []
    answers = [True, False]

    def check(host: str, port: int) -> bool | None:
        asked.append((host, port))
        return answers.pop(0)

    gate = LoginGate(("127.0.0.1", 9001), True, check, clock=lambda: now[0])
    assert gate.may_relay() is False  # anonymous
    now[0] = relay.LOGIN_CHECK_S - 1
    assert gate.may_relay() is False and len(asked) == 1
    now[0] = relay.LOGIN_CHECK_S
    assert gate.may_relay() is True and len(asked) == 2  # the broker now asks for a login
    # a page on loopback only needs no check: nothing beyond this box reaches it
    assert LoginGate(("127.0.0.1", 9001), False, check).may_relay() is True
    assert LoginGate(("127.0.0.1", 9001), True, lambda h, p: None).may_relay() is None


def test_is_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5") and not is_loopback("nas.local")
    # a dual-stack listener on "::" sees an IPv4 client in its IPv6 spelling
    assert is_loopback("::ffff:127.0.0.1") and is_loopback("[::1]") and not is_loopback("::ffff:192.168.1.5")


def test_an_address_is_one_address_whatever_its_spelling() -> None:
    assert canonical_address("::ffff:172.30.32.2") == canonical_address("172.30.32.2") == "172.30.32.2"
    assert canonical_address("fe80::1%eth0") == canonical_address("[fe80:0::1]") == "fe80::1"
    assert canonical_address("nas.local") == "nas.local"


def test_a_trusted_proxy_seen_by_a_dual_stack_listener_keeps_its_slots() -> None:
    # Given the page on http.host "::" behind Home Assistant's ingress (172.30.32.2): the proxy's
    # connections arrive as ::ffff:172.30.32.2
    slots = RelaySlots(trusted=frozenset({"172.30.32.2"}))
    seen = "::ffff:172.30.32.2"
    # Then it is the trusted proxy, not one address over its quarter of the slots
    assert [slots.take(seen) for _ in range(relay.MAX_RELAYS_PER_ADDRESS + 4)] == [None] * 12
    # and a proxy configured in its IPv6 spelling is the same proxy
    mapped = RelaySlots(trusted=frozenset({"::ffff:172.30.32.2"}))
    assert [mapped.take("172.30.32.2") for _ in range(relay.MAX_RELAYS_PER_ADDRESS + 1)] == [None] * 9
    assert (
        ORIGINS.trusted
        and refusal("https://ha.example.org", remote=seen, x_forwarded_host="ha.example.org", x_forwarded_proto="https")
        is None
    )


def test_config_rules_warn_of_a_relay_that_will_refuse_ups_anonymous_broker() -> None:
    from pathlib import Path

    from edge_queue.config.rules import relay_warning
    from edge_queue.config.settings import Settings

    def warning(**http: object) -> str | None:
        broker = http.pop("broker", {})
        mqtt = http.pop("mqtt", {})
        return relay_warning(Settings(http={"websocket_proxy": True, **http}, broker=broker, mqtt=mqtt))

    assert warning() is not None and "takes clients without a login" in (warning() or "")
    assert warning(host="127.0.0.1") is None  # the page for this box only
    assert warning(websocket_proxy=False) is None
    assert warning(broker={"config_file": Path("/etc/edge-queue/amqtt.yaml")}) is None  # its passwords
    assert warning(broker={"embedded": "false"}) is None
    assert warning(mqtt={"host": "mosquitto"}) is None  # a broker elsewhere: up starts none
