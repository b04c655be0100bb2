"""edge-queue as a real Home Assistant Core sees it (docs/home-assistant.md): MQTT discovery of
one device per installation, its entities' states, its commands, availability, and restarts.

Home Assistant runs headless through ``../shared/tools/homeassistant/ha_harness.py`` (set up
by ``.ci/run``; ``python3 ../shared/tools/homeassistant/ha_harness.py setup`` locally), against
a mosquitto of the harness without persistence. Select these tests with ``-m homeassistant``.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import ROOT, Broker, ServiceProcess, free_port, need, port_open, wait_until
from .test_load import figures

pytestmark = [
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
]


@pytest.fixture(scope="module")
def ha() -> Iterator[tuple[Any, dict[str, Any], Broker]]:
    """A real Home Assistant Core with its MQTT integration on a broker of its own."""
    need((HARNESS / "ha_harness.py").is_file(), f"no Home Assistant harness in {HARNESS}")
    sys.path.insert(0, str(HARNESS))
    import ha_harness as h

    need(h.venv_exists(), "Home Assistant is not set up: python3 ../shared/tools/homeassistant/ha_harness.py setup")
    need(shutil.which("mosquitto") is not None, "mosquitto not installed")
    port = free_port()
    h.broker_start(port)
    inst = h.start(broker_host="127.0.0.1", broker_port=port, fresh=True, http_port=free_port())
    try:
        yield h, inst, Broker("127.0.0.1", port, "mosquitto")
    finally:
        h.stop(inst)
        h.broker_stop(port)


def _service(broker: Broker, tmp: Path, media: list[Path], name: str, base: str | None = None) -> ServiceProcess:
    svc = ServiceProcess(broker, tmp, media)
    svc.env.pop("EDGE_QUEUE_MQTT__CLIENT_ID", None)  # the default: edge-queue-<instance id>-<secret>
    svc.env["EDGE_QUEUE_HOMEASSISTANT__DISCOVERY"] = "true"
    svc.data_dir = tmp / name
    svc.env["EDGE_QUEUE_DATA_DIR"] = str(svc.data_dir)
    if base is not None:
        svc.base = base
        svc.env["EDGE_QUEUE_MQTT__BASE_TOPIC"] = base
    return svc


def _instance_id(svc: ServiceProcess) -> str:
    w = svc.watcher("info")
    try:
        return str(w.wait_json(f"{svc.base}/info", lambda m: True)["instance_id"])
    finally:
        w.close()


def _entities(h: Any, inst: dict[str, Any], iid: str) -> dict[str, str]:
    """key -> entity_id of every entity of the installation, waiting for discovery."""
    found = {}
    for key in KEYS:
        eid = h.entity_for_unique_id(inst, f"edge_queue_{iid}_{key}", timeout=30)
        assert eid is not None, f"no entity with unique_id edge_queue_{iid}_{key}"
        found[key] = eid
    return found


def _state(h: Any, inst: dict[str, Any], eid: str) -> str:
    s = h.state(inst, eid)
    return "" if s is None else str(s["state"])


def _wait(h: Any, inst: dict[str, Any], eid: str, pred: Any, what: str, timeout: float = 60) -> dict[str, Any]:
    return wait_until(
        lambda: (s := h.state(inst, eid)) is not None and pred(s["state"], s.get("attributes") or {}) and s,
        timeout,
        what,
        interval=0.2,
    )


class StateChanges:
    """The new states of one entity, as Home Assistant announces them (a WebSocket
    subscription to ``state_changed``), collected by a thread of its own."""

    def __init__(self, h: Any, inst: dict[str, Any], entity_id: str) -> None:
        self.entity_id = entity_id
        self.states: list[dict[str, Any]] = []
        self.ws = h.WS("127.0.0.1", inst["http_port"], inst["token"])
        self.ws.call("subscribe_events", event_type="state_changed")
        self.ws.sock.settimeout(None)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                msg = self.ws.recv()
                data = (msg.get("event") or {}).get("data") or {}
                if data.get("entity_id") == self.entity_id and data.get("new_state"):
                    self.states.append(data["new_state"])
        except (OSError, ConnectionError, ValueError):
            pass

    def close(self) -> None:
        self.ws.close()


@pytest.mark.usefixtures("model_installed")
def test_home_assistant_sees_and_drives_edge_queue(ha, tmp_path: Path, speech: Path, long_speech: Path) -> None:
    h, inst, broker = ha
    media = tmp_path / "media"
    media.mkdir()
    shutil.copy(speech / "jfk.flac", media / "jfk.flac")
    shutil.copy(long_speech, media / "long-speech.wav")
    svc = _service(broker, tmp_path, [media], "data")
    # one window after another: batched, the long transcription could end before it is cancelled
    svc.env["EDGE_QUEUE_TRANSCRIBE__BATCH_SIZE"] = "1"
    svc.start()
    try:
        iid = _instance_id(svc)
        # Every entity appears, under one device named after the host
        e = _entities(h, inst, iid)
        all_ = [x for x in h.entities(inst) if str(x["unique_id"]).startswith(f"edge_queue_{iid}_")]
        assert len(all_) == len(KEYS) and len({str(x["device_identifiers"]) for x in all_}) == 1, all_
        assert all_[0]["device"].startswith("edge-queue ")
        _wait(h, inst, e["queued"], lambda s, a: s == "0", "the entities available, with their states")
        _wait(h, inst, e["paused"], lambda s, a: s == "off", "the switch available")
        # The paused switch pauses the queue: submits stay queued, and the count shows them
        h.call_service(inst, "switch", "turn_on", {"entity_id": e["paused"]})
        _wait(h, inst, e["paused"], lambda s, a: s == "on", "the switch on")
        watcher = svc.watcher("response/#", "jobs/+", "queue")
        watcher.wait_json(f"{svc.base}/queue", lambda q: q["paused"] is True)
        ids = [
            svc.request("submit", {"kind": "noop", "input": f"n{i}"}, watcher)["data"]["jobs"][0]["job_id"]
            for i in range(3)
        ]
        _wait(h, inst, e["queued"], lambda s, a: s == "3", "3 queued")
        # A restart of edge-queue keeps it paused, and the switch on
        assert svc.stop() == 0
        _wait(h, inst, e["queued"], lambda s, a: s == "unavailable", "unavailable while stopped")
        states = {key: _state(h, inst, eid) for key, eid in e.items()}
        assert set(states.values()) == {"unavailable"}, states
        svc.start()
        _wait(h, inst, e["paused"], lambda s, a: s == "on", "the switch still on after the restart")
        assert _state(h, inst, e["queued"]) == "3"
        # Turning it off resumes: the jobs run, each fires the event entity once
        fires = StateChanges(h, inst, e["job_finished"])
        h.call_service(inst, "switch", "turn_off", {"entity_id": e["paused"]})
        for job_id in ids:
            watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] == "succeeded")
        _wait(h, inst, e["queued"], lambda s, a: s == "0", "0 queued")
        wait_until(lambda: len(fires.states) >= 3, 30, "three job-finished events")
        time.sleep(1)  # (a fourth, wrong one would come within this)
        fires.close()
        assert sorted(x["attributes"]["job_id"] for x in fires.states) == sorted(ids), fires.states
        assert {x["attributes"]["event_type"] for x in fires.states} == {"succeeded"}
        # "Submit" with a path queues a transcription; the current job and its progress show
        before = _state(h, inst, e["submit_result"])
        h.call_service(inst, "text", "set_value", {"entity_id": e["submit"], "value": str(media / "long-speech.wav")})
        _wait(h, inst, e["submit_result"], lambda s, a: s.startswith("queued ") and s != before, "the submit's result")
        long_id = _state(h, inst, e["submit_result"]).split()[1]
        _wait(h, inst, e["current_job"], lambda s, a: s == "transcribe long-speech.wav", "the current job")
        _wait(h, inst, e["current_progress"], lambda s, a: s not in ("", "unknown") and float(s) > 0, "progress")
        figures(
            entities_while_transcribing=[
                (x["entity_id"], x["unique_id"], x["state"])
                for x in h.entities(inst)
                if str(x["unique_id"]).startswith(f"edge_queue_{iid}_")
            ]
        )
        attrs = h.state(inst, e["current_job"])["attributes"]
        assert attrs["job_id"] == long_id and attrs["stage"] == "transcribing", attrs
        # "Cancel current job" cancels it
        h.press(inst, e["cancel_current"])
        watcher.wait_json(f"{svc.base}/jobs/{long_id}", lambda m: m["state"] == "cancelled", timeout=60)
        _wait(h, inst, e["current_job"], lambda s, a: s == "idle", "idle")
        # A transcription's text becomes the last result (cut to 255 characters), whole in
        # its attributes
        h.call_service(inst, "text", "set_value", {"entity_id": e["submit"], "value": str(media / "jfk.flac")})
        last = _wait(h, inst, e["last_result"], lambda s, a: "country" in s.lower(), "the transcript", 120)
        assert len(last["state"]) <= 255 and "country" in last["attributes"]["text"].lower()
        assert last["attributes"]["outputs"]["txt"].endswith(".txt")
        # A bad path's error shows on the submit result
        h.call_service(inst, "text", "set_value", {"entity_id": e["submit"], "value": "/etc/passwd"})
        _wait(h, inst, e["submit_result"], lambda s, a: "input_outside_media_roots" in s, "the error")
        # After a restart of Home Assistant, the entities come back with their states
        h.stop(inst)
        inst2 = h.start(broker_host="127.0.0.1", broker_port=broker.port, http_port=inst["http_port"])
        inst.update(inst2)
        _wait(h, inst, e["last_result"], lambda s, a: "country" in s.lower(), "the last result after HA's restart")
        _wait(h, inst, e["paused"], lambda s, a: s == "off", "the switch after HA's restart")
        # After a restart of the broker (no persistence: every retained message lost), too
        h.broker_stop(broker.port)
        wait_until(lambda: not port_open("127.0.0.1", broker.port), 20, "the broker to be gone")
        h.broker_start(broker.port)
        _wait(h, inst, e["queued"], lambda s, a: s == "0", "the count after the broker's restart", 90)
        _wait(h, inst, e["last_result"], lambda s, a: "country" in s.lower(), "the result after the broker's restart")
        watcher.close()
    finally:
        if svc.proc is not None and svc.proc.poll() is None:
            svc.stop()


def test_two_installs_are_two_devices(ha, tmp_path: Path) -> None:
    h, inst, broker = ha
    a = _service(broker, tmp_path, [tmp_path], "a", "eqa-" + tmp_path.name[-8:].replace("/", "")).start()
    b = _service(broker, tmp_path, [tmp_path], "b", "eqb-" + tmp_path.name[-8:].replace("/", "")).start()
    try:
        ea, eb = _entities(h, inst, _instance_id(a)), _entities(h, inst, _instance_id(b))
        assert not set(ea.values()) & set(eb.values())
        mine = [x for x in h.entities(inst) if x["entity_id"] in set(ea.values()) | set(eb.values())]
        assert len({str(x["device_identifiers"]) for x in mine}) == 2
        assert len({x["unique_id"] for x in mine}) == 2 * len(KEYS)
    finally:
        for svc in (a, b):
            svc.stop()


def test_home_assistant_sees_each_worker_node(ha, tmp_path: Path) -> None:
    """docs/home-assistant.md, "Worker nodes": a connectivity sensor per node of
    ``access.nodes`` and the number of jobs it runs, in the real Home Assistant."""
    from .test_nodes import NodeProcess, hub_env

    h, inst, broker = ha
    svc = _service(broker, tmp_path, [tmp_path], "hub", "eqn-" + tmp_path.name[-8:].replace("/", ""))
    svc.env.update(hub_env(["n1"]))
    svc.start()
    node = NodeProcess(svc, tmp_path, "n1", [tmp_path]).start()
    try:
        iid = _instance_id(svc)
        online = h.entity_for_unique_id(inst, f"edge_queue_{iid}_node_n1", timeout=30)
        running = h.entity_for_unique_id(inst, f"edge_queue_{iid}_node_n1_running", timeout=30)
        assert online is not None and running is not None
        _wait(h, inst, online, lambda s, a: s == "on", "node n1 online in Home Assistant")
        _wait(h, inst, running, lambda s, a: s == "0", "node n1 running 0")
        w = svc.watcher("#")
        try:
            svc.request("submit", {"kind": "noop", "options": {"sleep_s": 4}}, w)
            _wait(h, inst, running, lambda s, a: s == "1", "node n1 running 1")
        finally:
            w.close()
        node.stop()
        _wait(h, inst, online, lambda s, a: s == "off", "node n1 offline in Home Assistant")
    finally:
        node.stop()
        svc.stop()
