"""The HTTP API (docs/http-api.md) with its real clients: the ``openai`` package, requests in
the exact shape of Bazarr's Whisper provider (raw PCM, its parameters and timeouts, the body
read as the subtitle whatever the status), and the docs' curl lines; against a real service
process, the shared mosquitto and real speech. The rules (formats, callers, uploads) in
milliseconds first."""

from __future__ import annotations

import io
import json
import shutil
import socket
import subprocess
import time
import warnings
import wave
from pathlib import Path
from typing import Any

import httpx
import pytest

from edge_queue.config.api import ApiSettings
from edge_queue.errors import RequestError
from edge_queue.http import transcripts
from edge_queue.http.api_server import HEADER_S
from edge_queue.http.callers import caller_of, count_call, presented_key
from edge_queue.http.statuses import status_of
from edge_queue.http.uploads import Upload, suffix_of, sweep
from edge_queue.requests.outputs import cues
from edge_queue.rules.rates import MAX_TRACKED_CALLERS, CallRate

from .conftest import ROOT, need, wait_until, wer
from .helpers.http_api import KEY, NOBODY_KEY, answers, api_service, bazarr_asr, jobs_listed, pcm_of

JFK = "And so my fellow Americans, ask not what your country can do for you, ask what you can do for your country."

# -- rules, in milliseconds -------------------------------------------------------------------

DOCUMENT = {
    "language": "en",
    "duration_s": 11.0,
    "text": "Hello there. General\tKenobi.",
    "segments": [
        {"id": 0, "start": 0.0, "end": 1.5, "text": " Hello there."},
        {
            "id": 1,
            "start": 1.5,
            "end": 3.25,
            "text": " General\tKenobi.",
            "words": [{"word": " General", "start": 1.5, "end": 2.0}, {"word": " Kenobi.", "start": 2.0, "end": 3.25}],
        },
        {"id": 2, "start": "bad", "end": 4, "text": "dropped"},
    ],
}


def test_tsv_is_whisper_asr_webservices() -> None:
    assert transcripts.tsv(DOCUMENT) == b"start\tend\ttext\n0\t1500\tHello there.\n1500\t3250\tGeneral Kenobi.\n"


def test_openai_shapes() -> None:
    verbose = json.loads(transcripts.openai_verbose(DOCUMENT, "transcribe", words=True))
    assert verbose["language"] == "english" and verbose["duration"] == 11.0 and verbose["task"] == "transcribe"
    assert [s["end"] for s in verbose["segments"]] == [1.5, 3.25]  # the malformed segment is left out
    assert [w["word"] for w in verbose["words"]] == [" General", " Kenobi."]
    only_words = json.loads(transcripts.openai_verbose(DOCUMENT, "transcribe", words=True, segments=False))
    assert "segments" not in only_words
    assert json.loads(transcripts.openai_json(DOCUMENT)) == {
        "text": DOCUMENT["text"],
        "usage": {"type": "duration", "seconds": 11.0},
    }
    assert json.loads(transcripts.whisper_json(DOCUMENT))["language"] == "en"
    assert transcripts.language_name("de") == "german" and transcripts.language_name("zz") == "zz"


def test_openai_speakers() -> None:
    from openai.types.audio import TranscriptionDiarized

    said = {
        **DOCUMENT,
        "segments": [
            {**DOCUMENT["segments"][0], "speaker": "SPEAKER_00"},
            {
                **DOCUMENT["segments"][1],
                "speaker": "SPEAKER_01",
                "words": [{**w, "speaker": "SPEAKER_01"} for w in DOCUMENT["segments"][1]["words"]],
            },
        ],
    }
    diarized = TranscriptionDiarized.model_validate(json.loads(transcripts.openai_diarized(said)))
    assert [(s.id, s.speaker, s.start, s.end) for s in diarized.segments] == [
        ("seg_0", "A", 0.0, 1.5),
        ("seg_1", "B", 1.5, 3.25),
    ]
    assert diarized.task == "transcribe" and diarized.duration == 11.0 and diarized.text == DOCUMENT["text"]
    verbose = json.loads(transcripts.openai_verbose(said, "transcribe", words=True))
    assert [s["speaker"] for s in verbose["segments"]] == ["SPEAKER_00", "SPEAKER_01"]
    assert {w["speaker"] for w in verbose["words"]} == {"SPEAKER_01"}
    assert "speaker" not in json.loads(transcripts.openai_verbose(DOCUMENT, "transcribe", words=True))["segments"][0]
    letters = [transcripts.speaker_letter(f"SPEAKER_{n:02d}") for n in (0, 1, 25, 26, 31)]
    assert letters == ["A", "B", "Z", "AA", "AF"]
    assert transcripts.speaker_letter("agent") == "agent" and transcripts.speaker_letter(None) == "A"


def test_callers() -> None:
    api = ApiSettings(keys={"alice": KEY})
    assert presented_key("Bearer " + KEY, None) == KEY and presented_key(None, KEY) == KEY
    assert presented_key("Basic abc", None) is None
    assert caller_of(api, KEY, "10.0.0.2").user == "alice"
    for key in ("x" * 32, None):
        with pytest.raises(RequestError) as e:
            caller_of(api, key, "10.0.0.2")
        assert status_of(e.value.code) == 401
    anon = ApiSettings(anonymous_user="bazarr")
    caller = caller_of(anon, None, "10.0.0.2")
    assert (caller.user, caller.key) == ("bazarr", "addr:10.0.0.2")
    with pytest.raises(ValueError):
        ApiSettings(keys={"a": "short"})
    with pytest.raises(ValueError):
        ApiSettings(keys={"a": KEY, "b": KEY})


def test_call_rate_is_per_caller_sliding_and_bounded() -> None:
    rate = CallRate(3)
    for t in (0.0, 1.0, 2.0):
        count_call(rate, "a", t)
    count_call(rate, "b", 2.0)  # another caller is not slowed
    with pytest.raises(RequestError) as e:
        count_call(rate, "a", 30.0)
    assert (status_of(e.value.code), e.value.code, e.value.retry_after_s) == (429, "rate_limited", 30)
    count_call(rate, "a", 60.5)  # the first call left the window
    for i in range(MAX_TRACKED_CALLERS + 10):
        count_call(rate, f"addr:{i}", 61.0)
    assert len(rate) == MAX_TRACKED_CALLERS


def multipart(fields: dict[str, str], name: str, filename: str, data: bytes) -> tuple[bytes, bytes]:
    boundary = b"----eqtestboundary"
    out = io.BytesIO()
    for k, v in fields.items():
        out.write(b"--" + boundary + b'\r\nContent-Disposition: form-data; name="' + k.encode() + b'"\r\n\r\n')
        out.write(v.encode() + b"\r\n")
    out.write(b"--" + boundary + b'\r\nContent-Disposition: form-data; name="' + name.encode())
    out.write(b'"; filename="' + filename.encode() + b'"\r\nContent-Type: application/octet-stream\r\n\r\n')
    out.write(data + b"\r\n--" + boundary + b"--\r\n")
    return boundary, out.getvalue()


def feed_in_pieces(upload: Upload, body: bytes, piece: int) -> None:
    for i in range(0, len(body), piece):
        upload.feed(body[i : i + piece])


@pytest.mark.parametrize("piece", [1, 7, 4096, 1 << 20])
def test_upload_streams_to_a_file_named_by_its_content(tmp_path: Path, piece: int) -> None:
    data = bytes(range(256)) * 400
    boundary, body = multipart({"model": "whisper-1"}, "file", "../../etc/x.M4A", data)
    up = Upload(tmp_path, boundary, file_field="file", raw_pcm=False, max_bytes=1 << 20, min_free_bytes=0)
    feed_in_pieces(up, body, piece)
    path = up.finish()
    assert path.parent == tmp_path and path.suffix == ".m4a" and path.read_bytes() == data
    assert up.fields == {"model": ["whisper-1"]}
    again = Upload(tmp_path, boundary, file_field="file", raw_pcm=False, max_bytes=1 << 20, min_free_bytes=0)
    feed_in_pieces(again, body, 999)
    assert again.finish() == path  # the same content, the same name
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_raw_pcm_becomes_a_wav_and_can_be_cut(tmp_path: Path) -> None:
    pcm = b"\x01\x00" * 48_000  # 3 s at 16 kHz
    boundary, body = multipart({}, "audio_file", "audio_file", pcm)
    up = Upload(tmp_path, boundary, file_field="audio_file", raw_pcm=True, max_bytes=1 << 20, min_free_bytes=0)
    feed_in_pieces(up, body, 1000)
    with wave.open(str(up.finish())) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()) == (16000, 1, 2, 48_000)
    cut = Upload(
        tmp_path,
        boundary,
        file_field="audio_file",
        raw_pcm=True,
        max_bytes=1 << 20,
        min_free_bytes=0,
        keep_bytes=32_000,
    )
    feed_in_pieces(cut, body, 777)
    with wave.open(str(cut.finish())) as w:
        assert w.getnframes() == 16_000


def test_upload_bounds(tmp_path: Path) -> None:
    boundary, body = multipart({}, "file", "a.wav", b"x" * 5000)
    up = Upload(tmp_path, boundary, file_field="file", raw_pcm=False, max_bytes=4096, min_free_bytes=0)
    with pytest.raises(RequestError) as e:
        feed_in_pieces(up, body, 1000)
    assert status_of(e.value.code) == 413
    up.discard()
    assert list(tmp_path.iterdir()) == []  # nothing of it is left
    huge = shutil.disk_usage(tmp_path).free + 2**40
    full = Upload(tmp_path, boundary, file_field="file", raw_pcm=False, max_bytes=1 << 20, min_free_bytes=huge)
    with pytest.raises(RequestError) as e:
        feed_in_pieces(full, body, 1000)
    assert (status_of(e.value.code), e.value.code) == (507, "disk_full")
    boundary, body = multipart({"x": "y"}, "other", "a.wav", b"x")
    misnamed = Upload(tmp_path, boundary, file_field="file", raw_pcm=False, max_bytes=1 << 20, min_free_bytes=0)
    with pytest.raises(RequestError) as e:  # a file part under another name
        feed_in_pieces(misnamed, body, 10)
    assert status_of(e.value.code) == 400 and "'file'" in e.value.message
    body = b"--" + boundary + b'\r\nContent-Disposition: form-data; name="x"\r\n\r\ny\r\n--' + boundary + b"--\r\n"
    missing = Upload(tmp_path, boundary, file_field="file", raw_pcm=False, max_bytes=1 << 20, min_free_bytes=0)
    feed_in_pieces(missing, body, 10)
    with pytest.raises(RequestError) as e:  # no file part at all
        missing.finish()
    assert status_of(e.value.code) == 400
    assert suffix_of("a.tar.gz") == "gz" and suffix_of("a.$(rm)") == "bin" and suffix_of(None) == "bin"


def test_sweep_deletes_old_uploads_and_unfinished_ones(tmp_path: Path) -> None:
    import os

    old, new, part = tmp_path / "a.wav", tmp_path / "b.wav", tmp_path / ".part-x"
    for p in (old, new, part):
        p.write_bytes(b"x")
    now = time.time()
    os.utime(old, (now - 10_000, now - 10_000))
    os.utime(part, (now - 3700, now - 3700))
    assert sweep(tmp_path, 5000, now) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["b.wav"]
    # at the start, every unfinished one (a call a stop cut short), however new
    (tmp_path / ".part-y").write_bytes(b"x")
    assert sweep(tmp_path, 5000, now + 10, unfinished_s=None) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["b.wav"]


# -- a real service ----------------------------------------------------------------------------


@pytest.mark.slow
def test_bazarr_session(
    service_factory: Any, mosquitto: Any, speech: Path, tmp_path: Path, model_installed: None
) -> None:
    media = tmp_path / "media"
    media.mkdir()
    svc, url = api_service(service_factory, mosquitto, media)
    pcm = pcm_of(speech / "jfk.flac")

    status = httpx.get(url + "/api/system/status", timeout=5)
    assert status.status_code == 200 and status.json()["service"] == "edge-queue"

    detected = httpx.post(
        url + "/detect-language", params={"encode": "false"}, files={"audio_file": ("audio_file", pcm)}, timeout=60
    )
    assert detected.status_code == 200, detected.text
    assert detected.json()["language_code"] == "en" and detected.json()["detected_language"] == "english"

    first = bazarr_asr(url, pcm)
    assert first.status_code == 200, first.text
    srt = first.text
    assert srt.startswith("1\n00:00:00,000 --> ") and wer(JFK, " ".join(c["text"] for c in cues(srt, "srt"))) < 0.15
    assert first.headers["content-type"].startswith("text/plain") and first.headers["asr-engine"] == "edge-queue"

    # Bazarr resends after its read timeout: the same job answers, nothing decoded again
    jobs_before = jobs_listed(svc)
    t0 = time.monotonic()
    again = bazarr_asr(url, pcm)
    assert again.status_code == 200 and again.text == srt and time.monotonic() - t0 < 5
    assert len(jobs_listed(svc)) == len(jobs_before) == 2  # detect-language's and /asr's
    assert {j["submitted_by"] for j in jobs_before} == {"bazarr"}

    for fmt, check in {
        "tsv": lambda b: b.startswith("start\tend\ttext\n0\t"),
        "txt": lambda b: "fellow Americans" in b,
        "vtt": lambda b: b.startswith("WEBVTT"),
        "json": lambda b: json.loads(b)["language"] == "en" and json.loads(b)["segments"],
    }.items():
        r = bazarr_asr(url, pcm, output=fmt)
        assert r.status_code == 200 and check(r.text), (fmt, r.text[:200])
    assert len(jobs_listed(svc)) == 2  # every format from the same job

    # the same audio submitted over MQTT as a file: the same subtitles
    wav = media / "jfk.wav"
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes(pcm)
    with svc.watcher("response/#", "jobs/#") as w:
        resp = svc.request("submit", {"input": str(wav), "options": {"language": "en"}}, w)
        job_id = resp["data"]["jobs"][0]["job_id"]
        done = wait_until(
            lambda: (w.json_on(f"{svc.base}/jobs/{job_id}") or [{}])[-1].get("state") == "succeeded", 60, "MQTT job"
        )
        assert done
        result = w.json_on(f"{svc.base}/jobs/{job_id}")[-1]["result"]
    assert Path(result["outputs"]["srt"]).read_text() == srt

    # a failure is never a 200 with a body a subtitle parser would take
    bad = bazarr_asr(url, b"not audio at all", encode="true")
    assert bad.status_code == 422 and not bad.text.startswith("1\n") and bad.json()["error"]["code"]
    not_multipart = httpx.post(url + "/asr", content=b"x", timeout=10)
    assert not_multipart.status_code == 400 and not_multipart.json()["error"]["type"] == "invalid_request_error"

    # an MQTT user cannot name an upload
    uploads = sorted(p for p in (svc.data_dir / "uploads").rglob("*") if p.is_file())
    assert uploads and all(not p.name.startswith(".part-") for p in uploads)
    with svc.watcher("response/#") as w:
        resp = svc.request("submit", {"input": str(uploads[0])}, w)
    assert resp["status"] == "error" and resp["error"]["rejected"][0]["code"] == "input_outside_media_roots"


@pytest.mark.slow
def test_openai_package(
    service_factory: Any, mosquitto: Any, speech: Path, tmp_path: Path, model_installed: None
) -> None:
    from openai import NotFoundError, OpenAI, PermissionDeniedError

    media = tmp_path / "media"
    media.mkdir()
    svc, url = api_service(service_factory, mosquitto, media)
    client = OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == ["whisper-1", "gpt-4o-transcribe-diarize"]
    flac = speech / "jfk.flac"

    def create(**kw: Any) -> Any:
        with open(flac, "rb") as f:
            return client.audio.transcriptions.create(model="whisper-1", file=f, **kw)

    assert wer(JFK, create().text) < 0.15
    assert wer(JFK, create(response_format="text")) < 0.15
    assert create(response_format="srt").startswith("1\n00:00:00,000 --> ")
    assert create(response_format="vtt").startswith("WEBVTT")
    verbose = create(response_format="verbose_json")
    assert verbose.language == "english" and 10 < verbose.duration < 12 and verbose.segments
    # with the model's own confidence: 0.0 would read as "most confident" to a client's filter
    for s in verbose.segments:
        assert -1.0 < s.avg_logprob < 0.0 and 0.0 < s.no_speech_prob < 0.5 and s.compression_ratio > 0.5, s
        assert s.tokens and all(isinstance(t, int) for t in s.tokens), s
    words = create(response_format="verbose_json", timestamp_granularities=["word"])
    assert words.words and words.words[0].start < words.words[-1].end
    with open(flac, "rb") as f, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the package marks translations deprecated
        assert wer(JFK, client.audio.translations.create(model="whisper-1", file=f).text) < 0.2
    assert {j["submitted_by"] for j in jobs_listed(svc)} == {"alice"}
    # the same audio and options again: the same job; word times are other options: one more
    assert len(jobs_listed(svc)) == 3

    with pytest.raises(NotFoundError), open(flac, "rb") as f:
        client.audio.transcriptions.create(model="gpt-4o-transcribe", file=f)
    # a key not in [api] keys acts as api.anonymous_user, set here (tests/test_http_errors.py
    # has it unset: 401)
    with OpenAI(base_url=url + "/v1", api_key="x" * 32, max_retries=0) as placeholder:
        assert [m.id for m in placeholder.models.list()] == ["whisper-1", "gpt-4o-transcribe-diarize"]
    nobody = OpenAI(base_url=url + "/v1", api_key=NOBODY_KEY, max_retries=0)  # role none
    with nobody, pytest.raises(PermissionDeniedError), open(flac, "rb") as f:
        nobody.audio.transcriptions.create(model="whisper-1", file=f)
    client.close()  # its connections, or a later collection reports them unclosed


@pytest.mark.slow
def test_bounds(service_factory: Any, mosquitto: Any, speech: Path, tmp_path: Path) -> None:
    media = tmp_path / "media"
    media.mkdir()
    svc, url = api_service(
        service_factory,
        mosquitto,
        media,
        EDGE_QUEUE_API__MAX_UPLOAD_MB="1",
        EDGE_QUEUE_API__CALLS_PER_MINUTE="5",
        EDGE_QUEUE_API__IDLE_TIMEOUT_S="1",
        anonymous=False,
    )
    headers = {"Authorization": f"Bearer {KEY}"}
    big = httpx.post(url + "/asr", files={"audio_file": ("a", b"\0" * (3 << 20))}, headers=headers, timeout=30)
    assert big.status_code == 413 and big.json()["error"]["code"] == "payload_too_large"
    no_key = httpx.post(url + "/asr", files={"audio_file": ("a", b"\0")}, timeout=10)
    assert no_key.status_code == 401

    # a slow upload: headers and a first piece, then nothing
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10) as s:
        s.sendall(
            b"POST /asr HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + KEY.encode()
            + b"\r\nContent-Type: multipart/form-data; boundary=b\r\nContent-Length: 100000\r\n\r\n--b\r\n"
        )
        answer = s.recv(4096)
    assert b" 408 " in answer.split(b"\r\n", 1)[0]

    # over the rate: 429 with Retry-After (the calls above counted)
    codes = [httpx.get(url + "/v1/models", headers=headers, timeout=10) for _ in range(4)]
    refused = [r for r in codes if r.status_code == 429]
    assert refused and int(refused[0].headers["retry-after"]) >= 1
    assert not list((svc.data_dir / "uploads").rglob(".part-*"))  # nothing of the refused uploads is left


@pytest.mark.slow
def test_a_connection_that_never_sends_its_headers_is_closed(
    service_factory: Any, mosquitto: Any, tmp_path: Path
) -> None:
    """uvicorn has no deadline of its own for a request's head: HeaderDeadline gives one (its
    use of uvicorn's ``cycle`` is what this catches if uvicorn changes)."""
    media = tmp_path / "media"
    media.mkdir()
    _, url = api_service(service_factory, mosquitto, media)
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=HEADER_S + 10) as s:
        t0 = time.monotonic()
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")  # never ends its head
        assert s.recv(4096) == b""
        assert HEADER_S - 1 < time.monotonic() - t0 < HEADER_S + 5
    assert answers(url)  # others are served meanwhile and after


@pytest.mark.slow
def test_a_caller_that_goes_away_loses_nothing(
    service_factory: Any, mosquitto: Any, long_speech: Path, tmp_path: Path, model_installed: None
) -> None:
    media = tmp_path / "media"
    media.mkdir()
    svc, url = api_service(service_factory, mosquitto, media)
    data = long_speech.read_bytes()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            url + "/asr?output=txt", files={"audio_file": ("long.wav", data)}, timeout=httpx.Timeout(1.0, connect=5)
        )
    wait_until(lambda: "went away; job" in svc.log(), 30, "the service to see the caller gone")
    answer = httpx.post(url + "/asr?output=txt", files={"audio_file": ("long.wav", data)}, timeout=300)
    assert answer.status_code == 200 and len(answer.text.split()) > 100
    assert len(jobs_listed(svc)) == 1
    assert "uvicorn.error" not in svc.log()  # uvicorn's own start lines stay out of the service log


@pytest.mark.slow
def test_docs_curl_lines(
    service_factory: Any, mosquitto: Any, speech: Path, tmp_path: Path, model_installed: None
) -> None:
    need(shutil.which("curl") is not None, "curl is not installed")
    media = tmp_path / "media"
    media.mkdir()
    shutil.copy(speech / "jfk.flac", tmp_path / "call.m4a")
    _, url = api_service(service_factory, mosquitto, media)
    text = (ROOT / "docs" / "http-api.md").read_text()
    block = text.split("## curl", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    lines = [line.replace("http://127.0.0.1:9000", url) for line in block.strip().splitlines()]
    assert len(lines) == 3
    outs = [
        subprocess.run(
            ["bash", "-c", line],
            cwd=tmp_path,
            env={"KEY": KEY, "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
        for line in lines
    ]
    assert outs[0].startswith("1\n00:00:00,000") and outs[1].startswith("WEBVTT") and json.loads(outs[2])["data"]


@pytest.mark.slow
def test_killed_in_the_middle_each_caller_gets_its_own_transcript(
    service_factory: Any, mosquitto: Any, speech: Path, tmp_path: Path, model_installed: None
) -> None:
    """kill -9 while three calls wait for their jobs: after the restart each resend is answered
    from its own job (never another's text), and no job is lost or made twice."""
    media = tmp_path / "media"
    media.mkdir()
    svc, url = api_service(service_factory, mosquitto, media)
    clips = ["jfk.flac", "librivox-0870.wav", "librivox-0890.wav"]
    markers = ["americans", "dashwood", "selfish"]
    bodies = [pcm_of(speech / name) * 6 for name in clips]  # about 30-60 s each

    def call(i: int, timeout: float) -> httpx.Response | None:
        try:
            return httpx.post(
                url + "/asr",
                params={"language": "en", "output": "txt", "encode": "false"},
                files={"audio_file": ("audio_file", bodies[i])},
                timeout=timeout,
            )
        except httpx.HTTPError:
            return None

    import threading

    threads = [threading.Thread(target=call, args=(i, 60)) for i in range(3)]
    for t in threads:
        t.start()
    wait_until(lambda: svc.log().count(" queued: transcribe ") >= 3, 60, "three jobs queued")
    svc.kill()
    for t in threads:
        t.join(70)
    svc.start()
    wait_until(lambda: answers(url), 30, "the HTTP API back")
    for i, marker in enumerate(markers):
        answer = call(i, 600)
        assert answer is not None and answer.status_code == 200, answer.text if answer else None
        text = answer.text.lower()
        assert marker in text and not any(m in text for m in markers if m != marker)
    jobs = jobs_listed(svc)
    assert len(jobs) == 3 and all(j["state"] == "succeeded" for j in jobs)


@pytest.mark.slow
def test_audio_of_a_cancelled_job_sent_again_runs_it_again(
    service_factory: Any, mosquitto: Any, long_speech: Path, tmp_path: Path, model_installed: None
) -> None:
    media = tmp_path / "media"
    media.mkdir()
    svc, url = api_service(service_factory, mosquitto, media)
    data = long_speech.read_bytes()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            url + "/asr?output=txt", files={"audio_file": ("long.wav", data)}, timeout=httpx.Timeout(1.0, connect=5)
        )
    job_id = wait_until(lambda: (jobs_listed(svc) or [{}])[0].get("job_id"), 30, "the job")
    with svc.watcher("response/#") as w:
        assert svc.request("cancel", {"job_id": job_id}, w)["status"] == "ok"
    wait_until(lambda: jobs_listed(svc)[0]["state"] == "cancelled", 60, "the job cancelled")
    answer = httpx.post(url + "/asr?output=txt", files={"audio_file": ("long.wav", data)}, timeout=300)
    assert answer.status_code == 200 and len(answer.text.split()) > 100
    jobs = jobs_listed(svc)
    assert [(j["job_id"], j["state"]) for j in jobs] == [(job_id, "succeeded")]
    assert "sent the audio of failed job" in svc.log()
