"""A request client over MQTT, as any client would write it: the CLI's only way in.

It sends each request with an idempotency key (for ``submit``), a ``transaction`` and a
``reply_to`` topic under ``<base>/reply/``, and resends the same request until the answer
arrives, so a lost message or a service restart costs a delay, not a job (docs/topics.md,
"Requests delivered twice").
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

from edge_queue.config.settings import MqttSettings
from edge_queue.errors import BrokerUnavailable, EdgeQueueError

from .paho_client import QuickAckClient, configure_client, set_nodelay
from .probe import detect_protocol
from .topics import OFFLINE, ONLINE, Topics, valid_topic_level

#: Requests that change nothing: not sent while edge-queue is offline.
READ_ONLY = frozenset({"get", "list", "kinds", "events", "browse"})
#: Seconds to wait for the retained ``<base>/status`` after subscribing (a broker sends it at once).
STATUS_WAIT_S = 1.0
#: A request gives up when the connection to the broker has been lost this long (seconds).
BROKER_LOST_S = 5.0
#: MQTT 5 PUBACK reason code 16: the broker had no subscriber for the message, nor a session
#: that would take it later (MQTT 5.0, 3.4.2.1).
NO_MATCHING_SUBSCRIBERS = 16


class ServiceOffline(EdgeQueueError):
    """edge-queue is not online on the base topic (``<base>/status`` is ``offline`` or unset).

    Attributes:
        held: True when the broker took the request for edge-queue's persistent session (it
            runs when edge-queue comes back), False when the broker said nobody would get it
            (MQTT 5 "no matching subscribers"), None when the broker cannot tell (MQTT 3.1.1).
    """

    def __init__(self, message: str, held: bool | None) -> None:
        super().__init__(message)
        self.held = held


class RequestClient:
    """Connects on construction. Raises :class:`BrokerUnavailable` when no broker answers
    within ``timeout_s`` seconds or it refuses the credentials."""

    def __init__(self, settings: MqttSettings, *, timeout_s: float = 10.0) -> None:
        self.topics = Topics(settings.base_topic)
        self.client_id = "eq-cli-" + uuid.uuid4().hex[:12]
        #: with a broker user name, requests go on that user's own request topics and answers
        #: come under its own reply topics (docs/topics.md, "Who sent a request")
        self.user = settings.username if settings.username and valid_topic_level(settings.username) else None
        if self.user is None:
            self.reply_topic = self.topics.reply_prefix() + self.client_id
        else:
            self.reply_topic = self.topics.user_reply_prefix(self.user) + self.client_id
        self._replies: dict[str, queue.SimpleQueue[dict[str, Any]]] = {}
        self._status: str | None = None
        self._status_seen = threading.Event()
        self._puback: dict[int, int] = {}  # message id -> PUBACK reason code
        self._puback_seen = threading.Condition()
        self.messages: queue.SimpleQueue[tuple[str, bytes]] = queue.SimpleQueue()
        #: whether the queue is paused, from <base>/queue (read by job_updates once subscribed)
        self.queue_paused = False
        self._connected = threading.Event()
        self._refused: str | None = None
        self._extra: list[str] = []  # topics of subscribe(), subscribed again at every connect
        self._where = f"{settings.host}:{settings.port}"
        self._lost_at: float | None = None  # when the connection to the broker was lost, until it is back
        protocol: str = settings.protocol
        if protocol == "auto":
            protocol = detect_protocol(settings, self.client_id, timeout_s, wait_refused=False)
        self._client = self._connect(settings, mqtt.MQTTv311 if protocol == "3.1.1" else mqtt.MQTTv5, timeout_s)
        if self._refused:
            raise BrokerUnavailable(f"broker refused the connection: {self._refused}")

    def _connect(self, s: MqttSettings, protocol: mqtt.MQTTProtocolVersion, timeout_s: float) -> mqtt.Client:
        self._connected.clear()
        c = QuickAckClient(CallbackAPIVersion.VERSION2, client_id=self.client_id, protocol=protocol)
        configure_client(c, s)
        c.on_connect = self._on_connect
        c.on_disconnect = self._on_disconnect
        c.on_message = self._on_message
        c.on_publish = self._on_publish
        try:
            c.connect(s.host, s.port, keepalive=30)
        except OSError as e:
            raise BrokerUnavailable(f"no MQTT broker at {s.host}:{s.port}: {e}") from e
        c.loop_start()
        if not self._connected.wait(timeout_s):
            c.loop_stop()
            raise BrokerUnavailable(f"no answer from the MQTT broker at {s.host}:{s.port}")
        return c

    def _on_disconnect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if self._lost_at is None:
            self._lost_at = time.monotonic()

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if not reason.is_failure:
            self._lost_at = None
        if reason.is_failure:
            self._refused = str(reason)
        else:
            set_nodelay(client)
            # again after every reconnect: a broker restarted without persistence forgot them
            client.subscribe([(self.reply_topic, 1), (self.topics.status, 1), *((t, 1) for t in self._extra)])
        self._connected.set()

    def _on_publish(self, client: mqtt.Client, userdata: Any, mid: int, reason: Any, props: Any) -> None:
        with self._puback_seen:
            self._puback[mid] = int(getattr(reason, "value", 0) or 0)
            self._puback_seen.notify_all()

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        if msg.topic == self.topics.status:
            self._status = msg.payload.decode(errors="replace")
            self._status_seen.set()
            return
        if msg.topic == self.reply_topic:
            try:
                body = json.loads(msg.payload)
                key = json.dumps(body.get("transaction"))
            except (ValueError, AttributeError, RecursionError):
                return
            if key in self._replies:
                self._replies[key].put(body)
        else:
            self.messages.put((msg.topic, bytes(msg.payload)))

    def request_topic(self, command: str) -> str:
        """``<base>/request/<command>/<user>`` with a user name, else ``<base>/request/<command>``."""
        topic = self.topics.request(command)
        return topic if self.user is None else f"{topic}/{self.user}"

    def subscribe(self, topic: str) -> None:
        """Subscribe to ``topic`` at QoS 1, now and after every reconnect."""
        self._extra.append(topic)
        self._client.subscribe(topic, 1)

    def status(self, wait_s: float = STATUS_WAIT_S) -> str | None:
        """The retained ``<base>/status`` (``online``, ``offline``), or None when none is set."""
        self._status_seen.wait(wait_s)
        return self._status

    def _offline(self, command: str, payload: str) -> ServiceOffline:
        """Publish the request once while edge-queue is offline and say what became of it, from
        the broker's PUBACK (MQTT 5 reason code 16: nobody, not even a stored session, takes it).
        A request that only reads (``get``, ``list``, ``kinds``, ``events``) is not sent: its
        answer would come when nobody waits for it."""
        state = "offline" if self._status == OFFLINE else "not running (no status on the broker)"
        if command in READ_ONLY:
            return ServiceOffline(
                f"edge-queue is {state} ({self.topics.status}), and {command} needs it running; the retained job "
                f"states on {self.topics.all_jobs} show where each job stood when it stopped",
                False,
            )
        info = self._client.publish(self.request_topic(command), payload, qos=1)
        with self._puback_seen:
            self._puback_seen.wait_for(lambda: info.mid in self._puback, timeout=5.0)
            reason = self._puback.pop(info.mid, None)
        where = self.topics.status
        if reason is None:
            return ServiceOffline(f"edge-queue is {state} ({where}); the broker did not acknowledge the request", None)
        if reason == NO_MATCHING_SUBSCRIBERS:
            return ServiceOffline(
                f"edge-queue is {state} ({where}) and the broker keeps no session for it: the request was "
                "not kept; start edge-queue and send it again",
                False,
            )
        if self._client.protocol != mqtt.MQTTv5:
            return ServiceOffline(
                f"edge-queue is {state} ({where}); the request was sent, and runs when edge-queue comes back "
                "if the broker keeps its session (this broker does not say)",
                None,
            )
        return ServiceOffline(
            f"edge-queue is {state} ({where}); the broker holds the request for it: it runs when edge-queue "
            "comes back (its response will not reach this command)",
            True,
        )

    def request(
        self,
        command: str,
        body: dict[str, Any] | None = None,
        *,
        timeout_s: float = 30.0,
        resend_s: float = 3.0,
        when_offline: bool = False,
    ) -> dict[str, Any]:
        """Send ``command`` and return its response; resend every ``resend_s`` seconds.

        Unless ``when_offline``, the retained ``<base>/status`` is read first: when it is not
        ``online`` the request is published once and :class:`ServiceOffline` is raised at once,
        saying whether the broker holds it for edge-queue. Raises ``TimeoutError`` when no
        response arrives in ``timeout_s`` seconds although edge-queue is online.
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
        if not when_offline and self.status() != ONLINE:
            raise self._offline(command, payload)
        end = time.monotonic() + timeout_s
        try:
            while time.monotonic() < end:
                lost = self._lost_at
                if lost is not None and time.monotonic() - lost >= BROKER_LOST_S:
                    raise TimeoutError(
                        f"lost the connection to the MQTT broker at {self._where} while waiting for the answer to "
                        f"{command}, and it has not come back for {BROKER_LOST_S:.0f} s: is the broker running?"
                    )
                self._client.publish(self.request_topic(command), payload, qos=1)
                try:
                    return box.get(timeout=min(resend_s, max(0.0, end - time.monotonic())))
                except queue.Empty:
                    continue
        finally:
            self._replies.pop(key, None)
        if self._lost_at is not None:
            raise TimeoutError(
                f"no response to {command} within {timeout_s:.0f} s: the connection to the MQTT broker at "
                f"{self._where} was lost"
            )
        raise TimeoutError(
            f"no response to {command} within {timeout_s:.0f} s although edge-queue is {self._status or 'unknown'} "
            f"on {self.topics.status}: see its log"
        )

    def job_updates(self, timeout_s: float) -> Iterator[tuple[str, dict[str, Any] | None]]:
        """``(job_id, job object or None when cleared)`` for messages on subscribed job topics;
        a message on ``<base>/queue`` (when subscribed) sets :attr:`queue_paused`."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                topic, raw = self.messages.get(timeout=0.2)
            except queue.Empty:
                yield "", None
                continue
            if topic == self.topics.queue:  # subscribed by a caller that shows whether it is paused
                try:
                    self.queue_paused = bool(json.loads(raw).get("paused"))
                except (ValueError, AttributeError, RecursionError):
                    pass
                yield "", None
                continue
            job_id = self.topics.parse_job(topic)
            if job_id:
                try:
                    state = json.loads(raw) if raw else None
                except (ValueError, RecursionError):  # not a job state edge-queue wrote: skipped
                    continue
                yield job_id, state

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()
