"""What the Home Assistant tests share: a real Home Assistant Core (through
``../shared/tools/homeassistant/ha_harness.py``) on a mosquitto of its own, edge-queue services
with discovery on, and waiting on Home Assistant's states."""

from __future__ import annotations

import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from .conftest import ROOT, Broker, ServiceProcess, free_port, need, wait_until

#: The marks of every test file that runs the real Home Assistant.
HOME_ASSISTANT_MARKS = [
    pytest.mark.homeassistant,
    pytest.mark.slow,
    # one Home Assistant (the harness's configuration folder), started within the harness's own
    # time limits: alone, after the parallel part of the suite
    pytest.mark.serial,
    # the harness (a shared tool, not ours) leaves its subprocess pipes to the garbage collector
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

HARNESS = ROOT.parent / "shared" / "tools" / "homeassistant"

#: Every entity edge-queue declares, by the key its unique_id ends with.
KEYS = [
    "queued",
    "running",
    "retrying",
    "failed",
    "succeeded",
    "cancelled",
    "current_job",
    "current_progress",
    "last_result",
    "job_finished",
    "paused",
    "cancel_current",
    "retry_failed",
    "republish",
    "submit",
    "submit_result",
    "version",
    "started",
    "workers_alive",
    "workers_problem",
    "store_size",
    "disk_free",
    "conflict",
    "diagnostics",
]


@contextmanager
def home_assistant(extra_yaml: Path | None = None) -> Iterator[tuple[Any, dict[str, Any], Broker]]:
    """A real Home Assistant Core with its MQTT integration on a broker of its own, in a
    configuration folder of this checkout's own (two checkouts on one machine do not share
    one); ``extra_yaml`` is appended to its ``configuration.yaml``."""
    need((HARNESS / "ha_harness.py").is_file(), f"no Home Assistant harness in {HARNESS}")
    sys.path.insert(0, str(HARNESS))
    import ha_harness as h

    need(h.venv_exists(), "Home Assistant is not set up: python3 ../shared/tools/homeassistant/ha_harness.py setup")
    need(shutil.which("mosquitto") is not None, "mosquitto not installed")
    port = free_port()
    h.broker_start(port)
    config = Path(f"{h.DEFAULT_CONFIG}-{ROOT.name}")
    inst = h.start(
        broker_host="127.0.0.1",
        broker_port=port,
        config=config,
        fresh=True,
        http_port=free_port(),
        extra_yaml=None if extra_yaml is None else str(extra_yaml),
    )
    try:
        yield h, inst, Broker("127.0.0.1", port, "mosquitto")
    finally:
        h.stop(inst)
        h.broker_stop(port)


def restart_home_assistant(h: Any, inst: dict[str, Any], extra_yaml: Path | None = None) -> None:
    """Stop Home Assistant and start it again on the same configuration (``inst`` is updated)."""
    h.stop(inst)
    inst.update(
        h.start(
            broker_host="127.0.0.1",
            broker_port=inst["broker_port"],
            config=inst["config"],
            http_port=inst["http_port"],
            extra_yaml=None if extra_yaml is None else str(extra_yaml),
        )
    )


def service(broker: Broker, tmp: Path, media: list[Path], name: str, base: str | None = None) -> ServiceProcess:
    """An edge-queue with discovery on and its default client id, its store in ``tmp/name``
    (beside ``tmp`` when that is a media root)."""
    svc = ServiceProcess(broker, tmp, media)
    svc.env.pop("EDGE_QUEUE_MQTT__CLIENT_ID", None)  # the default: edge-queue-<instance id>-<secret>
    svc.env["EDGE_QUEUE_HOMEASSISTANT__DISCOVERY"] = "true"
    svc.data_dir = tmp / name
    if any(svc.data_dir.is_relative_to(root) for root in media):  # serve refuses a data_dir in a media root
        svc.data_dir = tmp.parent / f"{tmp.name}-{name}"
    svc.env["EDGE_QUEUE_DATA_DIR"] = str(svc.data_dir)
    if base is not None:
        svc.base = base
        svc.env["EDGE_QUEUE_MQTT__BASE_TOPIC"] = base
    return svc


def instance_id(svc: ServiceProcess) -> str:
    w = svc.watcher("info")
    try:
        return str(w.wait_json(f"{svc.base}/info", lambda m: True)["instance_id"])
    finally:
        w.close()


def entities(h: Any, inst: dict[str, Any], iid: str, keys: list[str] = KEYS) -> dict[str, str]:
    """key -> entity_id of every entity of the installation, waiting for discovery."""
    found = {}
    for key in keys:
        eid = h.entity_for_unique_id(inst, f"edge_queue_{iid}_{key}", timeout=30)
        assert eid is not None, f"no entity with unique_id edge_queue_{iid}_{key}"
        found[key] = eid
    return found


def state_of(h: Any, inst: dict[str, Any], eid: str) -> str:
    s = h.state(inst, eid)
    return "" if s is None else str(s["state"])


def wait_state(
    h: Any, inst: dict[str, Any], eid: str, pred: Callable[[str, dict[str, Any]], Any], what: str, timeout: float = 60
) -> dict[str, Any]:
    """Wait until ``pred(state, attributes)`` holds for ``eid``; returns its state object."""
    return wait_until(
        lambda: (s := h.state(inst, eid)) is not None and pred(s["state"], s.get("attributes") or {}) and s,
        timeout,
        what,
        interval=0.2,
    )


class Events:
    """Home Assistant's events of one type (a WebSocket subscription), collected by a thread of
    its own: ``state_changed`` (keep those of ``entity_id``), ``call_service``, ..."""

    def __init__(self, h: Any, inst: dict[str, Any], event_type: str, entity_id: str | None = None) -> None:
        self.entity_id = entity_id
        self.items: list[dict[str, Any]] = []
        self.ws = h.WS("127.0.0.1", inst["http_port"], inst["token"])
        self.ws.call("subscribe_events", event_type=event_type)
        self.ws.sock.settimeout(None)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                data = (self.ws.recv().get("event") or {}).get("data") or {}
                if self.entity_id is None:
                    self.items.append(data)
                elif data.get("entity_id") == self.entity_id and data.get("new_state"):
                    self.items.append(data["new_state"])
        except (OSError, ConnectionError, ValueError):
            pass

    def close(self) -> None:
        self.ws.close()


class StateChanges(Events):
    """The new states of one entity, as Home Assistant announces them."""

    def __init__(self, h: Any, inst: dict[str, Any], entity_id: str) -> None:
        super().__init__(h, inst, "state_changed", entity_id)
        self.states = self.items
