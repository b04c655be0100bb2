"""The service with paho-mqtt's own client in place of edge_queue.mqtt.paho_client.FastClient: P1's
"stock paho" side, which measures what the short paths on paho's private names buy.

    python bench/ref/stock_paho.py serve      # as ``python -m edge_queue serve``

StockClient gives the bridge the few methods it calls on its client, each done the way paho does
it itself: packets read one at a time by paho's reader (what ``loop_read`` calls), publishes
through ``Client.publish``, PUBACKs and PUBLISHes decoded by paho. Only the bookkeeping of the
prompt TCP acknowledgement (``read_since_send``) is kept, so that both sides wait the same on a
broker with Nagle's algorithm on.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's edge_queue

import paho.mqtt.client as mqtt  # noqa: E402
from paho.mqtt.enums import MQTTErrorCode  # noqa: E402


class StockClient(mqtt.Client):
    """paho's client, as paho reads, writes and decodes."""

    read_since_send = False
    dropped_property_bytes = 0

    def buffered(self) -> bool:
        return False  # paho reads from the socket for each packet: nothing is buffered here

    def read_packet(self) -> MQTTErrorCode:
        return self._packet_read()

    def read_failed(self, rc: MQTTErrorCode) -> None:
        self._loop_rc_handle(rc)

    def forget_message(self, mid: int) -> None:
        self._out_messages.pop(mid, None)

    def publish_qos1(
        self, topic: str, payload: bytes, retain: bool, properties: Any = None, packed: bytes | None = None
    ) -> int:
        return int(self.publish(topic, payload, qos=1, retain=retain, properties=properties).mid)

    def _sock_recv(self, bufsize: int) -> bytes:
        data = super()._sock_recv(bufsize)
        self.read_since_send = True
        return data

    def _sock_send(self, buf: bytes | bytearray) -> int:
        sent = super()._sock_send(buf)
        self.read_since_send = False
        return sent


def main() -> None:
    from edge_queue.cli.main import main as cli_main
    from edge_queue.mqtt import bridge, connecting

    bridge.FastClient = StockClient  # type: ignore[misc,assignment]
    connecting.FastClient = StockClient  # type: ignore[misc,assignment]
    cli_main()


if __name__ == "__main__":
    main()
