"""The read of edge-queue's retained topics after a connect, on a connection of its own.

After every connect the service compares the retained ``<base>/jobs/<id>`` and
``<base>/batches/<id>`` topics on the broker with its store and clears those the store does not
know (a purge while the broker was away, a
restored broker save, a replaced store). A broker with 100,000 retained job topics sends 100,000
messages for that; read on the service's own connection they would queue ahead of every request
for seconds. So they are read by a process of its own (``python -m edge_queue.mqtt.scan``: in a
thread, decoding them took the interpreter lock from the service's loop for seconds), over its
own short-lived, clean-session MQTT connection (client id ``<client id>-scan-<random>``), and
only the ids reach the service (docs/operations.md, "Load and back-pressure").

The process does nothing but read: it never publishes and never touches the store. It gets its
settings on standard input (the password never appears in a command line) and writes one job id
per line and one ``batch <id>`` line per batch, then ``complete`` or ``error: <reason>``. A
thread of the service waits for it and hands the result over through :attr:`RetainedScan.result`
and one byte on the service's wake socket.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from edge_queue.config.settings import MqttSettings

from .paho_client import configure_client
from .topics import Topics

log = logging.getLogger(__name__)

#: The read ends once no retained message arrived for this many seconds after the SUBACK.
QUIET_S = 1.0
#: ... or after this many seconds in all.
MAX_SCAN_S = 300.0


def read_retained_job_ids(
    settings: MqttSettings,
    topics: Topics,
    client_id: str,
    protocol: mqtt.MQTTProtocolVersion,
    batches: set[str] | None = None,
) -> tuple[set[str], str | None]:
    """Connect as ``client_id`` (clean session), subscribe to ``<base>/jobs/+`` and
    ``<base>/batches/+`` at QoS 0 and collect the ids of the retained, non-empty messages until
    none came for :data:`QUIET_S` seconds after the SUBACK. Returns ``(job ids, None)``, or
    ``(what was read, reason)`` when the read did not finish (refused, connection lost,
    :data:`MAX_SCAN_S`); batch ids go into ``batches`` when it is given."""
    ids: set[str] = set()
    state: dict[str, Any] = {"subscribed": False, "last": 0.0, "refused": None}

    def on_connect(client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            state["refused"] = str(reason)
        else:
            client.subscribe([(topics.all_jobs, 0), (topics.all_batches, 0)])

    def on_subscribe(client: mqtt.Client, userdata: Any, mid: int, reasons: Any, props: Any) -> None:
        state["subscribed"], state["last"] = True, time.monotonic()

    def on_message(client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        state["last"] = time.monotonic()
        if msg.retain and msg.payload:
            job_id = topics.parse_job(msg.topic)
            if job_id:
                ids.add(job_id)
            elif batches is not None and (batch_id := topics.parse_batch(msg.topic)):
                batches.add(batch_id)

    v5 = protocol == mqtt.MQTTv5
    client = mqtt.Client(
        CallbackAPIVersion.VERSION2, client_id=client_id, protocol=protocol, clean_session=None if v5 else True
    )
    configure_client(client, settings)
    client.on_connect, client.on_subscribe, client.on_message = on_connect, on_subscribe, on_message
    started = time.monotonic()
    try:
        if v5:
            client.connect(settings.host, settings.port, keepalive=60, clean_start=True)
        else:
            client.connect(settings.host, settings.port, keepalive=60)
        while time.monotonic() - started < MAX_SCAN_S:
            if client.loop(timeout=0.2) != mqtt.MQTT_ERR_SUCCESS:
                return ids, "the connection ended during the read"
            if state["refused"]:
                return ids, f"the broker refused the connection: {state['refused']}"
            if state["subscribed"] and time.monotonic() - state["last"] >= QUIET_S:
                return ids, None
        return ids, f"not finished after {MAX_SCAN_S:.0f} s"
    except (OSError, ValueError) as e:
        return ids, str(e)
    finally:
        try:
            client.disconnect()
        except (OSError, ValueError):
            pass


def _settings_document(settings: MqttSettings) -> dict[str, Any]:
    """``settings`` as JSON, with the password itself (it goes to the process's standard input)."""
    doc = settings.model_dump(mode="json")
    doc["password"] = settings.password.get_secret_value() if settings.password else None
    return doc


class RetainedScan(threading.Thread):
    """Run :func:`read_retained_job_ids` in a process of its own and wait for it.

    Args:
        settings: the ``[mqtt]`` section (host, credentials, TLS).
        topics: the topic set of the base topic.
        client_id: the service's client id; the scan connects as ``<client_id>-scan-<hex>``.
        protocol: the protocol the service's connection speaks (``mqtt.MQTTv5`` or ``mqtt.MQTTv311``).
        wake: a non-blocking socket written one byte when the result is ready.

    Once the thread has ended, :attr:`result` holds the set of job ids, or ``None`` when the
    read did not finish (the reason is in :attr:`error`); :attr:`seconds` is how long it took.
    """

    def __init__(
        self,
        settings: MqttSettings,
        topics: Topics,
        client_id: str,
        protocol: mqtt.MQTTProtocolVersion,
        wake: socket.socket,
    ) -> None:
        super().__init__(name="edge-queue-retained-scan", daemon=True)
        self.settings = settings
        self.topics = topics
        self.client_id = f"{client_id}-scan-{secrets.token_hex(4)}"
        self.protocol = protocol
        self.wake = wake
        self.result: set[str] | None = None
        #: the batch ids read, once :attr:`result` is set
        self.batches: set[str] = set()
        self.error: str | None = None
        self.seconds = 0.0

    def run(self) -> None:
        started = time.monotonic()
        request = {
            "settings": _settings_document(self.settings),
            "base": self.topics.base,
            "client_id": self.client_id,
            "protocol": int(self.protocol),
        }
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "edge_queue.mqtt.scan"],
                input=json.dumps(request),
                capture_output=True,
                text=True,
                timeout=MAX_SCAN_S + 30,
                check=False,
                # a session of its own: a terminal's Ctrl-C is the service's to handle, not its
                start_new_session=True,
            )
            lines = proc.stdout.splitlines()
            if lines and lines[-1] == "complete":
                self.result = {line for line in lines[:-1] if not line.startswith("batch ")}
                self.batches = {line[len("batch ") :] for line in lines[:-1] if line.startswith("batch ")}
            elif lines and lines[-1].startswith("error: "):
                self.error = lines[-1][len("error: ") :]
            else:
                self.error = f"the reading process ended with code {proc.returncode}: {proc.stderr.strip()[-300:]}"
        except (OSError, subprocess.SubprocessError) as e:
            self.error = str(e)
        finally:
            self.seconds = time.monotonic() - started
            try:
                self.wake.send(b"\0")
            except OSError:
                pass  # the loop wakes within a second anyway


def main() -> int:
    """``python -m edge_queue.mqtt.scan``: the request on standard input, job ids on standard output."""
    request = json.loads(sys.stdin.read())
    settings = MqttSettings.model_validate(request["settings"])
    batches: set[str] = set()
    ids, error = read_retained_job_ids(
        settings, Topics(request["base"]), request["client_id"], mqtt.MQTTProtocolVersion(request["protocol"]), batches
    )
    out = sys.stdout
    if error is None:
        out.write("".join(f"{job_id}\n" for job_id in sorted(ids)))
        out.write("".join(f"batch {batch_id}\n" for batch_id in sorted(batches)))
        out.write("complete\n")
    else:
        out.write(f"error: {error}\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
