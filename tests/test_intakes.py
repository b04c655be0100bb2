"""The loop's intakes (docs/architecture.md, "The intakes"): every door is drained in one place,
before the scheduler, so a job from any door starts in the turn that took it."""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt

from .conftest import wait_until


def test_an_http_and_an_mqtt_submit_taken_in_one_turn_both_run_in_it(
    mosquitto: Any, speech: Path, tmp_path: Path
) -> None:
    # Given a real service (its store, its broker connection, two workers), idle
    from edge_queue.config.settings import Settings
    from edge_queue.service import Service

    base = "eqt" + uuid.uuid4().hex[:10]
    settings = Settings(
        data_dir=tmp_path / "data",
        media_roots=[speech],
        workers=2,
        cancel_grace_s=1,
        mqtt={"host": mosquitto.host, "port": mosquitto.port, "base_topic": base},
        access={"users": ["alice"], "shared_role": "admin"},
    )
    svc = Service(settings)
    svc.boot()
    try:
        wait_until(lambda: _idle(svc), 30, "the service to connect and settle")
        # When an MQTT submit has arrived (in the inbox, not yet taken) ...
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        client.connect(mosquitto.host, mosquitto.port)
        client.loop_start()
        body = json.dumps({"kind": "noop", "options": {"sleep_s": 5}})
        client.publish(f"{base}/request/submit", body, qos=1).wait_for_publish(10)
        wait_until(lambda: _pumped(svc), 10, "the request in the service's inbox")
        client.loop_stop()
        client.disconnect()
        # ... and an HTTP API call hands over its submit (as the API's thread does)
        upload = settings.uploads_dir / "alice" / "call.flac"
        upload.parent.mkdir(parents=True)
        shutil.copyfile(speech / "jfk.flac", upload)
        answered, ended = svc.http_intake.submit_and_wait(upload, {"task": "transcribe"}, "http:call:1", "alice")
        # and the loop runs one turn
        svc.tick(svc.clock())
        # Then both jobs were claimed in that very turn
        assert answered.done() and answered.result()["status"] == "ok", answered.result()
        http_job = answered.result()["data"]["jobs"][0]["job_id"]
        states = {j["job_id"]: (j["kind"], j["state"]) for j in svc.job_store().list_jobs()}
        assert states[http_job] == ("transcribe", "running"), states
        assert sorted(states.values()) == [("noop", "running"), ("transcribe", "running")], states
        ended.cancel()
    finally:
        svc.stop_now = True
        svc.shutdown()


def _idle(svc: Any) -> bool:
    svc.step(max_wait_s=0.05)
    return bool(svc.bridge.connected and not svc.bridge.inbox and not svc.republisher.active)


def _pumped(svc: Any) -> bool:
    svc.bridge.pump(time.monotonic())
    return bool(svc.bridge.inbox)
