"""How the bridge's client connects to the broker: the client made for the service's persistent
session (:func:`new_client`: acknowledgements by hand, every message handed over sent at once,
a 5 s TCP connect, the retained ``offline`` as its Last Will), the CONNECT it sends
(:func:`send_connect`: MQTT 5 Session Expiry, Receive Maximum and Maximum Packet Size; MQTT
3.1.1's ``clean_session`` false), and when it tries again after the connection ended
(:class:`Backoff`).
"""

from __future__ import annotations

import random

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edge_queue.config.settings import MqttSettings
from edge_queue.errors import BrokerUnavailable

from .paho_client import FastClient, configure_client
from .topics import OFFLINE

#: Unacknowledged QoS 1 requests the broker may send us at once (MQTT 5 Receive Maximum).
#: mosquitto 2.0.11 sends more under sustained load: a client that acknowledges as it goes
#: held 1,606 unacknowledged messages at a Receive Maximum of 100. So the inbox bounds itself.
RECEIVE_MAXIMUM = 1_000
#: Seconds between reconnect attempts: from 1, doubling, at most 4 (the retained state must be
#: back within seconds of a broker restart).
RECONNECT_MIN_S, RECONNECT_MAX_S = 1.0, 4.0


def new_client(
    client_id: str, protocol: mqtt.MQTTProtocolVersion, settings: MqttSettings, will_topic: str
) -> FastClient:
    """A client of ``client_id`` (empty: not chosen yet) speaking ``protocol``, set up by
    ``settings`` (TLS, credentials), with a retained ``offline`` on ``will_topic`` as its Last
    Will; its callbacks are the caller's to set."""
    v5 = protocol == mqtt.MQTTv5
    client = FastClient(
        CallbackAPIVersion.VERSION2,
        # (a persistent MQTT 3.1.1 session needs an id: the real one is set before connect)
        client_id=client_id or "edge-queue-unset",
        protocol=protocol,
        clean_session=None if v5 else False,
        manual_ack=True,
    )
    client.max_queued_messages_set(0)  # bounded by the outbox's WINDOW instead
    client.max_inflight_messages_set(0)  # every message handed over is sent at once
    client.connect_timeout = 5.0
    configure_client(client, settings)
    client.will_set(will_topic, OFFLINE, qos=1, retain=True)
    # packets wait for the loop's loop_write (and are joined there) instead of being sent one
    # by one as they are queued
    client.on_socket_register_write = lambda *_: None
    return client


def send_connect(
    client: mqtt.Client, settings: MqttSettings, protocol: mqtt.MQTTProtocolVersion, max_packet_bytes: int | None
) -> None:
    """Open the TCP connection (TLS included) and queue the CONNECT of a persistent session;
    the CONNACK comes through the loop. Raises :class:`BrokerUnavailable` when nothing listens
    at ``mqtt.host``:``mqtt.port`` (or the connection fails)."""
    s = settings
    try:
        if protocol == mqtt.MQTTv5:
            client.connect(
                s.host,
                s.port,
                keepalive=s.keepalive_s,
                clean_start=False,
                properties=connect_properties(settings, max_packet_bytes),
            )
        else:  # the session flag is the client's clean_session=False
            client.connect(s.host, s.port, keepalive=s.keepalive_s)
    except OSError as e:
        raise BrokerUnavailable(f"no MQTT broker at {s.host}:{s.port}: {e}") from e


def connect_properties(settings: MqttSettings, max_packet_bytes: int | None) -> Properties:
    """The MQTT 5 CONNECT properties: session expiry (``mqtt.session_expiry_s``), Receive
    Maximum (:data:`RECEIVE_MAXIMUM`), Maximum Packet Size."""
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = settings.session_expiry_s
    props.ReceiveMaximum = RECEIVE_MAXIMUM
    if max_packet_bytes:
        props.MaximumPacketSize = max_packet_bytes
    return props


class Backoff:
    """When to try connecting again (monotonic seconds): after a connection ended, once the
    delay passed; each attempt doubles the delay, with up to a quarter off at random, to
    :data:`RECONNECT_MAX_S` at most; a CONNACK sets it back to :data:`RECONNECT_MIN_S`."""

    def __init__(self) -> None:
        self.delay = RECONNECT_MIN_S  # seconds
        self.next_at = 0.0  # monotonic

    def connected(self) -> None:
        """A CONNACK: the next connection that ends is tried again after the shortest delay."""
        self.delay = RECONNECT_MIN_S

    def ended(self, now: float) -> None:
        """The connection ended at ``now``: the next attempt after :attr:`delay`."""
        self.next_at = now + self.delay

    def attempt(self, now: float) -> None:
        """An attempt starts at ``now``: the next one after :attr:`delay`, which then grows."""
        self.next_at = now + self.delay
        self.delay = min(RECONNECT_MAX_S, self.delay * 2) * (0.75 + random.random() / 4)
