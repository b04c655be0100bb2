"""Who said what through the real service (docs/topics.md, "Speakers"; docs/http-api.md): a
two-voice conversation built from the shared clips, with an exact reference, sent through every
door with diarize: ``POST /asr?diarize=true``, OpenAI's own client (``diarized_json``,
``gpt-4o-transcribe-diarize``, known speakers refused), a ``submit`` published by mosquitto_pub,
and a watch folder whose rule asks for it; ``max_speakers`` below ``min_speakers`` refused at
submit over MQTT; a job whose weights are damaged failed at once. One transcription per test."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import warnings
from pathlib import Path
from typing import Any

import httpx
import pytest

from edge_queue.kinds.voice_encoder import weights_path
from edge_queue.requests.outputs import cues

from .conftest import publish, wait_until
from .helpers.conversation import conversation, need_voice_model, voice_of
from .helpers.http_api import KEY, api_service, jobs_listed


@pytest.mark.slow
def test_asr_labels_a_two_voice_conversation_with_the_right_speakers(
    service_factory: Any, mosquitto: Any, speech: Path, tmp_path: Path, model_installed: None
) -> None:
    need_voice_model()
    # Given a conversation of two voices with an exact reference
    media = tmp_path / "media"
    media.mkdir()
    ref = conversation(speech, media / "talk.wav")
    svc, url = api_service(service_factory, mosquitto, media)
    audio = (media / "talk.wav").read_bytes()

    # When it is transcribed with diarize through whisper-asr-webservice's route
    def asr(output: str, **params: str) -> httpx.Response:
        query = {"diarize": "true", "language": "en", "output": output, **params}
        return httpx.post(url + "/asr", params=query, files={"audio_file": ("talk.wav", audio)}, timeout=300)

    answer = asr("json")
    assert answer.status_code == 200, answer.text
    document = answer.json()

    # Then two speakers are found, and each segment carries the speaker of the voice speaking it
    assert document["speakers"] == 2
    segments = document["segments"]
    names = {voice_of(s, ref): s["speaker"] for s in segments}
    assert names == {"jfk": "SPEAKER_00", "reader": "SPEAKER_01"}
    wrong = [s for s in segments if s["speaker"] != names[voice_of(s, ref)]]
    assert not wrong, wrong
    assert all(a["end"] <= b["start"] for a, b in zip(segments, segments[1:], strict=False))

    # The subtitles show who speaks where the speaker changes (the same job: nothing decoded again)
    srt = asr("srt").text
    assert srt.count("[SPEAKER_00] ") == 2 and srt.count("[SPEAKER_01] ") == 2, srt
    # and its cues still never overlap and stay within 7 s
    shown = cues(srt, "srt")
    assert all(a["end"] <= b["start"] for a, b in zip(shown, shown[1:], strict=False))
    assert all(c["end"] - c["start"] <= 7.0 + 1e-3 for c in shown)
    vtt = asr("vtt").text
    assert "<v SPEAKER_00>" in vtt and "<v SPEAKER_01>" in vtt
    assert [line.split("]")[0] for line in asr("txt").text.splitlines()] == ["[SPEAKER_00", "[SPEAKER_01"] * 2
    # the job's own result carries the count found
    with svc.watcher("response/#") as w:
        jobs = svc.request("list", {}, w)["data"]["jobs"]
        assert [j["result"]["speakers"] for j in jobs if j["kind"] == "transcribe"] == [2]

        # max_speakers below min_speakers is refused at submit, naming the field
        options = {"diarize": True, "min_speakers": 3, "max_speakers": 2}
        refused = svc.request("submit", {"input": str(media / "talk.wav"), "options": options}, w)
    assert refused["status"] == "error", refused
    assert refused["error"]["code"] == "invalid_request" and refused["error"]["field"] == "options.max_speakers"
    bad = asr("json", min_speakers="3", max_speakers="2")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request", bad.text
    assert json.loads(asr("json", max_speakers="two").text)["error"]["code"] == "invalid_request"


@pytest.mark.slow
def test_openai_package_reads_the_speakers_of_a_two_voice_conversation(
    service_factory: Any, mosquitto: Any, speech: Path, tmp_path: Path, model_installed: None
) -> None:
    from openai import BadRequestError, OpenAI
    from openai.types.audio import TranscriptionDiarized

    need_voice_model()
    # Given a conversation of two voices with an exact reference, and OpenAI's own client
    media = tmp_path / "media"
    media.mkdir()
    talk = media / "talk.wav"
    ref = conversation(speech, talk)
    svc, url = api_service(service_factory, mosquitto, media)
    client = OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == ["whisper-1", "gpt-4o-transcribe-diarize"]
    assert client.models.retrieve("gpt-4o-transcribe-diarize").id == "gpt-4o-transcribe-diarize"

    # When it asks for speakers in OpenAI's way (chunking_strategy as OpenAI needs it past 30 s)
    with open(talk, "rb") as f:
        diarized = client.audio.transcriptions.create(
            model="gpt-4o-transcribe-diarize",
            file=f,
            response_format="diarized_json",
            chunking_strategy="auto",
            language="en",
        )

    # Then the answer is OpenAI's diarized shape, each segment with the speaker of its voice
    assert isinstance(diarized, TranscriptionDiarized), diarized
    assert diarized.task == "transcribe" and abs(diarized.duration - ref[-1][2]) < 1.0, diarized
    assert diarized.usage is not None and diarized.usage.type == "duration"
    segments = diarized.segments
    assert [s.id for s in segments] == [f"seg_{i}" for i in range(len(segments))]
    assert {s.type for s in segments} == {"transcript.text.segment"}
    names = {voice_of(s.model_dump(), ref): s.speaker for s in segments}
    assert names == {"jfk": "A", "reader": "B"}, segments
    wrong = [s for s in segments if s.speaker != names[voice_of(s.model_dump(), ref)]]
    assert not wrong, wrong
    assert all(a.end <= b.start for a, b in zip(segments, segments[1:], strict=False))
    assert "fellow Americans" in diarized.text and "dashwood" in diarized.text.lower()
    assert diarized.text.split() == " ".join(s.text for s in segments).split()

    # verbose_json with diarize asked our way (a form field, as /asr's parameter) carries each
    # segment's speaker as the job's files name it; the same options: the same job
    with open(talk, "rb") as f:
        verbose = client.audio.transcriptions.create(
            model="whisper-1", file=f, response_format="verbose_json", language="en", extra_body={"diarize": True}
        )
    labelled = [
        {"start": s.start, "end": s.end, "speaker": (s.model_extra or {}).get("speaker")}
        for s in verbose.segments or []
    ]
    assert {voice_of(s, ref): s["speaker"] for s in labelled} == {"jfk": "SPEAKER_00", "reader": "SPEAKER_01"}
    assert all(s["speaker"] == {"jfk": "SPEAKER_00", "reader": "SPEAKER_01"}[voice_of(s, ref)] for s in labelled)
    assert len([j for j in jobs_listed(svc) if j["kind"] == "transcribe"]) == 1

    # Known speakers are refused clearly, as their part begins (a 3-s reference clip is over
    # the 16 KiB a form field may hold: not a 413)
    reference = "data:audio/wav;base64," + base64.b64encode((speech / "librivox-0930.wav").read_bytes()).decode()
    with pytest.raises(BadRequestError) as refused, open(talk, "rb") as f:
        client.audio.transcriptions.create(
            model="gpt-4o-transcribe-diarize",
            file=f,
            response_format="diarized_json",
            known_speaker_names=["reader"],
            known_speaker_references=[reference],
        )
    assert refused.value.code == "invalid_request" and refused.value.param in (
        "known_speaker_names",
        "known_speaker_references",
    ), refused.value.body
    assert "known speakers are not supported" in refused.value.message
    # a translation has no diarized_json, as OpenAI's
    with pytest.raises(BadRequestError) as no_format, open(talk, "rb") as f, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the package marks translations deprecated
        client.audio.translations.create(model="whisper-1", file=f, response_format="diarized_json")  # type: ignore[arg-type]
    assert no_format.value.param == "response_format"
    client.close()


#: The conversation's voices as the job's files name them (first appearance: JFK).
SPEAKERS = {"jfk": "SPEAKER_00", "reader": "SPEAKER_01"}


def assert_speaker_turns(outputs: dict[str, str], ref: list[tuple[str, float, float]]) -> None:
    """The job's ``srt``, ``vtt`` and ``txt`` files show the conversation's turns: every cue
    spoken by the voice its mark names, and one ``txt`` line per turn."""
    srt = Path(outputs["srt"]).read_text()
    assert srt.count("[SPEAKER_00] ") == 2 and srt.count("[SPEAKER_01] ") == 2, srt
    who = None
    for cue in cues(srt, "srt"):
        if mark := re.match(r"\[(SPEAKER_\d\d)\] ", cue["text"]):
            who = mark.group(1)
        assert who == SPEAKERS[voice_of(cue, ref)], (cue, srt)
    vtt = Path(outputs["vtt"]).read_text()
    for cue in cues(vtt, "vtt"):
        voice = re.match(r"<v (SPEAKER_\d\d)>", cue["text"])
        assert voice is not None and voice.group(1) == SPEAKERS[voice_of(cue, ref)], (cue, vtt)
    turns = Path(outputs["txt"]).read_text().splitlines()
    assert [line.split("] ")[0] for line in turns] == ["[SPEAKER_00", "[SPEAKER_01"] * 2, turns
    assert "fellow Americans" in turns[0] and "Dashwood" in turns[1] and "amiable" in turns[3], turns


@pytest.mark.slow
def test_mosquitto_pub_diarize_writes_the_speaker_turns(
    service_factory: Any, mosquitto: Any, speech: Path, tmp_path: Path, model_installed: None, mosquitto_clients: None
) -> None:
    need_voice_model()
    # Given a two-voice conversation in a media root
    media = tmp_path / "media"
    media.mkdir()
    ref = conversation(speech, media / "talk.wav")
    svc = service_factory(mosquitto, [media]).start()

    # When it is submitted with diarize by mosquitto_pub, as docs/topics.md's example does
    payload = {"kind": "transcribe", "input": str(media / "talk.wav"), "options": {"language": "en", "diarize": True}}
    with svc.watcher("jobs/+", "response/submit") as w:
        command = ["mosquitto_pub", "-h", mosquitto.host, "-p", str(mosquitto.port), "-q", "1"]
        subprocess.run(
            [*command, "-t", f"{svc.base}/request/submit", "-m", json.dumps(payload)], check=True, timeout=10
        )
        answer = w.wait_json(f"{svc.base}/response/submit", lambda m: True)
        assert answer["status"] == "ok", answer
        job_id = answer["data"]["jobs"][0]["job_id"]
        done = w.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] in ("succeeded", "failed"), timeout=180)

    # Then the job found two speakers, and its files carry the conversation's turns
    assert done["state"] == "succeeded", done
    assert done["result"]["speakers"] == 2
    assert_speaker_turns(done["result"]["outputs"], ref)


@pytest.mark.slow
def test_a_watch_folder_with_diarize_writes_the_speaker_turns_beside_the_recording(
    service_factory: Any, mosquitto: Any, speech: Path, root: Path, model_installed: None
) -> None:
    need_voice_model()
    # Given a watch folder whose rule asks for diarize, its transcripts beside the recordings
    inbox = root / "inbox"
    rule = {
        "path": str(inbox),
        "kind": "transcribe",
        "options": {"diarize": True, "language": "en", "output": "beside", "formats": ["srt", "vtt", "txt"]},
        "settle_s": 1.0,
        "mode": "events",
    }
    svc = service_factory(mosquitto, [root], {"EDGE_QUEUE_WATCH": json.dumps([rule])}).start()

    # When a two-voice conversation lands in it (renamed in whole)
    ref = conversation(speech, root / "elsewhere" / "talk.wav")
    os.rename(root / "elsewhere" / "talk.wav", inbox / "talk.wav")

    # Then its job diarizes, and the files beside it carry the conversation's turns
    def ended() -> list[dict[str, Any]]:
        return [j for j in jobs_listed(svc) if j["state"] in ("succeeded", "failed")]

    job = wait_until(ended, 180, "the watch folder's job to end")[0]
    assert job["state"] == "succeeded" and job["options"]["diarize"] is True, job
    assert job["result"]["speakers"] == 2, job
    outputs = job["result"]["outputs"]
    assert outputs == {fmt: str(inbox / f"talk.en.{fmt}") for fmt in ("srt", "vtt", "txt")}, outputs
    assert_speaker_turns(outputs, ref)


@pytest.mark.slow
def test_a_diarize_job_with_damaged_weights_fails_once_before_decoding(
    service_factory: Any, mosquitto: Any, speech: Path, tmp_path: Path, model_installed: None
) -> None:
    need_voice_model()
    # Given a service whose resemblyzer package holds weights cut short
    shadow = tmp_path / "shadow" / "resemblyzer"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('never imported: its weights are read')\n")
    (shadow / "pretrained.pt").write_bytes(weights_path().read_bytes()[:4096])
    pythonpath = os.pathsep.join([str(shadow.parent), os.environ.get("PYTHONPATH", "")])
    svc = service_factory(mosquitto, [speech], {"PYTHONPATH": pythonpath}).start()

    # When a job asks for diarize
    payload = {"kind": "transcribe", "input": str(speech / "jfk.flac"), "options": {"diarize": True}}
    with svc.watcher("jobs/+", "response/submit") as w:
        publish(svc.broker, f"{svc.base}/request/submit", json.dumps(payload))
        answer = w.wait_json(f"{svc.base}/response/submit", lambda m: True)
        job_id = answer["data"]["jobs"][0]["job_id"]
        done = w.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] in ("succeeded", "failed"), timeout=60)

    # Then it fails at its first attempt (checked before decoding), naming the file and the remedy
    assert done["state"] == "failed" and done["attempt"] == 1, done
    error = done["error"]
    assert error["code"] == "internal_error" and error["retryable"] is False, error
    assert str(shadow / "pretrained.pt") in error["message"] and "--force-reinstall" in error["message"], error
