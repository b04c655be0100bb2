"""End to end: the real service process against the system mosquitto and the embedded amqtt,
real speech, plain paho subscribers (docs/topics.md)."""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from .conftest import REFERENCE, Watcher, descendants, publish, wait_until, wer


def _states(watcher: Watcher, topic: str) -> list[str]:
    return [m["state"] for m in watcher.json_on(topic)]


@pytest.mark.usefixtures("model_installed")
@pytest.mark.slow
def test_transcribe_jfk_seen_by_subscribers(broker, service_factory, speech: Path) -> None:
    # Given a service with its own base topic and a plain subscriber on <base>/jobs/+
    svc = service_factory(broker, [speech]).start()
    watcher = svc.watcher("jobs/+", "response/#", "events", "queue")
    # When jfk.flac is submitted
    resp = svc.request("submit", {"input": str(speech / "jfk.flac")}, watcher)
    assert resp["status"] == "ok", resp
    assert resp["data"]["rejected"] == [] and resp["data"]["batch_id"] is None
    job_id = resp["data"]["jobs"][0]["job_id"]
    topic = f"{svc.base}/jobs/{job_id}"
    done = watcher.wait_json(topic, lambda m: m["state"] in ("succeeded", "failed"), timeout=120)
    # Then the retained topic went through running with progress to succeeded, in seq order
    # (a state replaced within the same loop turn, like queued here, is coalesced on the
    # retained topic: docs/topics.md, "Job state")
    assert done["state"] == "succeeded", done
    msgs = watcher.json_on(topic)
    states = [m["state"] for m in msgs]
    assert "running" in states and states[-1] == "succeeded"
    assert [m["seq"] for m in msgs] == sorted(m["seq"] for m in msgs)
    # and events carried every transition: new (queued), running, ..., end (succeeded)
    events = [e for e in watcher.json_on(f"{svc.base}/events") if e["job"]["job_id"] == job_id]
    assert events[0]["type"] == "new" and events[0]["job"]["state"] == "queued"
    assert events[1]["job"]["state"] == "running" and events[-1]["job"]["state"] == "succeeded"
    assert [e["job"]["seq"] for e in events] == sorted({e["job"]["seq"] for e in events})
    assert any(m["state"] == "running" and m["stage"] == "transcribing" for m in msgs)
    assert all(m["v"] == 1 for m in msgs)
    result = done["result"]
    assert wer(REFERENCE["jfk.flac"], result["text"]) <= 0.1, result["text"]
    assert result["language"] == "en" and result["duration_s"] == pytest.approx(11.0, abs=0.1)
    # English told by the bundled base, transcribed by tiny.en (named as the bundled model names itself)
    assert result["model"] == "tiny.en"
    # (the model's own probability, a number from 0 to 1 as docs/topics.md says: never a made-up 1.0)
    assert 0.5 <= result["language_probability"] < 1.0 and isinstance(result["language_probability"], float), result
    assert set(result["outputs"]) == {"txt", "srt", "vtt", "json"}
    for path in result["outputs"].values():
        assert Path(path).is_file() and Path(path).parent == svc.data_dir / "outputs" / job_id
    assert "-->" in Path(result["outputs"]["srt"]).read_text()
    assert done["attempt"] == 1 and done["finished_at"] and done["error"] is None
    # and exactly one "end" event for the job
    ends = [e for e in watcher.json_on(f"{svc.base}/events") if e["job"]["job_id"] == job_id and e["type"] == "end"]
    assert len(ends) == 1
    watcher.close()
    # And a subscriber that connects after the end still gets the retained succeeded state
    late = svc.watcher(f"jobs/{job_id}")
    late_msg = late.wait_json(topic, lambda m: True, timeout=10)
    assert late_msg["state"] == "succeeded" and late_msg["seq"] == done["seq"]
    assert [r for t, _p, r, _at in late.messages if t == topic][0] is True  # delivered as retained
    late.close()


@pytest.mark.slow
@pytest.mark.usefixtures("model_installed")
def test_batch_of_librivox_clips(broker, service_factory, speech: Path) -> None:
    svc = service_factory(broker, [speech]).start()
    watcher = svc.watcher("batches/+", "response/#", "jobs/+")
    clips = ["librivox-0870.wav", "librivox-0890.wav", "librivox-0930.wav"]
    resp = svc.request("submit", {"inputs": [str(speech / c) for c in clips]}, watcher)
    assert resp["status"] == "ok", resp
    batch_id = resp["data"]["batch_id"]
    assert batch_id and len(resp["data"]["jobs"]) == 3
    batch = watcher.wait_json(f"{svc.base}/batches/{batch_id}", lambda b: b["done"], timeout=180)
    assert batch["total"] == 3 and batch["counts"]["succeeded"] == 3, batch
    assert sorted(batch["job_ids"]) == sorted(j["job_id"] for j in resp["data"]["jobs"])
    for job in resp["data"]["jobs"]:
        final = watcher.json_on(f"{svc.base}/jobs/{job['job_id']}")[-1]
        assert final["batch_id"] == batch_id
        assert wer(REFERENCE[Path(final["input"]).name], final["result"]["text"]) <= 0.1


@pytest.mark.usefixtures("model_installed", "mosquitto_clients")
@pytest.mark.slow
def test_mosquitto_pub_bare_path(mosquitto, service_factory, speech: Path) -> None:
    svc = service_factory(mosquitto, [speech]).start()
    watcher = svc.watcher("jobs/+", "response/submit")
    # The real mosquitto_pub binary, a bare path as payload
    subprocess.run(
        [
            "mosquitto_pub",
            "-h",
            mosquitto.host,
            "-p",
            str(mosquitto.port),
            "-q",
            "1",
            "-t",
            f"{svc.base}/request/submit",
            "-m",
            str(speech / "jfk.flac"),
        ],
        check=True,
        timeout=10,
    )
    resp = watcher.wait_json(f"{svc.base}/response/submit", lambda m: True)
    assert resp["status"] == "ok" and resp["transaction"] is None
    job_id = resp["data"]["jobs"][0]["job_id"]
    done = watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] == "succeeded", timeout=120)
    assert done["kind"] == "transcribe"
    # mosquitto_sub, as a user would read the retained state
    out = subprocess.run(
        [
            "mosquitto_sub",
            "-h",
            mosquitto.host,
            "-p",
            str(mosquitto.port),
            "-C",
            "1",
            "-W",
            "10",
            "-t",
            f"{svc.base}/jobs/{job_id}",
        ],
        capture_output=True,
        check=True,
        timeout=15,
    )
    assert json.loads(out.stdout)["state"] == "succeeded"


def test_bad_requests_get_one_error_each(broker, service_factory, speech: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.wav"
    outside.write_bytes(b"RIFF")
    svc = service_factory(broker, [speech]).start()
    watcher = svc.watcher("response/#", "jobs/+")
    cases = [
        ("submit", b'{"input": ', "invalid_json"),
        ("frobnicate", {"x": 1}, "unknown_command"),
        ("submit", {"kind": "paint", "input": str(speech / "jfk.flac")}, "unknown_kind"),
        ("submit", {"input": str(speech / "missing.flac")}, "input_not_found"),
        ("submit", {"input": str(outside)}, "input_outside_media_roots"),
        (
            "submit",
            {"input": str(speech / ".." / ".." / "shared" / "media" / ".." / ".." / "etc" / "passwd")},
            "input_outside_media_roots",
        ),
        ("submit", {"input": str(speech / "jfk.flac"), "priority": "high"}, "invalid_request"),
        ("submit", {"input": str(speech / "jfk.flac"), "options": {"beam_size": 99}}, "invalid_request"),
        ("submit", {"kind": "noop", "options": {"sleep_s": "1"}}, "invalid_request"),
        ("get", {"job_id": "nosuchjob"}, "not_found"),
        ("cancel", {}, "invalid_request"),
        ("list", b"[1, 2]", "invalid_request"),
        ("submit", b"x" * (300 * 1024), "payload_too_large"),
        ("get", b"\xff\xfe", "invalid_json"),
    ]
    for command, payload, code in cases:
        resp = svc.request(command, payload, watcher)
        assert resp["status"] == "error", (command, payload, resp)
        assert resp["error"]["code"] == code, (command, payload, resp)
        assert resp["error"]["message"] and resp["v"] == 1
    # every request got exactly one response
    assert sum(len(watcher.on(t)) for t in {t for t, *_ in watcher.messages if "/response/" in t}) == len(cases)
    assert watcher.json_on(f"{svc.base}/response/unknown")[0]["error"]["code"] == "unknown_command"
    # a field error names the field
    bad = [m for m in watcher.json_on(f"{svc.base}/response/submit") if m["error"]["code"] == "invalid_request"]
    assert {m["error"]["field"] for m in bad} == {"priority", "options.beam_size", "options.sleep_s"}
    # a mixed submit: the bad input is listed, the good one still runs
    resp = svc.request(
        "submit", {"kind": "probe", "inputs": [str(speech / "jfk.flac"), str(speech / "nope.wav")]}, watcher
    )
    assert resp["status"] == "ok"
    assert [r["code"] for r in resp["data"]["rejected"]] == ["input_not_found"]
    job_id = resp["data"]["jobs"][0]["job_id"]
    done = watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] == "succeeded", timeout=60)
    assert done["result"]["duration_s"] == pytest.approx(11.0, abs=0.1)
    # and no job was created by the bad requests
    listed = svc.request("list", {}, watcher)
    assert [j["job_id"] for j in listed["data"]["jobs"]] == [job_id]
    assert svc.proc is not None and svc.proc.poll() is None


def test_a_used_idempotency_key_returns_the_first_jobs_whatever_the_payload_says(
    broker, service_factory, tmp_path: Path
) -> None:
    # Given a submit with an idempotency key whose file is then deleted (a client that lost
    # the response resends the same request later; docs/topics.md, "Duplicates")
    media = tmp_path / "media"
    media.mkdir()
    clip = media / "clip.wav"
    clip.write_bytes(b"RIFF not really a wav")
    svc = service_factory(broker, [media]).start()
    watcher = svc.watcher("response/#")
    first = svc.request("submit", {"kind": "probe", "input": str(clip), "idempotency_key": "clip-1"}, watcher)
    assert first["status"] == "ok", first
    job_id = first["data"]["jobs"][0]["job_id"]
    clip.unlink()
    # When the key comes again with the file gone, an unknown kind, or a path outside the roots
    for again in (
        {"kind": "probe", "input": str(clip)},
        {"kind": "nope", "input": str(clip)},
        {"kind": "probe", "input": "/etc/passwd"},
        {"kind": "noop", "options": {"nope": 1}},
    ):
        resp = svc.request("submit", {**again, "idempotency_key": "clip-1"}, watcher)
        # Then each gets the first job, as a duplicate, and no new job is made
        assert resp["status"] == "ok", (again, resp)
        assert resp["data"]["jobs"] == [{"job_id": job_id, "input": str(clip), "duplicate": True}], resp
    # while a payload the request model refuses is still refused (docs/topics.md, "Order of checks")
    bad = svc.request("submit", {"kind": "probe", "priority": 1000, "idempotency_key": "clip-1"}, watcher)
    assert bad["status"] == "error" and bad["error"]["field"] == "priority", bad
    # and a free key still gets the checks
    fresh = svc.request("submit", {"kind": "probe", "input": str(clip), "idempotency_key": "clip-2"}, watcher)
    assert fresh["error"]["code"] == "input_not_found", fresh
    listed = svc.request("list", {}, watcher)
    assert [j["job_id"] for j in listed["data"]["jobs"]] == [job_id], listed


def test_list_input_contains_takes_every_character_literally(mosquitto, service_factory, tmp_path: Path) -> None:
    """docs/topics.md, ``list``: ``input_contains`` is matched as typed, NUL and other control
    characters and LIKE's ``%`` and ``_`` included (a NUL once cut the pattern short, so that
    it matched every job)."""
    # Given jobs whose inputs hold %, _, a tab and a newline, and one plain name
    media = tmp_path / "media"
    media.mkdir()
    names = ["100%_done.wav", "x_yz.wav", "tab\there.wav", "line\nyz.wav", "plain.wav"]
    for name in names:
        (media / name).write_bytes(b"RIFF not really a wav")
    svc = service_factory(mosquitto, [media]).start()
    watcher = svc.watcher("response/#")
    assert svc.request("pause", {}, watcher)["status"] == "ok"
    for name in names:
        resp = svc.request("submit", {"kind": "probe", "input": str(media / name)}, watcher)
        assert resp["status"] == "ok", resp

    def found(text: str) -> list[str]:
        resp = svc.request("list", {"input_contains": text, "count": True}, watcher)
        assert resp["status"] == "ok", resp
        assert resp["data"]["total"] == len(resp["data"]["jobs"]), resp
        return sorted(Path(j["input"]).name for j in resp["data"]["jobs"])

    # When the text holds characters no path, or only some paths, hold; Then only those match
    assert found("\x00") == [] and found("plain\x00") == [] and found("\x00%") == []
    assert found("%") == ["100%_done.wav"]
    # (as a LIKE pattern, "_yz" also matched "line\nyz" and "%_do" any path holding "do")
    assert found("_yz") == ["x_yz.wav"] and found("%_do") == ["100%_done.wav"]
    assert found("\t") == ["tab\there.wav"] and found("\n") == ["line\nyz.wav"]
    assert found("\x7f") == [] and found("PLAIN") == ["plain.wav"]
    assert len(found("wav")) == len(names)


def test_retained_submit_is_not_executed(broker, service_factory, speech: Path) -> None:
    svc = service_factory(broker, [speech])
    # Given a retained submit waiting on the broker before the service starts
    publish(broker, f"{svc.base}/request/submit", json.dumps({"kind": "noop"}), retain=True)
    watcher = svc.watcher("response/#", "jobs/+", "request/submit")
    svc.start()
    # Then it is answered with an error, cleared from the broker, and no job exists
    resp = watcher.wait_json(f"{svc.base}/response/submit", lambda m: True)
    assert resp["status"] == "error" and "retained" in resp["error"]["message"]
    wait_until(lambda: b"" in watcher.on(f"{svc.base}/request/submit"), 10, "the retained request to be cleared")
    listed = svc.request("list", {}, watcher)
    assert listed["data"]["jobs"] == []
    fresh = svc.watcher("request/submit")  # nothing retained any more
    assert fresh.on(f"{svc.base}/request/submit") in ([], [b""])
    fresh.close()


def test_noop_cancel_and_reply_to(broker, service_factory, speech: Path) -> None:
    svc = service_factory(broker, [speech]).start()
    reply = f"{svc.base}/reply/{uuid.uuid4().hex[:8]}"
    watcher = svc.watcher("response/#", "jobs/+", "reply/#", "events")
    resp = svc.request("submit", {"kind": "noop", "options": {"sleep_s": 30}, "reply_to": reply}, watcher)
    assert resp["status"] == "ok"
    assert wait_until(lambda: watcher.json_on(reply), 10, "the copy on reply_to")[0] == resp  # the same response
    job_id = resp["data"]["jobs"][0]["job_id"]
    topic = f"{svc.base}/jobs/{job_id}"
    watcher.wait_json(topic, lambda m: m["state"] == "running")
    resp = svc.request("cancel", {"job_id": job_id}, watcher)
    assert resp["data"] == {"cancelled": [], "cancelling": [job_id], "more": False}
    final = watcher.wait_json(topic, lambda m: m["state"] == "cancelled", timeout=15)
    assert final["error"]["code"] == "cancelled"
    # (cancelling may last under the 20 ms the retained topic coalesces; events carry it)
    assert "cancelling" in [j["state"] for j in watcher.job_events(svc.base, job_id)]
    # an invalid reply_to is refused without executing
    resp = svc.request("submit", {"kind": "noop", "reply_to": f"{svc.base}/jobs/x"}, watcher)
    assert resp["status"] == "error" and resp["error"]["field"] == "reply_to"


def _v5_reply_client(broker: Any, base: str) -> tuple[Any, Any, list[tuple[str, bytes, bytes | None]]]:
    """An MQTT 5 client subscribed to a fresh topic under ``<base>/reply/``; returns it, the
    PUBLISH properties that name that topic as the Response Topic, and the list its messages
    arrive in as (topic, payload, Correlation Data)."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    got: list[tuple[str, bytes, bytes | None]] = []
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="v5-" + uuid.uuid4().hex[:8], protocol=mqtt.MQTTv5)
    client.on_message = lambda c, u, m: got.append(
        (m.topic, bytes(m.payload), getattr(m.properties, "CorrelationData", None))
    )
    client.connect(broker.host, broker.port)
    client.loop_start()
    props = Properties(PacketTypes.PUBLISH)
    props.ResponseTopic = f"{base}/reply/phones/{uuid.uuid4().hex[:8]}"
    client.subscribe(props.ResponseTopic, 1)
    return client, props, got


def test_mqtt5_response_topic_and_correlation_data(mosquitto, service_factory, speech: Path) -> None:
    svc = service_factory(mosquitto, [speech]).start()
    client, props, got = _v5_reply_client(mosquitto, svc.base)
    my_topic = props.ResponseTopic
    props.CorrelationData = b"\x01corr"
    client.publish(f"{svc.base}/request/list", b"{}", qos=1, properties=props).wait_for_publish(10)
    topic, payload, corr = wait_until(lambda: got[0] if got else None, 15, "the MQTT 5 response")
    client.disconnect()
    client.loop_stop()
    assert topic == my_topic and corr == b"\x01corr"
    assert json.loads(payload)["status"] == "ok"


def test_errors_for_our_topic_only_send_no_copies_and_transactions_count_utf8_bytes(
    mosquitto, service_factory, speech: Path
) -> None:
    """docs/topics.md, "Where the response goes" and "Order of checks": an invalid ``reply_to``
    and a payload over ``max_payload_bytes`` are answered on ``<base>/response/<command>``
    only, not on the request's MQTT 5 Response Topic; a transaction over 1,024 bytes of JSON
    is refused before the command is looked at; the bytes are UTF-8 bytes (600 of them as 300
    "é" are echoed, not refused as their 1,800 characters of escapes)."""
    svc = service_factory(mosquitto, [speech], {"EDGE_QUEUE_MAX_PAYLOAD_BYTES": "4096"}).start()
    watcher = svc.watcher("response/#")
    client, props, raw = _v5_reply_client(mosquitto, svc.base)

    def send(command: str, payload: bytes) -> None:
        client.publish(f"{svc.base}/request/{command}", payload, qos=1, properties=props).wait_for_publish(10)

    send("submit", b'{"kind": "noop", "transaction": "bad-reply-to", "reply_to": "elsewhere"}')
    send("get", b'{"job_id": "x", "transaction": "too-big", "pad": "' + b"x" * 5000 + b'"}')
    send("bogus", json.dumps({"transaction": "t" * 2000}).encode())
    accented = "é" * 300
    send("list", json.dumps({"transaction": accented}).encode())
    # the last one's copy comes after any copy of the ones before (one client, in order)
    wait_until(lambda: [p for t, p, c in raw if json.loads(p).get("transaction") == accented], 30, "the last copy")
    client.disconnect()
    client.loop_stop()
    got = [(t, json.loads(p)) for t, p, c in raw]
    assert [b["transaction"] for t, b in got] == [None, accented], got  # bogus: an error, with a copy
    assert got[0][1]["error"] == {
        "code": "invalid_request",
        "message": got[0][1]["error"]["message"],
        "field": "transaction",
    }
    assert got[1][1]["status"] == "ok"
    # and each was answered on <base>/response/<command>
    refused = wait_until(
        lambda: [m for m in watcher.json_on(f"{svc.base}/response/submit") if m["transaction"] == "bad-reply-to"],
        15,
        "the reply_to error",
    )
    assert refused[0]["error"]["field"] == "reply_to"
    too_large = wait_until(lambda: watcher.json_on(f"{svc.base}/response/get"), 15, "the payload_too_large error")
    assert too_large[0]["error"]["code"] == "payload_too_large"
    unknown = wait_until(lambda: watcher.json_on(f"{svc.base}/response/unknown"), 15, "the transaction error")
    assert unknown[0]["error"]["field"] == "transaction" and unknown[0]["transaction"] is None


def test_reply_to_of_any_kind_is_checked_first_and_a_users_topic_stays_theirs(
    mosquitto, service_factory, speech: Path
) -> None:
    """docs/topics.md, "Order of checks" step 3 and "Who sent a request": a ``reply_to`` that is
    not a usable string (a number, a lone surrogate, over 1,024 characters) is refused like one
    outside the prefix, before the command and the role are looked at, on
    ``<base>/response/<command>`` only; a request on ``<base>/request//<user>`` (an empty
    command level, which the ACL pattern ``request/+/%u`` lets that user publish on) is that
    user's: its answer goes under ``<base>/reply/<user>/`` and never to another user's topic."""
    svc = service_factory(mosquitto, [speech]).start()
    watcher = svc.watcher("response/#", "reply/#")
    client, props, raw = _v5_reply_client(mosquitto, svc.base)

    def send(topic: str, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        client.publish(f"{svc.base}/{topic}", body, qos=1, properties=props).wait_for_publish(10)

    send("request/bogus", {"transaction": "number", "reply_to": 5})
    send("request/kinds", {"transaction": "surrogate", "reply_to": f"{svc.base}/reply/x/\ud800"})
    send("request/list", {"transaction": "long", "reply_to": f"{svc.base}/reply/" + "x" * 1100})
    alice = f"{svc.base}/reply/alice/response/submit"
    send("request//bob", {"transaction": "forged", "reply_to": alice})
    send("request//bob", {"transaction": "bob's own"})
    send("request/list", {"transaction": "last"})
    # the last one's copy comes after any copy of the ones before (one client, in order)
    wait_until(lambda: [p for t, p, c in raw if json.loads(p).get("transaction") == "last"], 30, "the last copy")
    client.disconnect()
    client.loop_stop()
    assert [json.loads(p)["transaction"] for t, p, c in raw] == ["last"]

    def answer(topic: str, tx: str) -> dict[str, Any]:
        return wait_until(
            lambda: next((m for m in watcher.json_on(f"{svc.base}/{topic}") if m.get("transaction") == tx), None),
            15,
            f"the answer to {tx} on {topic}",
        )

    for topic, tx in (("response/unknown", "number"), ("response/kinds", "surrogate"), ("response/list", "long")):
        err = answer(topic, tx)["error"]
        assert (err["code"], err["field"]) == ("invalid_request", "reply_to"), err
    forged = answer("reply/bob/response/unknown", "forged")["error"]
    assert (forged["code"], forged["field"]) == ("invalid_request", "reply_to")
    assert answer("reply/bob/response/unknown", "bob's own")["error"]["code"] == "unknown_command"
    answer("response/list", "last")
    assert not watcher.json_on(alice) and not watcher.json_on(f"{svc.base}/response/unknown")[1:]


def test_republish_and_worker_replaced_after_kill(broker, service_factory, speech: Path) -> None:
    import os
    import signal

    svc = service_factory(broker, [speech]).start()
    watcher = svc.watcher("response/#", "jobs/+", "queue", "info", "events")
    resp = svc.request("submit", {"kind": "noop", "options": {"sleep_s": 20}}, watcher)
    job_id = resp["data"]["jobs"][0]["job_id"]
    topic = f"{svc.base}/jobs/{job_id}"
    watcher.wait_json(topic, lambda m: m["state"] == "running")
    # When the worker process running the job is killed with SIGKILL
    children = descendants(svc.proc.pid)
    queue_msg = watcher.wait_json(f"{svc.base}/queue", lambda q: q["counts"]["running"] == 1)
    assert queue_msg["workers_alive"] == 2
    victim = queue_msg["running"][0]["worker_pid"]
    assert victim in children
    os.kill(victim, signal.SIGKILL)
    # Then the job is retried at once on a new worker (attempt 2), and later cancelled cleanly
    retried = watcher.wait_json(topic, lambda m: m["state"] == "running" and m["attempt"] == 2, timeout=15)
    assert retried["attempt"] == 2
    # (retrying -> running happened in one loop turn: the retained topic may show only the
    # latter; events carry both)
    states = [j["state"] for j in watcher.job_events(svc.base, job_id)]
    assert "retrying" in states
    retrying = [j for j in watcher.job_events(svc.base, job_id) if j["state"] == "retrying"][0]
    assert retrying["error"]["code"] == "worker_lost"
    # on a replacement worker: a new process under the service
    again = watcher.wait_json(
        f"{svc.base}/queue",
        lambda q: q["running"] and q["running"][0]["worker_pid"] not in (None, victim) and q["workers_alive"] == 2,
    )
    assert again["running"][0]["worker_pid"] in descendants(svc.proc.pid)
    wait_until(lambda: victim not in descendants(svc.proc.pid), 15, "the killed worker to be reaped")
    svc.request("cancel", {"job_id": job_id}, watcher)
    watcher.wait_json(topic, lambda m: m["state"] == "cancelled")
    # republish sends every retained topic again
    n_info = len(watcher.on(f"{svc.base}/info"))
    n_job = len(watcher.on(topic))
    assert svc.request("republish", {}, watcher)["status"] == "ok"
    wait_until(
        lambda: len(watcher.on(f"{svc.base}/info")) > n_info and len(watcher.on(topic)) > n_job,
        10,
        "republished topics",
    )


def test_embedded_broker_sends_retained_messages_only_to_their_subscribers(amqtt) -> None:
    # amqtt 0.12.1 alone sends a new client the retained messages of every other client's
    # subscriptions; the embedded broker must not.
    publish(amqtt, "x/jobs/1", b"state", retain=True)
    first = Watcher(amqtt.host, amqtt.port, ["x/jobs/1"])
    wait_until(lambda: first.on("x/jobs/1") == [b"state"], 10, "the retained message for its subscriber")
    other = Watcher(amqtt.host, amqtt.port, ["c/d"])
    publish(amqtt, "c/d", b"mine")
    wait_until(lambda: other.on("c/d") == [b"mine"], 10, "the client's own message")
    assert [t for t, *_ in other.messages] == ["c/d"]
    first.close()
    other.close()


def test_coalesced_retained_state_ends_final_and_events_carry_every_transition(
    broker, service_factory, speech: Path
) -> None:
    # Given a subscriber of the job topics and of events, and noop jobs that finish within the
    # 20 ms in which a non-final retained state is held back (docs/topics.md, "Job state")
    svc = service_factory(broker, [speech]).start()
    watcher = svc.watcher("jobs/+", "events", "response/#")
    resp = svc.request("submit", {"kind": "noop", "inputs": [f"c{i}" for i in range(50)]}, watcher)
    ids = [j["job_id"] for j in resp["data"]["jobs"]]
    for job_id in ids:
        watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] == "succeeded")
    for job_id in ids:
        # Then the last retained state is the final one, with a seq above every state seen before
        states = watcher.json_on(f"{svc.base}/jobs/{job_id}")
        assert states[-1]["state"] == "succeeded"
        assert all(s["seq"] < states[-1]["seq"] for s in states[:-1])
        assert [s["seq"] for s in states] == sorted({s["seq"] for s in states})
        # and events carried every transition, in order: queued (new), running, succeeded (end)
        events = [e for e in watcher.json_on(f"{svc.base}/events") if e["job"]["job_id"] == job_id]
        assert [(e["type"], e["job"]["state"]) for e in events] == [
            ("new", "queued"),
            ("update", "running"),
            ("end", "succeeded"),
        ]
        assert [e["job"]["seq"] for e in events] == sorted({e["job"]["seq"] for e in events})
        assert events[-1]["job"] == states[-1]  # the same final state on both
    # And most of them were published once on the retained topic: coalescing happened
    assert sum(len(watcher.json_on(f"{svc.base}/jobs/{j}")) for j in ids) < 3 * len(ids)
    watcher.close()


@pytest.fixture
def nagle_service(tmp_path: Path, service_factory, speech: Path) -> Iterator[Any]:
    """A service on a private mosquitto configured as it ships: Nagle's algorithm on (no
    ``set_tcp_nodelay``); stopped (exit 0 asserted), then the broker."""
    from .helpers.brokers import PrivateMosquitto

    broker = PrivateMosquitto(tmp_path / "mosquitto", tcp_nodelay=False)
    try:
        svc = service_factory(broker, [speech.parent], {"EDGE_QUEUE_LOG_LEVEL": "WARNING"}).start()
        yield svc
        assert svc.stop() == 0
    finally:
        broker.stop()


@pytest.mark.serial  # a bound of 20 ms on latency: other tests' load breaks it
def test_a_request_right_after_a_job_is_not_held_by_a_broker_with_nagles_algorithm_on(nagle_service) -> None:
    # Given a mosquitto configured as it ships (Nagle's algorithm on), and a client that
    # publishes each request as soon as it sees the previous job end, on a connection that
    # sends without delay (TCP_NODELAY), as edge-queue's own client does
    svc, broker = nagle_service, nagle_service.broker
    watcher = svc.watcher("response/submit", "events")
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="pub-" + uuid.uuid4().hex[:8])
    client.connect(broker.host, broker.port)
    client.socket().setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    client.loop_start()
    waits = []
    for i in range(15):
        t0 = time.monotonic()
        client.publish(
            f"{svc.base}/request/submit", json.dumps({"kind": "noop", "transaction": f"t{i}"}), qos=1
        ).wait_for_publish(10)
        response = watcher.wait_json(f"{svc.base}/response/submit", lambda m, i=i: m.get("transaction") == f"t{i}")
        seen = next(
            t for topic, p, _, t in watcher.messages if topic.endswith("/response/submit") and f'"t{i}"' in p.decode()
        )
        waits.append(seen - t0)
        job_id = response["data"]["jobs"][0]["job_id"]
        watcher.wait_json(
            f"{svc.base}/events", lambda e, j=job_id: e["job"]["job_id"] == j and e["job"]["state"] == "succeeded"
        )
    client.loop_stop()
    client.disconnect()
    watcher.close()
    # Then each is answered without waiting for the TCP acknowledgement that Linux delays
    # up to 40 ms: the broker holds a request for edge-queue until edge-queue has
    # acknowledged what the broker sent it last, the PUBACKs of the job's last states
    # (docs/operations.md, "Requests answered 30-90 ms late"). Without the service's prompt
    # acknowledgement the median was 33-37 ms; with it, 1-3 ms.
    assert statistics.median(waits) < 0.020, [round(w * 1000, 1) for w in waits]


@pytest.mark.serial  # a bound of 20 ms on latency: other tests' load breaks it
def test_the_command_lines_requests_are_not_held_by_a_broker_with_nagles_algorithm_on(nagle_service) -> None:
    # Given a mosquitto configured as it ships (no set_tcp_nodelay) and the command line's
    # client, which publishes each request and reads its response on one connection
    from edge_queue.config.settings import MqttSettings
    from edge_queue.mqtt.request_client import RequestClient

    svc, broker = nagle_service, nagle_service.broker
    client = RequestClient(MqttSettings(host=broker.host, port=broker.port, base_topic=svc.base))
    waits = []
    for _ in range(15):
        t0 = time.monotonic()
        assert client.request("submit", {"kind": "noop"})["status"] == "ok"
        waits.append(time.monotonic() - t0)
    client.close()
    # Then each response comes without waiting for the TCP acknowledgement of the
    # broker's PUBACK, which Linux delays up to 40 ms and the broker waits for before it
    # sends the response (docs/operations.md, "Requests answered 30-90 ms late"): 44 ms
    # at the median without the client's prompt acknowledgement, 2-3 ms with it.
    assert statistics.median(waits) < 0.020, [round(w * 1000, 1) for w in waits]
