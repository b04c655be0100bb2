"""docs/home-assistant.md as its reader uses it, in a real Home Assistant Core: every YAML block
of the page is loaded as written (the base topic, entity id, job id and path replaced, as the
page tells its reader to), and the automations, the script and the sensors do what the page
says, across restarts of edge-queue, the broker and Home Assistant.

``notify.mobile_app_my_phone`` is a notify group of Home Assistant's own
``persistent_notification``: every notification is one persistent notification, kept until
Home Assistant stops or a test loads its own configuration (so one sent while it starts is seen
too).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import port_open, publish, wait_until
from .helpers.figures import figures
from .helpers.ha_docs import BLUEPRINT, DOC_BASE, DOC_CLIP, DOC_EVENT, DOC_JOB, blocks, notifications
from .homeassistant_support import (
    HOME_ASSISTANT_MARKS,
    entities,
    instance_id,
    reload_yaml,
    restart_home_assistant,
    service,
    wait_state,
)

pytestmark = HOME_ASSISTANT_MARKS


@pytest.mark.usefixtures("model_installed")
def test_the_pages_yaml_works_in_home_assistant_across_restarts(ha, tmp_path: Path, speech: Path) -> None:
    """Issue 34, items 1 and 7: the page's automations notify once per finished job, never again
    for an old one when edge-queue, the broker or Home Assistant restarts; a double tap on the
    script's button makes one job; the job sensor logs no error when its topic is cleared."""
    h, inst, broker = ha
    doc = blocks()
    media = tmp_path / "media"
    (media / "doorbell").mkdir(parents=True)
    clip = media / "doorbell" / "latest.flac"
    shutil.copy(speech / "jfk.flac", clip)
    svc = service(broker, tmp_path, [media], "data", "eqd-" + tmp_path.name[-8:])
    svc.start()
    config = Path(inst["config"])
    try:
        e = entities(h, inst, instance_id(svc), ["job_finished", "queued"])

        def ours(text: str, job_id: str = DOC_JOB) -> str:
            text = text.replace(DOC_BASE, svc.base + "/").replace(DOC_EVENT, e["job_finished"])
            return text.replace(DOC_JOB, job_id).replace(DOC_CLIP, str(clip))

        # Given the page's blocks where its reader puts them: the UI automation and the
        # automations.yaml entry, the scripts.yaml entry, the sensors
        ui = doc["ui_automation"].splitlines()
        (config / "automations.yaml").write_text(
            ours("\n".join(["- id: edge_queue_ui", *("  " + x for x in ui)]) + "\n" + doc["automations"])
        )
        (config / "scripts.yaml").write_text(ours(doc["script"]))
        (config / "edge_queue_mqtt.yaml").write_text(ours(doc["sensors"]).removeprefix("mqtt:\n"))
        log = config / "home-assistant.log"
        reload_yaml(h, inst)
        assert "script.edge_queue_transcribe_doorbell" in doc["card"]
        for eid in (
            "automation.edge_queue_send_me_the_transcript",
            "automation.edge_queue_tell_my_phone_when_a_job_ends",
        ):
            wait_state(h, inst, eid, lambda s, a: s == "on", f"{eid} loaded")
        wait_state(h, inst, "sensor.edge_queue_queued", lambda s, a: s == "0", "the page's sensors")
        wait_state(h, inst, e["job_finished"], lambda s, a: s != "unavailable", "the event entity")
        w = svc.watcher("reply/homeassistant/response/#", "jobs/+")
        answer = f"{svc.base}/reply/homeassistant/response/submit"
        # Home Assistant is a user edge-queue knows (before: then the page's script, on the
        # shared topic with a reply_to into Home Assistant's reply area, was refused)
        publish(broker, f"{svc.base}/request/kinds/homeassistant", "{}")
        wait_until(lambda: w.json_on(f"{svc.base}/reply/homeassistant/response/kinds"), 30, "the kinds answer")
        # When the dashboard button runs the script twice, 0.4 s apart, across a second boundary
        wait_until(lambda: 0.75 < time.time() % 1 < 0.85, 2, "a moment before a second boundary", interval=0.005)
        h.call_service(inst, "script", "turn_on", {"entity_id": "script.edge_queue_transcribe_doorbell"})
        time.sleep(0.4)  # the double tap itself
        h.call_service(inst, "script", "turn_on", {"entity_id": "script.edge_queue_transcribe_doorbell"})
        job_id = wait_until(lambda: w.json_on(answer), 30, "the submit")[0]["data"]["jobs"][0]["job_id"]
        w.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] == "succeeded", timeout=120)
        # Then one job, and each automation notifies once, with the transcript
        wait_until(lambda: len(notifications(h, inst)) >= 2, 30, "two notifications", interval=0.1)
        wait_state(h, inst, "script.edge_queue_transcribe_doorbell", lambda s, a: s == "off", "the script done")
        assert len(w.json_on(answer)) == 1, w.json_on(answer)
        sent = notifications(h, inst)
        assert len(sent) == 2 and all("country" in n["message"].lower() for n in sent), sent
        assert {n["title"] for n in sent} == {"Transcription succeeded", "transcribe succeeded"}, sent
        # The job sensor, pointed at the job, shows it
        (config / "edge_queue_mqtt.yaml").write_text(ours(doc["sensors"], job_id).removeprefix("mqtt:\n"))
        h.call_service(inst, "mqtt", "reload")
        wait_state(
            h,
            inst,
            "sensor.edge_queue_doorbell_job",
            lambda s, a: s == "succeeded" and "country" in a["text"].lower(),
            "job",
        )

        def restarted(what: str, sent: int = 2) -> None:
            """The event entity is back with its old event; no notification follows it
            (``sent``: the notifications of this run of Home Assistant before the restart)."""
            wait_state(
                h, inst, e["job_finished"], lambda s, a: s not in ("unavailable", "unknown"), f"back: {what}", 90
            )
            wait_state(h, inst, e["queued"], lambda s, a: s == "0", f"edge-queue's states: {what}", 90)
            time.sleep(2)  # a stale notification comes within milliseconds of the state's return
            assert len(notifications(h, inst)) == sent, (what, notifications(h, inst)[sent:])

        # When edge-queue restarts
        assert svc.stop() == 0
        wait_state(h, inst, e["job_finished"], lambda s, a: s == "unavailable", "unavailable")
        svc.start()
        restarted("edge-queue restart")
        # When the broker restarts
        h.broker_stop(broker.port)
        wait_until(lambda: not port_open("127.0.0.1", broker.port), 20, "the broker to be gone")
        h.broker_start(broker.port)
        restarted("broker restart")
        # When Home Assistant restarts
        restart_home_assistant(h, inst)
        restarted("Home Assistant restart", 0)
        # When the job is purged, its topic cleared: the sensor says deleted, without an error
        svc.request("purge", {"job_id": job_id}, svc.watcher("response/purge"))
        wait_state(h, inst, "sensor.edge_queue_doorbell_job", lambda s, a: s == "deleted", "deleted")
        errors = [x for x in log.read_text(errors="replace").splitlines() if " ERROR " in x]
        figures(home_assistant_errors=errors)
        assert not [x for x in errors if "value_json" in x or "edge_queue" in x or "template" in x.lower()], errors
        w.close()
    finally:
        svc.stop()


def test_the_blueprint_notifies_each_finished_job_once_also_after_home_assistant_was_down(ha, tmp_path: Path) -> None:
    """Issue 34, items 2 and 6: an automation from the repository's blueprint notifies once per
    finished job, with the transcript or the error; never again for an old job after a restart of
    edge-queue, the broker or Home Assistant; and, once Home Assistant is back, once for each job
    that ended while it was down."""
    h, inst, broker = ha
    svc = service(broker, tmp_path, [tmp_path], "data", "eqb-" + tmp_path.name[-8:])
    svc.start()
    config = Path(inst["config"])
    w = svc.watcher("response/#", "jobs/+")
    try:
        e = entities(h, inst, instance_id(svc), ["job_finished", "queued"])
        # Given an automation made from the blueprint, as its user makes it
        (config / "blueprints" / "automation" / "edge-queue").mkdir(parents=True, exist_ok=True)
        shutil.copy(BLUEPRINT, config / "blueprints" / "automation" / "edge-queue" / BLUEPRINT.name)
        (config / "automations.yaml").write_text(
            "- id: edge_queue_blueprint\n"
            "  alias: edge-queue to my phone\n"
            "  use_blueprint:\n"
            f"    path: edge-queue/{BLUEPRINT.name}\n"
            "    input:\n"
            f"      job_finished: {e['job_finished']}\n"
            "      notify_action: notify.mobile_app_my_phone\n"
        )
        for name in ("scripts.yaml", "edge_queue_mqtt.yaml"):
            (config / name).write_text("{}\n")
        reload_yaml(h, inst)
        wait_state(h, inst, "automation.edge_queue_to_my_phone", lambda s, a: s == "on", "the automation loaded")
        wait_state(h, inst, e["job_finished"], lambda s, a: s != "unavailable", "the event entity")

        def run(kind: str, options: dict[str, Any], state: str) -> str:
            body = {"kind": kind, "options": options, **({"input": "clip.wav"} if kind == "noop" else {})}
            job_id = svc.request("submit", body, w)["data"]["jobs"][0]["job_id"]
            w.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] == state)
            return str(job_id)

        # When a job succeeds and one fails: one notification each, the error in the second
        run("noop", {}, "succeeded")
        run("test_fail", {"code": "unsupported_media"}, "failed")
        wait_until(lambda: len(notifications(h, inst)) >= 2, 30, "two notifications", interval=0.1)
        sent = notifications(h, inst)
        assert [n["title"] for n in sent] == ["noop succeeded", "test_fail failed"], sent
        assert sent[1]["message"] == "unsupported_media: failing on purpose", sent

        def quiet(what: str, count: int) -> None:
            wait_state(h, inst, e["job_finished"], lambda s, a: s not in ("unavailable", "unknown"), what, 90)
            wait_state(h, inst, e["queued"], lambda s, a: s == "0", what, 90)
            time.sleep(2)  # a stale notification comes within milliseconds of the state's return
            assert len(notifications(h, inst)) == count, (what, notifications(h, inst)[count:])

        # When edge-queue and the broker restart: nothing old again
        assert svc.stop() == 0
        wait_state(h, inst, e["job_finished"], lambda s, a: s == "unavailable", "unavailable")
        svc.start()
        quiet("edge-queue restart", 2)
        h.broker_stop(broker.port)
        wait_until(lambda: not port_open("127.0.0.1", broker.port), 20, "the broker to be gone")
        h.broker_start(broker.port)
        quiet("broker restart", 2)
        # When jobs end while Home Assistant is down, and it comes back
        h.stop(inst)
        missed = [run("noop", {}, "succeeded"), run("test_fail", {"code": "decode_error"}, "failed")]
        restart_home_assistant(h, inst)
        # Then each of them is notified once, marked, and nothing older
        wait_until(lambda: len(notifications(h, inst)) >= 2, 30, "the missed jobs notified", interval=0.1)
        quiet("Home Assistant restart", 2)
        sent = notifications(h, inst)
        assert [n["title"] for n in sent] == [
            "noop succeeded (sent late: Home Assistant or the broker was away)",
            "test_fail failed (sent late: Home Assistant or the broker was away)",
        ], sent
        figures(missed_jobs=missed, notified_after_home_assistant_restart=sent)
        # And a restart of Home Assistant with nothing missed sends nothing
        restart_home_assistant(h, inst)
        quiet("Home Assistant restart, nothing missed", 0)
    finally:
        w.close()
        svc.stop()


@pytest.mark.usefixtures("model_installed")
def test_the_submit_script_hands_back_the_job_id(ha, tmp_path: Path, speech: Path) -> None:
    """Issue 46, item 7: the page's script edge_queue_submit, called from an automation as the
    page shows (and directly with return_response), submits with a kind and options and hands
    back the job id, or edge-queue's error."""
    h, inst, broker = ha
    doc = blocks()
    media = tmp_path / "media"
    media.mkdir()
    clip = media / "voicemail.flac"
    shutil.copy(speech / "jfk.flac", clip)
    svc = service(broker, tmp_path, [media], "data", "eqs-" + tmp_path.name[-8:])
    svc.start()
    config = Path(inst["config"])
    w = svc.watcher("jobs/+")
    try:

        def ours(text: str) -> str:
            return text.replace(DOC_BASE, svc.base + "/")

        # Given the page's sensors and scripts, and its automation that uses the script
        (config / "scripts.yaml").write_text(ours(doc["script"]))
        (config / "edge_queue_mqtt.yaml").write_text(ours(doc["sensors"]).removeprefix("mqtt:\n"))
        (config / "automations.yaml").write_text(ours(doc["script_use"]))
        reload_yaml(h, inst)
        ha_log = config / "home-assistant.log"
        log_start = ha_log.stat().st_size if ha_log.exists() else 0
        wait_state(h, inst, "script.edge_queue_submit", lambda s, a: s == "off", "the script loaded")
        wait_state(h, inst, "sensor.edge_queue_queued", lambda s, a: s == "0", "edge-queue seen")
        # When it is called with a kind and options, as an action with a response
        answer = h.ws_call(
            inst,
            "execute_script",
            sequence=[
                {
                    "action": "script.edge_queue_submit",
                    "data": {"input": str(clip), "kind": "transcribe", "options": {"formats": ["txt", "srt"]}},
                    "response_variable": "submitted",
                },
                {"stop": "done", "response_variable": "submitted"},
            ],
        )
        result = answer["response"]
        # Then it hands back the job's id, and the job runs with those options
        assert result["status"] == "ok" and not result["error"], answer
        # issue 52, row 17: a successful call logs no template warning (before: one per call,
        # `answer.error` absent from an ok answer)
        with open(ha_log, "rb") as f:
            f.seek(log_start)
            warned = [x for x in f.read().decode(errors="replace").splitlines() if "Template variable" in x]
        assert not [x for x in warned if "'error'" in x], warned[:4]
        job = w.wait_json(f"{svc.base}/jobs/{result['job_id']}", lambda m: m["state"] == "succeeded", timeout=120)
        assert job["options"]["formats"] == ["txt", "srt"] and job["input"] == str(clip), job
        # And a refused submit hands back edge-queue's error
        answer = h.ws_call(
            inst,
            "execute_script",
            sequence=[
                {
                    "action": "script.edge_queue_submit",
                    "data": {"input": "/etc/passwd"},
                    "response_variable": "submitted",
                },
                {"stop": "done", "response_variable": "submitted"},
            ],
        )
        refused = answer["response"]
        assert refused["status"] == "error" and not refused["job_id"] and refused["error"]["code"], refused
        # And the page's automation, fired by its event, queues the file through it
        h.ws_call(
            inst, "fire_event", event_type="folder_watcher", event_data={"event_type": "closed", "path": str(clip)}
        )
        wait_until(
            lambda: any("edge-queue: " in n["message"] and "error" not in n["message"] for n in notifications(h, inst)),
            30,
            "the automation's notification with the job id",
            interval=0.1,
        )
        figures(script_response=result, refused=refused, notified=notifications(h, inst))
    finally:
        w.close()
        svc.stop()


def test_the_logbook_exclusion_leaves_one_line_per_job() -> None:
    """Issue 52, row 20: the page's logbook exclusion names the entities that change at every
    job and have no unit (Home Assistant's logbook leaves sensors with a unit out by itself),
    and keeps the "Job finished" event: the entity ids Home Assistant makes from the device's
    names (its device name plus the entity's name, slugified), for a host and for the add-on."""
    import fnmatch

    import yaml

    from edge_queue.mqtt.topics import Topics
    from edge_queue.publish.discovery import device_config

    globs = yaml.safe_load(blocks()["logbook"])["logbook"]["exclude"]["entity_globs"]
    for device in ("edge-queue nas", "edge-queue"):
        config = device_config(Topics("edge-queue"), "abc", "nas", "1", name=device)
        slug = device.replace("-", "_").replace(" ", "_")
        ids = {
            key: f"{c['p']}.{slug}_{c['name'].lower().replace(' ', '_')}"
            for key, c in config["cmps"].items()
            if c["p"] in ("sensor", "event") and "unit_of_meas" not in c
        }
        excluded = {key for key, eid in ids.items() if any(fnmatch.fnmatch(eid, g) for g in globs)}
        assert excluded == {"current_job", "last_result", "submit_result"}, (device, ids, excluded)
