"""The private names of libraries that edge-queue relies on are still there, with the shape the
code assumes (edge_queue/mqtt/paho_client.py PAHO_PRIVATE, edge_queue/mqtt/embedded_broker.py
AMQTT_PRIVATE, the standard library's ``logging._srcfile``). A new paho-mqtt or amqtt release
that drops or reshapes one fails here, naming it, instead of at run time in the service."""

from __future__ import annotations

import inspect
import logging
from importlib.metadata import version
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from edge_queue.mqtt.embedded_broker import AMQTT_PRIVATE, AMQTT_VERSION
from edge_queue.mqtt.paho_client import PAHO_PRIVATE, PAHO_VERSION

#: what the overrides assume of paho's private methods: name -> their parameters
PAHO_SIGNATURES = {
    "_packet_read": ["self"],
    "_packet_handle": ["self"],
    "_sock_recv": ["self", "bufsize"],
    "_sock_send": ["self", "buf"],
    "_sock_close": ["self"],
    "_packet_queue": ["self", "command", "packet", "mid", "qos", "info"],
    "_handle_publish": ["self"],
    "_handle_on_message": ["self", "message"],
    "_handle_pubackcomp": ["self", "cmd"],
    "_send_puback": ["self", "mid"],
    "_mid_generate": ["self"],
    "_loop_rc_handle": ["self", "rc"],
}
#: the keys of paho's ``_in_packet`` that FastClient._packet_read fills
IN_PACKET_KEYS = {"command", "have_remaining", "remaining_count", "remaining_mult", "remaining_length", "packet",
                  "to_process", "pos"}  # fmt: skip


def missing_names(owners: dict[str, Any], names: dict[str, str]) -> list[str]:
    """The ``Owner._name`` entries of ``names`` that ``owners[Owner]`` (a class, or an instance
    for attributes set in ``__init__``) does not have."""
    gone = []
    for dotted in names:
        owner, _, attr = dotted.partition(".")
        if not any(hasattr(o, attr) for o in owners[owner]):
            gone.append(dotted)
    return gone


def paho_owners() -> dict[str, Any]:
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="private-names-check")
    return {
        "Client": [mqtt.Client, client],
        "MQTTMessage": [mqtt.MQTTMessage, mqtt.MQTTMessage()],
        "MQTTMessageInfo": [mqtt.MQTTMessageInfo, mqtt.MQTTMessageInfo(1)],
    }


def test_paho_is_the_pinned_version() -> None:
    assert version("paho-mqtt") == PAHO_VERSION, (
        f"paho-mqtt {version('paho-mqtt')} is installed; edge_queue/mqtt/paho_client.py is written against "
        f"paho-mqtt=={PAHO_VERSION} (pyproject.toml): check PAHO_PRIVATE against the new release, then move the pin"
    )


def test_paho_still_has_every_private_name_the_client_uses() -> None:
    gone = missing_names(paho_owners(), PAHO_PRIVATE)
    assert gone == [], (
        f"paho-mqtt {version('paho-mqtt')} no longer has {', '.join(gone)}, which edge_queue/mqtt/paho_client.py "
        f"overrides or uses; edge-queue is tested with paho-mqtt=={PAHO_VERSION} (pyproject.toml)"
    )


@pytest.mark.parametrize(("name", "params"), sorted(PAHO_SIGNATURES.items()))
def test_paho_private_methods_keep_their_parameters(name: str, params: list[str]) -> None:
    found = list(inspect.signature(getattr(mqtt.Client, name)).parameters)
    assert found == params, (
        f"paho-mqtt {version('paho-mqtt')}: Client.{name}{tuple(found)} was {tuple(params)} in "
        f"paho-mqtt=={PAHO_VERSION}, which edge_queue/mqtt/paho_client.py is written against"
    )


def test_paho_in_packet_has_the_keys_the_short_read_path_fills() -> None:
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="private-names-check")
    assert set(client._in_packet) == IN_PACKET_KEYS


def test_the_check_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a paho whose Client lost a method the fast path overrides
    monkeypatch.delattr(mqtt.Client, "_handle_pubackcomp")
    # Then the check names it
    assert missing_names(paho_owners(), PAHO_PRIVATE) == ["Client._handle_pubackcomp"]


def test_amqtt_is_the_pinned_version_and_has_every_private_name() -> None:
    from amqtt.broker import Broker

    assert version("amqtt") == AMQTT_VERSION
    from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler

    owners = {"Broker": [Broker, *_broker_instance()], "BrokerProtocolHandler": [BrokerProtocolHandler]}
    gone = missing_names(owners, AMQTT_PRIVATE)
    assert gone == [], (
        f"amqtt {version('amqtt')} no longer has {', '.join(gone)}, which edge_queue/mqtt/embedded_broker.py "
        f"overrides or uses; edge-queue is tested with amqtt=={AMQTT_VERSION} (pyproject.toml)"
    )


def _broker_instance() -> list[Any]:
    """An amqtt Broker made (not started) in an event loop: ``_sessions`` and
    ``_subscriptions`` are set in ``__init__``."""
    import asyncio

    from amqtt.broker import Broker

    from edge_queue.mqtt.embedded_broker import broker_config

    async def make() -> Any:
        return Broker(broker_config("127.0.0.1", 0))

    loop = asyncio.new_event_loop()
    try:
        return [loop.run_until_complete(make())]
    finally:
        loop.close()


def test_logging_still_has_srcfile() -> None:
    # edge_queue/cli/main.py sets it to None, as the logging HOWTO ("Optimization") says, so that
    # no log call looks up its caller
    assert hasattr(logging, "_srcfile")
