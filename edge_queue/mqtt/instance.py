"""One edge-queue per base topic (docs/operations.md, "Several boxes on one broker").

Before it serves, the service reads the retained ``<base>/status`` and ``<base>/info``. Another
installation (another ``instance_id``) that is ``online`` there means two services would take
the same requests and clear each other's job state: the service does not start
(:class:`BaseTopicInUse`, exit code 5, which systemd does not restart). One that is
``offline`` (a replaced ``data_dir``, a moved install) is taken over.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from edge_queue.config.settings import MqttSettings
from edge_queue.errors import BrokerUnavailable, EdgeQueueError

from .grants import check_base_topic_granted
from .paho_client import configure_client
from .probe import PROBE_S, wait_notice_due, waiting_line, warn_closed_without_answer
from .topics import ONLINE, Topics

log = logging.getLogger(__name__)

#: Seconds to wait for the retained status and info after the subscription is acknowledged
#: (a broker sends retained messages right after the SUBACK).
RETAINED_WAIT_S = 0.3


class BaseTopicInUse(EdgeQueueError):
    """Another installation is online on this base topic."""


def describe(info: dict[str, Any]) -> str:
    """``instance 3f9a0c1b2d4e on nas (edge-queue 0.1.0)`` from an ``<base>/info`` payload."""
    return (
        f"instance {info.get('instance_id') or '(unknown: an edge-queue before 0.2)'} on "
        f"{info.get('host') or 'an unknown host'} (edge-queue {info.get('version') or '?'})"
    )


def read_status_and_info(settings: MqttSettings, topics: Topics, client_id: str) -> tuple[str | None, dict[str, Any]]:
    """The retained ``<base>/status`` and ``<base>/info`` (``(None, {})`` when unset), read on a
    short clean-session MQTT 3.1.1 connection of its own (``<client_id>-check-<hex>``).
    Raises :class:`BrokerUnavailable` when the broker cannot be reached or refuses us."""
    found: dict[str, Any] = {}
    subscribed, both, answered = threading.Event(), threading.Event(), threading.Event()
    connected: dict[str, Any] = {}

    def on_connect(c: mqtt.Client, u: Any, flags: Any, reason: Any, props: Any) -> None:
        connected["reason"] = reason
        answered.set()
        if not reason.is_failure:
            c.subscribe([(topics.status, 0), (topics.info, 0)])

    def on_message(c: mqtt.Client, u: Any, m: mqtt.MQTTMessage) -> None:
        if m.retain and m.payload:
            found[m.topic] = bytes(m.payload)
            if len(found) == 2:
                both.set()

    client = mqtt.Client(
        CallbackAPIVersion.VERSION2, client_id=f"{client_id}-check-{secrets.token_hex(3)}", protocol=mqtt.MQTTv311
    )
    configure_client(client, settings)
    client.on_connect, client.on_message = on_connect, on_message
    client.on_subscribe = lambda *a: subscribed.set()
    closed = threading.Event()

    def on_disconnect(*_: Any) -> None:
        closed.set()
        answered.set()

    client.on_disconnect = on_disconnect
    try:
        client.connect(settings.host, settings.port, keepalive=30)
    except OSError as e:
        raise BrokerUnavailable(f"no MQTT broker at {settings.host}:{settings.port}: {e}") from e
    client.loop_start()
    try:
        answered.wait(PROBE_S)
        if closed.is_set() and "reason" not in connected:
            # accepted, then closed: a forwarder before a broker that is not up yet; try again
            raise BrokerUnavailable(f"{settings.host}:{settings.port} closed the connection without an MQTT answer")
        if "reason" not in connected:
            raise BrokerUnavailable(
                f"{settings.host}:{settings.port} accepted a TCP connection but answered no MQTT CONNECT "
                f"within {PROBE_S:.0f} s: is it an MQTT broker? Check mqtt.host and mqtt.port"
            )
        if not subscribed.wait(10):
            reason = connected.get("reason")
            raise BrokerUnavailable(
                f"the broker at {settings.host}:{settings.port} refused us: {reason}"
                if reason is not None and reason.is_failure
                else f"no answer from the MQTT broker at {settings.host}:{settings.port}"
            )
        both.wait(RETAINED_WAIT_S)  # at once when both are set; else what came in that time
    finally:
        client.disconnect()
        client.loop_stop()
    status = found.get(topics.status, b"").decode(errors="replace") or None
    try:
        info = json.loads(found.get(topics.info, b"{}"))
    except (ValueError, RecursionError):
        info = {}
    return status, info if isinstance(info, dict) else {}


def claim_base_topic(
    settings: MqttSettings, topics: Topics, instance_id: str, client_id: str, timeout_s: float = 30.0
) -> dict[str, Any] | None:
    """Check that no other installation is online on the base topic before serving, waiting up
    to ``timeout_s`` seconds for a broker that is still starting (boot order), saying at the
    first failed attempt, then every :data:`~edge_queue.mqtt.probe.WAIT_NOTICE_EVERY_S`
    seconds, which broker it waits for (:func:`~edge_queue.mqtt.probe.waiting_line`).

    Returns the ``info`` of an offline installation being taken over (logged), or None.
    Raises :class:`BaseTopicInUse` naming the other installation and what to change,
    :class:`~edge_queue.mqtt.grants.BaseTopicRefused` when the broker's ACL does not grant us
    the base topic (:func:`~edge_queue.mqtt.grants.check_base_topic_granted`), and
    :class:`BrokerUnavailable` when no broker answered in time."""
    deadline = time.monotonic() + timeout_s
    said = False
    said_at: float | None = None  # when we last said which broker we wait for
    while True:
        try:
            status, info = read_status_and_info(settings, topics, client_id)
            break
        except BrokerUnavailable as e:
            if "refused us" in e.message or "accepted a TCP" in e.message or time.monotonic() >= deadline:
                raise
            now = time.monotonic()
            if "closed the connection" in e.message and not said:
                warn_closed_without_answer(settings, deadline)
                said, said_at = True, now
            elif wait_notice_due(said_at, now):
                log.warning(waiting_line(settings, failure_reason(e), deadline - now))
                said_at = now
            time.sleep(1.0)
    check_base_topic_granted(settings, topics, client_id)  # the broker answers: does its ACL grant us?
    other = info.get("instance_id")
    if other == instance_id:
        return None  # our own state from a previous run (a crash leaves "online" until the Will)
    if status == ONLINE and info:
        raise BaseTopicInUse(
            f"another edge-queue is online on the base topic {topics.base!r}: {describe(info)}. Two services on "
            "one base topic take the same requests and clear each other's job state, so this one does not start: "
            "give each box its own mqtt.base_topic (for example edge-queue/<box>), or stop the other one"
        )
    if info:
        log.warning(
            "taking over the base topic %s from %s, which is offline (a replaced data_dir or a moved install); "
            "retained job and batch topics this store does not know will be cleared",
            topics.base,
            describe(info),
        )
        return info
    return None


def failure_reason(e: BrokerUnavailable) -> str:
    """Why an attempt to reach the broker failed, without the address the line already names:
    the socket's error (``[Errno 111] Connection refused``), else the message."""
    return str(e.__cause__) if isinstance(e.__cause__, OSError) else e.message


def clear_command(settings: MqttSettings, base: str) -> str:
    """The ``mosquitto_sub`` command line that clears every retained topic under ``base``."""
    login = f" -u {settings.username} -P '<password>'" if settings.username else ""
    return f"mosquitto_sub -h {settings.host} -p {settings.port}{login} -t '{base}/#' --remove-retained -W 3"


def note_base_topic(store: Any, settings: MqttSettings, topics: Topics) -> str | None:
    """Keep the base topic this store serves on (``store_meta``). When it was another one, the
    broker still holds that base's retained topics (job states, ``status``, ``info``): said
    once at start, with the command that clears them, and kept as ``old_base_topic`` for
    ``doctor``. Returns the old base topic, or None."""
    old = store.meta_text("base_topic")
    if old == topics.base:
        return None
    store.set_meta_text("base_topic", topics.base)
    if old is None:
        return None
    store.set_meta_text("old_base_topic", old)
    log.warning(
        "mqtt.base_topic changed from %s to %s: the broker still holds the retained topics of %s/ "
        "(its job states, status and info); clear them with: %s",
        old,
        topics.base,
        old,
        clear_command(settings, old),
    )
    return old
