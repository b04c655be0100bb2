"""edge-queue as a real Home Assistant Core sees it (docs/home-assistant.md): MQTT discovery of
one device per installation, its entities' states, its commands, availability, and restarts.

Home Assistant runs headless through ``../shared/tools/homeassistant/ha_harness.py`` (set up
by ``.ci/run``; ``python3 ../shared/tools/homeassistant/ha_harness.py setup`` locally), against
a mosquitto of the harness without persistence. Select these tests with ``-m homeassistant``.
"""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import port_open, publish, wait_until
from .helpers.figures import figures
from .homeassistant_support import (
    HOME_ASSISTANT_MARKS,
    KEYS,
    StateChanges,
    instance_id,
    restart_home_assistant,
    service,
    state_of,
    wait_state,
)
from .homeassistant_support import entities as entities_of

pytestmark = HOME_ASSISTANT_MARKS


@pytest.mark.usefixtures("model_installed")
def test_home_assistant_sees_and_drives_edge_queue(ha, tmp_path: Path, speech: Path, long_speech: Path) -> None:
    h, inst, broker = ha
    media = tmp_path / "media"
    media.mkdir()
    shutil.copy(speech / "jfk.flac", media / "jfk.flac")
    shutil.copy(long_speech, media / "long-speech.wav")
    svc = service(broker, tmp_path, [media], "data")
    # one window after another: batched, the long transcription could end before it is cancelled
    svc.env["EDGE_QUEUE_TRANSCRIBE__BATCH_SIZE"] = "1"
    svc.start()
    try:
        iid = instance_id(svc)
        # Every entity appears, under one device named after the host
        e = entities_of(h, inst, iid)
        all_ = [x for x in h.entities(inst) if str(x["unique_id"]).startswith(f"edge_queue_{iid}_")]
        assert len(all_) == len(KEYS) and len({str(x["device_identifiers"]) for x in all_}) == 1, all_
        assert all_[0]["device"].startswith("edge-queue ")
        wait_state(h, inst, e["queued"], lambda s, a: s == "0", "the entities available, with their states")
        wait_state(h, inst, e["paused"], lambda s, a: s == "off", "the switch available")
        # The paused switch pauses the queue: submits stay queued, and the count shows them
        h.call_service(inst, "switch", "turn_on", {"entity_id": e["paused"]})
        wait_state(h, inst, e["paused"], lambda s, a: s == "on", "the switch on")
        watcher = svc.watcher("response/#", "jobs/+", "queue")
        watcher.wait_json(f"{svc.base}/queue", lambda q: q["paused"] is True)
        ids = [
            svc.request("submit", {"kind": "noop", "input": f"n{i}"}, watcher)["data"]["jobs"][0]["job_id"]
            for i in range(3)
        ]
        wait_state(h, inst, e["queued"], lambda s, a: s == "3", "3 queued")
        # A restart of edge-queue keeps it paused, and the switch on
        assert svc.stop() == 0
        wait_state(h, inst, e["queued"], lambda s, a: s == "unavailable", "unavailable while stopped")
        states = {key: state_of(h, inst, eid) for key, eid in e.items()}
        assert set(states.values()) == {"unavailable"}, states
        svc.start()
        wait_state(h, inst, e["paused"], lambda s, a: s == "on", "the switch still on after the restart")
        assert state_of(h, inst, e["queued"]) == "3"
        # Turning it off resumes: the jobs run, each fires the event entity once
        fires = StateChanges(h, inst, e["job_finished"])
        h.call_service(inst, "switch", "turn_off", {"entity_id": e["paused"]})
        for job_id in ids:
            watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] == "succeeded")
        wait_state(h, inst, e["queued"], lambda s, a: s == "0", "0 queued")
        wait_until(lambda: len(fires.states) >= 3, 30, "three job-finished events")
        time.sleep(1)  # (a fourth, wrong one would come within this)
        fires.close()
        assert sorted(x["attributes"]["job_id"] for x in fires.states) == sorted(ids), fires.states
        assert {x["attributes"]["event_type"] for x in fires.states} == {"succeeded"}
        # "Submit" with a path queues a transcription; the current job and its progress show
        before = state_of(h, inst, e["submit_result"])
        h.call_service(inst, "text", "set_value", {"entity_id": e["submit"], "value": str(media / "long-speech.wav")})
        wait_state(
            h, inst, e["submit_result"], lambda s, a: s.startswith("queued ") and s != before, "the submit's result"
        )
        long_id = state_of(h, inst, e["submit_result"]).split()[1]
        wait_state(h, inst, e["current_job"], lambda s, a: s == "transcribe long-speech.wav", "the current job")
        wait_state(h, inst, e["current_progress"], lambda s, a: s not in ("", "unknown") and float(s) > 0, "progress")
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
        wait_state(h, inst, e["current_job"], lambda s, a: s == "idle", "idle")
        # A transcription's text becomes the last result (cut to 255 characters), whole in
        # its attributes
        h.call_service(inst, "text", "set_value", {"entity_id": e["submit"], "value": str(media / "jfk.flac")})
        last = wait_state(h, inst, e["last_result"], lambda s, a: "country" in s.lower(), "the transcript", 120)
        assert len(last["state"]) <= 255 and "country" in last["attributes"]["text"].lower()
        assert last["attributes"]["outputs"]["txt"].endswith(".txt")
        # A bad path's error shows on the submit result
        h.call_service(inst, "text", "set_value", {"entity_id": e["submit"], "value": "/etc/passwd"})
        wait_state(h, inst, e["submit_result"], lambda s, a: "input_outside_media_roots" in s, "the error")
        # After a restart of Home Assistant, the entities come back with their states
        restart_home_assistant(h, inst)
        wait_state(h, inst, e["last_result"], lambda s, a: "country" in s.lower(), "the last result after HA's restart")
        wait_state(h, inst, e["paused"], lambda s, a: s == "off", "the switch after HA's restart")
        # After a restart of the broker (no persistence: every retained message lost), too
        h.broker_stop(broker.port)
        wait_until(lambda: not port_open("127.0.0.1", broker.port), 20, "the broker to be gone")
        h.broker_start(broker.port)
        wait_state(h, inst, e["queued"], lambda s, a: s == "0", "the count after the broker's restart", 90)
        wait_state(
            h, inst, e["last_result"], lambda s, a: "country" in s.lower(), "the result after the broker's restart"
        )
        watcher.close()
    finally:
        if svc.proc is not None and svc.proc.poll() is None:
            svc.stop()


def test_two_installs_are_two_devices(ha, tmp_path: Path) -> None:
    """Issue 34, item 4: installations on one host are told apart by their device names and
    entity ids (no ``_2`` suffixes): the base topic follows the host name when it is not the
    default, and ``homeassistant.name`` names the device outright."""
    h, inst, broker = ha
    host = socket.gethostname()
    a = service(broker, tmp_path, [tmp_path], "a", "edge-queue").start()
    b = service(broker, tmp_path, [tmp_path], "b", "eqb-" + tmp_path.name[-8:].replace("/", ""))
    c = service(broker, tmp_path, [tmp_path], "c", "eqc-" + tmp_path.name[-8:].replace("/", ""))
    c.env["EDGE_QUEUE_HOMEASSISTANT__NAME"] = "Garage queue"
    b.start(), c.start()
    try:
        found = [entities_of(h, inst, instance_id(svc)) for svc in (a, b, c)]
        ids = {eid for e in found for eid in e.values()}
        assert len(ids) == 3 * len(KEYS), found
        mine = [x for x in h.entities(inst) if x["entity_id"] in ids]
        devices = {x["device"] for x in mine}
        assert devices == {f"edge-queue {host}", f"edge-queue {host} {b.base}", "Garage queue"}, devices
        assert not [i for i in ids if i.endswith("_2")], sorted(ids)
        slug = host.lower().replace("-", "_")
        assert found[0]["queued"] == f"sensor.edge_queue_{slug}_jobs_queued", found[0]
        assert found[1]["queued"] == f"sensor.edge_queue_{slug}_{b.base.replace('-', '_')}_jobs_queued", found[1]
        assert found[2]["queued"] == "sensor.garage_queue_jobs_queued", found[2]
    finally:
        for svc in (a, b, c):
            svc.stop()


def test_home_assistant_sees_each_worker_node(ha, tmp_path: Path) -> None:
    """docs/home-assistant.md, "Worker nodes": a connectivity sensor per node of
    ``access.nodes`` and the number of jobs it runs, in the real Home Assistant."""
    from .helpers.nodes import NodeProcess, hub_env

    h, inst, broker = ha
    svc = service(broker, tmp_path, [tmp_path], "hub", "eqn-" + tmp_path.name[-8:].replace("/", ""))
    svc.env.update(hub_env(["n1"]))
    svc.start()
    node = NodeProcess(svc, tmp_path, "n1", [tmp_path]).start()
    try:
        iid = instance_id(svc)
        online = h.entity_for_unique_id(inst, f"edge_queue_{iid}_node_n1", timeout=30)
        running = h.entity_for_unique_id(inst, f"edge_queue_{iid}_node_n1_running", timeout=30)
        assert online is not None and running is not None
        wait_state(h, inst, online, lambda s, a: s == "on", "node n1 online in Home Assistant")
        wait_state(h, inst, running, lambda s, a: s == "0", "node n1 running 0")
        w = svc.watcher("#")
        try:
            svc.request("submit", {"kind": "noop", "options": {"sleep_s": 4}}, w)
            wait_state(h, inst, running, lambda s, a: s == "1", "node n1 running 1")
        finally:
            w.close()
        node.stop()
        wait_state(h, inst, online, lambda s, a: s == "off", "node n1 offline in Home Assistant")
    finally:
        node.stop()
        svc.stop()


#: A state that is not one: what no entity may show once edge-queue, the broker and Home
#: Assistant are up again.
NO_STATE = ("unknown", "unavailable", "")


def settle(h: Any, inst: dict[str, Any], e: dict[str, str], since: float, timeout: float) -> dict[str, float]:
    """Seconds from ``since`` (monotonic) until each entity of ``e`` first showed a real state;
    fails with the entities still without one after ``timeout`` seconds."""
    seen: dict[str, float] = {}

    def all_real() -> bool:
        now = {s["entity_id"]: str(s["state"]) for s in h.states(inst)}
        for key, eid in e.items():
            if key not in seen and now.get(eid, "") not in NO_STATE:
                seen[key] = round(time.monotonic() - since, 2)
        return len(seen) == len(e)

    try:
        wait_until(all_real, timeout, "every entity with a state", interval=0.1)
    except AssertionError as err:
        missing = {k: state_of(h, inst, e[k]) for k in e if k not in seen}
        raise AssertionError(f"{err}: still without a state: {missing}") from None
    return seen


def test_every_entity_has_a_state_within_seconds_of_any_restart(ha, tmp_path: Path) -> None:
    """Issue 34, item 3: after a restart of edge-queue, of the broker (without persistence: every
    retained message lost) and of Home Assistant, every entity shows a real state within
    seconds, not ``unknown``: "Last result", "Last submit" and the "Submit" text included."""
    h, inst, broker = ha
    svc = service(broker, tmp_path, [tmp_path], "data", "eqs-" + tmp_path.name[-8:])
    svc.start()
    try:
        e = entities_of(h, inst, instance_id(svc))
        # Given a submit through the "Submit" text, its job finished, and each button pressed
        # once (a button's state is the time of its last press, an event's the time it fired)
        h.call_service(inst, "text", "set_value", {"entity_id": e["submit"], "value": '{"kind":"noop","input":"n1"}'})
        wait_state(h, inst, e["submit_result"], lambda s, a: s.startswith("queued "), "the submit's result")
        wait_state(h, inst, e["last_result"], lambda s, a: s == "noop succeeded: n1", "the last result")
        wait_state(h, inst, e["job_finished"], lambda s, a: s not in NO_STATE, "the job-finished event")
        for key in ("cancel_current", "retry_failed", "republish"):
            h.press(inst, e[key])
            wait_state(h, inst, e[key], lambda s, a: s not in NO_STATE, f"{key} pressed")
        timeline: dict[str, dict[str, float]] = {"before": settle(h, inst, e, time.monotonic(), 10)}
        # When edge-queue restarts
        assert svc.stop() == 0
        wait_state(h, inst, e["queued"], lambda s, a: s == "unavailable", "unavailable while stopped")
        t0 = time.monotonic()
        svc.start()
        timeline["edge-queue restart"] = settle(h, inst, e, t0, 15)
        # When the broker restarts, forgetting every retained message
        h.broker_stop(broker.port)
        wait_until(lambda: not port_open("127.0.0.1", broker.port), 20, "the broker to be gone")
        t0 = time.monotonic()
        h.broker_start(broker.port)
        wait_state(h, inst, e["queued"], lambda s, a: s == "0", "HA and edge-queue back on the broker", 90)
        timeline["broker restart"] = settle(h, inst, e, t0, 90)
        # When Home Assistant restarts (after the broker lost the retained messages)
        t0 = time.monotonic()
        restart_home_assistant(h, inst)
        timeline["home assistant restart (from its start)"] = settle(h, inst, e, t0, 120)
        figures(ha_restart_timeline_s=timeline)
        # Then the states are the real ones
        assert state_of(h, inst, e["last_result"]) == "noop succeeded: n1"
        assert state_of(h, inst, e["submit_result"]).startswith("queued ")
        assert state_of(h, inst, e["submit"]) == "n1"
    finally:
        svc.stop()


def test_diagnostic_entities_and_device_classes(ha, tmp_path: Path) -> None:
    """Issue 34, item 5: the device's diagnostic entities (version, start time, worker health,
    store size, free disk) with their entity category, device classes and units, as Home
    Assistant registers them."""
    from edge_queue import package_version

    h, inst, broker = ha
    ha_log = Path(inst["config"]) / "home-assistant.log"
    log_start = ha_log.stat().st_size if ha_log.exists() else 0
    svc = service(broker, tmp_path, [tmp_path], "data", "eqg-" + tmp_path.name[-8:])
    svc.env["EDGE_QUEUE_WORKERS"] = "1"
    svc.start()
    try:
        e = entities_of(h, inst, instance_id(svc))
        registry = {x["entity_id"]: x for x in h.ws_call(inst, "config/entity_registry/list")}
        category = {key: registry[eid].get("entity_category") for key, eid in e.items()}
        diagnostic = {
            "version",
            "started",
            "workers_alive",
            "workers_problem",
            "store_size",
            "disk_free",
            "republish",
            "conflict",
            "diagnostics",
        }
        assert {k for k, c in category.items() if c == "diagnostic"} == diagnostic, category
        states = {
            key: wait_state(h, inst, e[key], lambda s, a: s not in NO_STATE, key) for key in diagnostic - {"republish"}
        }
        assert states["version"]["state"] == package_version()
        assert states["started"]["attributes"]["device_class"] == "timestamp"
        assert states["workers_alive"]["state"] == "1"
        assert states["workers_problem"]["state"] == "off"
        assert states["workers_problem"]["attributes"]["device_class"] == "problem"
        for key, unit in (("store_size", "MB"), ("disk_free", "GB")):
            a = states[key]["attributes"]
            assert (a["device_class"], a["unit_of_measurement"]) == ("data_size", unit), (key, a)
            assert float(states[key]["state"]) > 0, states[key]
        # A summary with fewer workers alive than configured (a worker that crash-loops and is
        # not restarted) is a problem; edge-queue's own summary, republished, is none again
        w = svc.watcher("queue", "response/#")
        summary = w.wait_json(f"{svc.base}/queue", lambda m: m["workers_alive"] == 1)
        publish(broker, f"{svc.base}/queue", json.dumps({**summary, "workers_alive": 0}), retain=True)
        wait_state(h, inst, e["workers_problem"], lambda s, a: s == "on", "a problem")
        wait_state(h, inst, e["workers_alive"], lambda s, a: s == "0", "0 workers alive")
        svc.request("republish", {}, w)
        wait_state(h, inst, e["workers_problem"], lambda s, a: s == "off", "no problem")
        # Issue 46, item 5: another installation announcing itself on our base topic is a
        # problem Home Assistant shows (before: only logged and shown on the page)
        assert states["conflict"]["state"] == "off", states["conflict"]
        other = {"v": 1, "instance_id": "0123456789ab", "host": "other-box", "version": "0", "started_at": "x"}
        publish(broker, f"{svc.base}/info", json.dumps(other))
        # (on at once, from the other's info; the installations with our own info, which follows)
        on = wait_state(
            h, inst, e["conflict"], lambda s, a: s == "on" and a.get("installations"), "the shared base topic shown"
        )
        assert on["attributes"]["installations"][0]["host"] == "other-box", on
        # Issue 46, item 7: the diagnostics, as the device's "Download diagnostics" gives them
        # (Home Assistant's own endpoint): settings without secrets, counts, the last problems;
        # issue 52, row 19: with the conflict at once (before: only after a republish)

        def with_the_conflict(s: str, a: dict[str, Any]) -> bool:
            return any("another edge-queue announced itself" in p["message"] for p in a.get("problems", []))

        diag = wait_state(h, inst, e["diagnostics"], with_the_conflict, "the conflict in the diagnostics")["attributes"]
        assert diag["settings"]["mqtt"]["base_topic"] == svc.base and diag["counts"]["queued"] == 0, diag
        assert diag["conflict"][0]["host"] == "other-box", diag
        # Issue 52, row 19: the other box gone, "Republish" turns "Base topic shared" off
        # (before: on until edge-queue restarted), and the diagnostics follow
        svc.request("republish", {}, w)
        wait_state(h, inst, e["conflict"], lambda s, a: s == "off", "the shared base topic cleared by republish")
        diag = wait_state(h, inst, e["diagnostics"], lambda s, a: a.get("conflict") == [], "no conflict")["attributes"]
        assert with_the_conflict("", diag), diag  # what was logged stays among the problems
        device = next(
            d
            for d in h.ws_call(inst, "config/device_registry/list")
            if ["mqtt", f"edge_queue_{instance_id(svc)}"] in [list(i) for i in d["identifiers"]]
        )
        entry = next(c for c in h.ws_call(inst, "config_entries/get") if c["domain"] == "mqtt")
        status, download = h.http(
            "GET",
            f"{inst['url']}/api/diagnostics/config_entry/{entry['entry_id']}/device/{device['id']}",
            inst["token"],
        )
        assert status == 200, (status, download)
        text = json.dumps(download)
        assert '"settings"' in text and svc.base in text and '"problems"' in text, text[:2000]
        figures(diagnostics_download_bytes=len(text))
        w.close()
        # Issue 52, row 17: no template warning about edge-queue's topics in Home Assistant's
        # log (before: 2 per start and reconnect, `value_json.conflict` absent from <base>/info)
        with open(ha_log, "rb") as f:
            f.seek(log_start)
            logged = f.read().decode(errors="replace")
        warned = [line for line in logged.splitlines() if "Template variable" in line and "conflict" in line]
        assert not warned, "\n".join(warned[:4])
    finally:
        svc.stop()
