"""Whether the broker lets us use the base topic: read its requests and publish under it
(docs/operations.md, "The broker refuses edge-queue, or "not authorized"").

A broker's ACL that does not grant ``mqtt.base_topic`` to our user does not refuse the
connection: it refuses each subscription (SUBACK reason code 0x80 in MQTT 3.1.1, 0x87 "Not
authorized" in MQTT 5) and each publish (a PUBACK with reason code 0x87 in MQTT 5; mosquitto
2.0 closes an MQTT 5 connection instead, and drops an MQTT 3.1.1 publish silently, with a
success PUBACK). So the check is a round trip: on a short clean-session connection of its own,
subscribe to ``<base>/request/#`` and to a probe topic ``<base>/probe/<hex>``, publish one
non-retained QoS 1 message there, and wait until it comes back.
"""

from __future__ import annotations

import secrets
import threading
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from edge_queue.config.settings import MqttSettings
from edge_queue.errors import ConfigError

from .paho_client import configure_client
from .topics import Topics

#: Seconds the probe message gets to come back; a broker delivers it in milliseconds.
ROUND_TRIP_S = 5.0


class BaseTopicRefused(ConfigError):
    """The broker does not let our user read requests or publish under the base topic: a
    configuration problem of the broker's ACL or of ``mqtt.base_topic`` (exit code 2)."""


def base_topic_refusal(
    settings: MqttSettings,
    topics: Topics,
    client_id: str,
    protocol: mqtt.MQTTProtocolVersion = mqtt.MQTTv311,
    timeout_s: float = ROUND_TRIP_S,
) -> str | None:
    """Why the broker refuses us the base topic, as one sentence naming the topic, the user and
    the broker's answer; None when a probe message published under it came back within
    ``timeout_s`` seconds. ``client_id`` gets ``-grant-<hex>`` appended (a connection of its
    own, clean session). Raises nothing: a broker that cannot be reached or refuses the
    connection is a sentence too."""
    probe_topic = f"{topics.base}/probe/{secrets.token_hex(6)}"
    who = f"user {settings.username!r}" if settings.username else "anonymous clients"
    seen: dict[str, Any] = {}
    done = threading.Event()

    def finish(key: str, value: Any) -> None:
        seen.setdefault(key, value)
        done.set()

    def on_connect(c: mqtt.Client, u: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            finish("connect", reason)
        else:
            c.subscribe([(topics.requests, 1), (probe_topic, 1)])

    def on_subscribe(c: mqtt.Client, u: Any, mid: int, codes: list[Any], props: Any) -> None:
        refused = [(t, code) for t, code in zip((topics.requests, probe_topic), codes, strict=False) if code.is_failure]
        if refused:
            finish("subscribe", refused)
        else:
            seen["published"] = True
            c.publish(probe_topic, b"probe", qos=1)

    def on_publish(c: mqtt.Client, u: Any, mid: int, reason: Any, props: Any) -> None:
        if reason.is_failure:
            finish("publish", reason)

    def on_message(c: mqtt.Client, u: Any, m: mqtt.MQTTMessage) -> None:
        if m.topic == probe_topic:
            finish("ok", True)

    client = mqtt.Client(
        CallbackAPIVersion.VERSION2, client_id=f"{client_id}-grant-{secrets.token_hex(3)}", protocol=protocol
    )
    configure_client(client, settings)
    client.on_connect, client.on_subscribe, client.on_publish = on_connect, on_subscribe, on_publish
    client.on_message = on_message
    client.on_disconnect = lambda *a: finish("closed", "published" in seen)
    try:
        client.connect(settings.host, settings.port, keepalive=30)
    except OSError as e:
        return f"cannot check the base topic: no MQTT broker at {settings.host}:{settings.port}: {e}"
    client.loop_start()
    try:
        done.wait(timeout_s)
    finally:
        client.disconnect()
        client.loop_stop()
    return refusal_sentence(seen, topics.base, probe_topic, who, timeout_s)


def check_base_topic_granted(settings: MqttSettings, topics: Topics, client_id: str) -> None:
    """Before the service serves: raise :class:`BaseTopicRefused` with the sentence of
    :func:`base_topic_refusal` (MQTT 3.1.1's round trip) when the broker refuses us the base
    topic. Without it, an ACL that refuses our publishes (mosquitto 2.0 closes the connection at
    each) made the service reconnect forever, taking each short connection for a take-over."""
    refused = base_topic_refusal(settings, topics, client_id)
    if refused is not None:
        raise BaseTopicRefused(refused)


def refusal_sentence(seen: dict[str, Any], base: str, probe_topic: str, who: str, timeout_s: float) -> str | None:
    """The sentence for what the round trip saw (the first of ``connect``, ``subscribe``,
    ``publish``, ``closed``: True after our publish, or ``ok``); None for ``ok``. Plain data:
    tested without a broker."""
    fix = f"grant {who} readwrite {base}/# in the broker's ACL, or set mqtt.base_topic to a topic it grants"
    if "ok" in seen:
        return None
    if "connect" in seen:
        return f"the broker refused the connection: {seen['connect']}"
    if "subscribe" in seen:
        which = ", ".join(f"{t} ({code})" for t, code in seen["subscribe"])
        return f"the broker refused {who} the subscription to {which}: {fix}"
    if "publish" in seen:
        return f"the broker refused {who} a publish on {probe_topic} ({seen['publish']}): {fix}"
    if "closed" in seen and not seen["closed"]:
        return "the broker closed the connection before we could subscribe (an ACL or a connection limit?)"
    if "closed" in seen:
        return f"the broker closed the connection when {who} published on {probe_topic} (not authorized?): {fix}"
    return (
        f"a message {who} published on {probe_topic} did not come back within {timeout_s:.0f} s: the broker "
        f"drops what {who} publishes there (an ACL denies it silently in MQTT 3.1.1): {fix}"
    )
