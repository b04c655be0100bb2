"""Finding out what listens at ``mqtt.host:port`` before connecting for real: MQTT 5, MQTT
3.1.1, or something that is not an MQTT broker (docs/cli.md, exit code 3); and whether the
broker's WebSocket listener takes clients without a login (the page's relay, `doctor`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from edge_queue.config.settings import MqttSettings
from edge_queue.errors import BrokerUnavailable

from .paho_client import configure_client

log = logging.getLogger(__name__)

#: Seconds a broker gets to answer a probe CONNECT (one for MQTT 5, one for 3.1.1); a broker
#: answers within milliseconds, so a port that answers neither is not an MQTT broker.
PROBE_S = 3.0


def probe_once(
    s: MqttSettings, client_id: str, protocol: mqtt.MQTTProtocolVersion, timeout_s: float, closed: list[bool]
) -> str | None:
    """Connect once without a Last Will; the CONNACK reason, or None when none came (then
    ``closed`` gets True when the other end closed the connection, False when it said nothing)."""
    answer: dict[str, str] = {}
    done = threading.Event()

    def on_connect(client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        answer["reason"] = str(reason)
        done.set()

    probe = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"{client_id}-probe", protocol=protocol)
    configure_client(probe, s)
    probe.on_connect = on_connect
    probe.on_disconnect = lambda *a: done.set()
    probe.connect_timeout = max(0.5, min(timeout_s, 5.0))
    try:
        probe.connect(s.host, s.port, keepalive=s.keepalive_s)
    except OSError as e:
        raise BrokerUnavailable(f"no MQTT broker at {s.host}:{s.port}: {e}") from e
    probe.loop_start()
    try:
        ended = done.wait(timeout_s)
    finally:
        probe.disconnect()
        probe.loop_stop()
    if "reason" not in answer:
        closed.append(ended)
    return answer.get("reason")


#: Seconds between two lines saying which broker ``serve`` waits for at start (the first is
#: said at the first failed attempt).
WAIT_NOTICE_EVERY_S = 10.0


def broker_address(s: MqttSettings) -> str:
    """``host:port`` and how we speak to it: ``127.0.0.1:1883 (plain TCP, no TLS)`` or
    ``broker.lan:8883 (TLS)``, as the lines about the broker name it."""
    return f"{s.host}:{s.port} ({'TLS' if s.tls.enabled else 'plain TCP, no TLS'})"


def wait_notice_due(said_at: float | None, now: float, every_s: float = WAIT_NOTICE_EVERY_S) -> bool:
    """Whether the line about the broker we wait for is due: at the first failed attempt
    (``said_at`` None), then once every ``every_s`` seconds."""
    return said_at is None or now - said_at >= every_s


def waiting_line(s: MqttSettings, reason: str, left_s: float) -> str:
    """The line said while ``serve`` waits at start for the broker of ``mqtt.host``,
    ``mqtt.port`` and ``mqtt.tls.enabled``, with why the last attempt failed."""
    return (
        f"waiting for the MQTT broker at {broker_address(s)}: {reason}; trying again every second, "
        f"for {max(0.0, left_s):.0f} s more (mqtt.host, mqtt.port, mqtt.tls.enabled)"
    )


def warn_closed_without_answer(s: MqttSettings, deadline: float) -> None:
    """The one line said while waiting on a port that accepts connections and closes them
    without an MQTT answer (a forwarder before a broker not up yet, or not MQTT at all)."""
    log.warning(
        "%s:%s accepts connections but closes them without an MQTT answer: waiting up to %.0f s "
        "for a broker there (is mqtt.port an MQTT broker?)",
        s.host,
        s.port,
        max(0.0, deadline - time.monotonic()),
    )


def detect_protocol(s: MqttSettings, client_id: str, timeout_s: float, *, wait_refused: bool = True) -> str:
    """``"5"`` or ``"3.1.1"``: what the broker at ``mqtt.host:port`` speaks.

    Tries an MQTT 5 CONNECT without a Last Will. amqtt 0.12 answers it with "Unsupported
    protocol version", or, when the CONNECT carries credentials or a Will it cannot parse,
    closes the connection without a CONNACK; then MQTT 3.1.1 is tried. Raises
    :class:`BrokerUnavailable` when neither gets an answer within ``timeout_s`` seconds, and at
    once for a refused connection when ``wait_refused`` is False (the command line: nothing
    listens there, and a person waits).
    Runs once, before the service serves (its probe clients use their own short-lived thread).
    """
    deadline = time.monotonic() + timeout_s
    last: BrokerUnavailable | None = None
    said = False
    while time.monotonic() < deadline:  # the broker may still be starting (boot order)
        try:
            closed: list[bool] = []
            wait = min(PROBE_S, max(deadline - time.monotonic(), 0.5))
            reason = probe_once(s, client_id, mqtt.MQTTv5, wait, closed)
            if reason is not None and reason != "Unsupported protocol version":
                return "5"
            if probe_once(s, client_id, mqtt.MQTTv311, wait, closed) is not None:
                return "3.1.1"
            if closed and all(closed):
                # Accepted, then closed without an answer: a TCP forwarder (docker-proxy, an
                # SSH tunnel) before a broker that is not up yet, or a service that is not MQTT.
                if not said:
                    warn_closed_without_answer(s, deadline)
                    said = True
                last = BrokerUnavailable(
                    f"{s.host}:{s.port} accepted TCP connections but closed them without an MQTT answer for "
                    f"{timeout_s:.0f} s: is it an MQTT broker? Check mqtt.host and mqtt.port"
                )
                time.sleep(min(1.0, max(deadline - time.monotonic(), 0)))
                continue
            # Something listens there but says nothing: waiting will not change that.
            raise BrokerUnavailable(
                f"{s.host}:{s.port} accepted a TCP connection but answered no MQTT CONNECT "
                f"(MQTT 5 nor 3.1.1, {PROBE_S:.0f} s each): is it an MQTT broker? Check mqtt.host and mqtt.port "
                "(a broker that is stopped or hung, such as a paused process, answers the same)"
            )
        except BrokerUnavailable as e:
            if "accepted a TCP connection" in e.message:
                raise
            if not wait_refused and isinstance(e.__cause__, ConnectionRefusedError):
                raise
            last = e
            time.sleep(min(1.0, max(deadline - time.monotonic(), 0)))
    raise last or BrokerUnavailable(f"no MQTT broker answered at {s.host}:{s.port} within {timeout_s} s")


def anonymous_over_websocket(host: str, port: int, timeout_s: float = 3.0) -> bool | None:
    """Whether the broker's MQTT over WebSocket listener at ``host:port`` takes a client without
    a login: True when it accepts an MQTT 3.1.1 CONNECT with no user name, or one with a made-up
    user name and password (amqtt's ``AnonymousAuthPlugin`` with ``allow-anonymous: false``
    and no password file takes any user name); False when it refuses both; None when nothing
    answers within ``timeout_s`` seconds (no listener, or no broker there). The client ids
    (``login-check-<random>``) are no one's."""
    accepted = _websocket_connack(host, port, None, timeout_s)
    if accepted is False:
        made_up = f"login-check-{uuid.uuid4().hex[:12]}"
        accepted = _websocket_connack(host, port, (made_up, uuid.uuid4().hex), timeout_s)
    return accepted


def _websocket_connack(host: str, port: int, login: tuple[str, str] | None, timeout_s: float) -> bool | None:
    """One CONNECT on the WebSocket listener at ``host:port``: True accepted, False refused,
    None no answer."""
    answer: dict[str, bool] = {}
    done = threading.Event()

    def on_connect(client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        answer["accepted"] = not reason.is_failure
        done.set()

    check = mqtt.Client(
        CallbackAPIVersion.VERSION2,
        client_id=f"login-check-{uuid.uuid4().hex[:12]}",
        protocol=mqtt.MQTTv311,
        transport="websockets",
    )
    check.ws_set_options(path="/")
    if login is not None:
        check.username_pw_set(*login)
    check.on_connect = on_connect
    check.on_disconnect = lambda *a: done.set()
    check.connect_timeout = timeout_s
    try:
        check.connect(host, port, keepalive=30)
    except (OSError, ValueError):
        return None
    check.loop_start()
    try:
        done.wait(timeout_s)
    finally:
        check.disconnect()
        check.loop_stop()
    return answer.get("accepted")
