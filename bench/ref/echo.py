"""P2's floor: an MQTT echo, run as its own process.

    python bench/ref/echo.py HOST PORT BASE

Subscribes to ``<BASE>/request/submit`` (QoS 1) and answers each request at once with
``{"status": "ok", "transaction": <the request's transaction>}`` on ``<BASE>/response/submit``
(QoS 1), from paho's network thread: what a request and its response cost through the same
broker and the same measuring clients, without a queue behind them. Prints ``ready`` once
subscribed; runs until killed.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion


def main() -> None:
    host, port, base = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"{base}-echo", protocol=mqtt.MQTTv5)

    def on_message(cl: mqtt.Client, u: Any, m: mqtt.MQTTMessage) -> None:
        tr = json.loads(m.payload).get("transaction")
        cl.publish(f"{base}/response/submit", json.dumps({"status": "ok", "transaction": tr}), qos=1)

    c.on_message = on_message
    c.on_connect = lambda cl, *a: cl.subscribe(f"{base}/request/submit", 1)
    c.on_subscribe = lambda *a: print("ready", flush=True)
    c.connect(host, port)
    c.loop_forever()


if __name__ == "__main__":
    main()
