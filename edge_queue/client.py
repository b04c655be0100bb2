"""A request client over MQTT, as any client would write it: the CLI's only way in.

It sends each request with an idempotency key (for ``submit``), a ``transaction`` and a
``reply_to`` topic under ``<base>/reply/``, and resends the same request until the answer
arrives, so a lost message or a service restart costs a delay, not a job (PRODUCT 4.2).
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from .bridge import configure_client, detect_protocol, set_nodelay
from .config import MqttSettings
from .errors import BrokerUnavailable
from .topics import Topics


class RequestClient:
    """Connects on construction. Raises :class:`BrokerUnavailable` when no broker answers
    within ``timeout_s`` seconds or it refuses the credentials."""

    def __init__(self, settings: MqttSettings, *, timeout_s: float = 10.0) -> None:
        self.topics = Topics(settings.base_topic)
        self.client_id = "edge-queue-cli-" + uuid.uuid4().hex[:12]
        self.reply_topic = self.topics.reply_prefix() + self.client_id
        self._replies: dict[str, queue.SimpleQueue[dict[str, Any]]] = {}
        self.messages: queue.SimpleQueue[tuple[str, bytes]] = queue.SimpleQueue()
        self._connected = threading.Event()
        self._refused: str | None = None
        protocol: str = settings.protocol
        if protocol == "auto":
            protocol = detect_protocol(settings, self.client_id, timeout_s)
        self._client = self._connect(settings, mqtt.MQTTv311 if protocol == "3.1.1" else mqtt.MQTTv5, timeout_s)
        if self._refused:
            raise BrokerUnavailable(f"broker refused the connection: {self._refused}")

    def _connect(self, s: MqttSettings, protocol: mqtt.MQTTProtocolVersion, timeout_s: float) -> mqtt.Client:
        self._connected.clear()
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=self.client_id, protocol=protocol)
        configure_client(c, s)
        c.on_connect = self._on_connect
        c.on_message = self._on_message
        try:
            c.connect(s.host, s.port, keepalive=30)
        except OSError as e:
            raise BrokerUnavailable(f"no MQTT broker at {s.host}:{s.port}: {e}") from e
        c.loop_start()
        if not self._connected.wait(timeout_s):
            c.loop_stop()
            raise BrokerUnavailable(f"no answer from the MQTT broker at {s.host}:{s.port}")
        return c

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            self._refused = str(reason)
        else:
            set_nodelay(client)
            client.subscribe(self.reply_topic, 1)
        self._connected.set()

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        if msg.topic == self.reply_topic:
            try:
                body = json.loads(msg.payload)
                key = json.dumps(body.get("transaction"))
            except (ValueError, AttributeError):
                return
            if key in self._replies:
                self._replies[key].put(body)
        else:
            self.messages.put((msg.topic, bytes(msg.payload)))

    def subscribe(self, topic: str) -> None:
        self._client.subscribe(topic, 1)

    def request(
        self, command: str, body: dict[str, Any] | None = None, *, timeout_s: float = 30.0, resend_s: float = 3.0
    ) -> dict[str, Any]:
        """Send ``command`` and return its response; resend every ``resend_s`` seconds.

        Raises ``TimeoutError`` when no response arrives in ``timeout_s`` seconds.
        """
        body = dict(body or {})
        transaction = uuid.uuid4().hex
        body.update(transaction=transaction, reply_to=self.reply_topic)
        if command == "submit":
            body.setdefault("idempotency_key", uuid.uuid4().hex)
        key = json.dumps(transaction)
        box: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._replies[key] = box
        payload = json.dumps(body)
        end = time.monotonic() + timeout_s
        try:
            while time.monotonic() < end:
                self._client.publish(self.topics.request(command), payload, qos=1)
                try:
                    return box.get(timeout=min(resend_s, max(0.0, end - time.monotonic())))
                except queue.Empty:
                    continue
        finally:
            self._replies.pop(key, None)
        raise TimeoutError(f"no response to {command} within {timeout_s:.0f} s: is edge-queue running?")

    def job_updates(self, timeout_s: float) -> Iterator[tuple[str, dict[str, Any] | None]]:
        """``(job_id, job object or None when cleared)`` for messages on subscribed job topics."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                topic, raw = self.messages.get(timeout=0.2)
            except queue.Empty:
                yield "", None
                continue
            job_id = self.topics.parse_job(topic)
            if job_id:
                yield job_id, json.loads(raw) if raw else None

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()
