"""The HTTP API's error answers (docs/http-api.md, "Errors"): one table of statuses for every
route, a caller's fault never a 5xx, every refusal in the JSON error shape with one log line and
no traceback, a stop mid-call a 503 with ``Retry-After``; and OpenAI's clients (the real
``openai`` package) answered as OpenAI answers them. Against a real service process, the shared
mosquitto and real speech; the table's rule in milliseconds first."""

from __future__ import annotations

import re
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from edge_queue.errors import ErrorCode

from .conftest import ROOT, wait_until
from .helpers.http_api import KEY, api_service, jobs_listed

ALICE = {"Authorization": f"Bearer {KEY}"}


# -- the table, in milliseconds ------------------------------------------------------------------


def test_every_code_has_one_status_and_a_callers_fault_is_never_a_5xx() -> None:
    # before: a submit refused for the file sent (a playlist: unsupported_media) was a 500, and
    # every code but four took 500 by default, so clients retried what can never succeed
    from edge_queue.http.statuses import CALLER_FAULTS, STATUS, status_of

    assert {c.value for c in ErrorCode} <= set(STATUS)
    for code in CALLER_FAULTS:
        assert 400 <= status_of(code) < 500, code
        assert status_of(code, openai=True) != 422, code  # OpenAI answers a file it cannot use 400
    assert status_of("unsupported_media") == 422 and status_of("unsupported_media", openai=True) == 400
    assert status_of("internal_error") == 500 and status_of("queue_full") == 503 and status_of("stopping") == 503
    assert status_of("a code nobody made") == 500


def test_the_http_side_raises_edge_queue_errors_and_answers_them_by_the_table(tmp_path: Path) -> None:
    # before: edge_queue/http had an exception tree of its own (HttpError: ApiError, UploadError,
    # Refused) with bare-string codes beside errors.py, and only those were answered in the
    # error shape: a MediaError (unsupported_media) reaching a route was not
    import ast

    from edge_queue.config.api import ApiSettings
    from edge_queue.errors import EdgeQueueError, MediaError, RequestError
    from edge_queue.http.callers import caller_of
    from edge_queue.http.statuses import STATUS, error_response
    from edge_queue.http.uploads import boundary_of

    assert set(STATUS) == set(ErrorCode)  # one table, over the one vocabulary
    for module in (ROOT / "edge_queue" / "http").glob("*.py"):
        classes = [n for n in ast.walk(ast.parse(module.read_text())) if isinstance(n, ast.ClassDef)]
        own = [
            c.name for c in classes if any("Error" in ast.unparse(b) or "Exception" in ast.unparse(b) for b in c.bases)
        ]
        assert not own, f"{module.name} defines exception classes of its own: {own}"

    with pytest.raises(EdgeQueueError) as refused:
        caller_of(ApiSettings(keys={"alice": KEY}), None, "10.0.0.2")
    assert refused.value.code is ErrorCode.UNAUTHORIZED
    with pytest.raises(EdgeQueueError) as refused:
        boundary_of("text/plain")
    assert refused.value.code is ErrorCode.INVALID_REQUEST

    playlist = error_response(MediaError("a playlist names other files"))
    assert playlist.status_code == 422
    assert orjson.loads(playlist.body) == {
        "error": {
            "message": "a playlist names other files",
            "type": "invalid_request_error",
            "param": None,
            "code": "unsupported_media",
        }
    }
    assert error_response(MediaError("not audio"), openai=True).status_code == 400
    limited = error_response(RequestError("too many", code=ErrorCode.RATE_LIMITED, retry_after_s=7))
    assert (limited.status_code, limited.headers["retry-after"]) == (429, "7")
    assert orjson.loads(limited.body)["error"]["type"] == "rate_limit_error"
    model = error_response(RequestError("no model", code=ErrorCode.MODEL_NOT_FOUND, field="model"), openai=True)
    assert model.status_code == 404 and orjson.loads(model.body)["error"]["param"] == "model"


def test_with_an_anonymous_user_a_key_not_in_the_keys_is_no_key() -> None:
    # before: OpenAI's placeholder key ("sk-no-key-required") was a 401 with anonymous_user set
    from edge_queue.config.api import ApiSettings
    from edge_queue.errors import RequestError
    from edge_queue.http.callers import caller_of
    from edge_queue.http.statuses import status_of

    anon = ApiSettings(keys={"alice": KEY}, anonymous_user="bazarr")
    for key in ("sk-no-key-required", "EMPTY", "x" * 32):
        caller = caller_of(anon, key, "10.0.0.2")
        assert (caller.user, caller.key, caller.placeholder) == ("bazarr", "addr:10.0.0.2", True)
    assert caller_of(anon, KEY, "10.0.0.2").user == "alice"  # a real key is still its user
    with pytest.raises(RequestError) as refused:
        caller_of(ApiSettings(keys={"alice": KEY}), "sk-no-key-required", "10.0.0.2")
    assert status_of(refused.value.code) == 401


# -- a real service ------------------------------------------------------------------------------


def refusal_lines(svc: Any) -> list[str]:
    """The log's lines of refused calls: ours, and uvicorn's for a request h11 cannot read."""
    lines = svc.log().splitlines()
    return [line for line in lines if "HTTP" in line and "refused:" in line or "Invalid HTTP request" in line]


def errors(log: str) -> list[str]:
    """The log's ERROR lines and tracebacks."""
    return re.findall(r"^(?:ERROR .*|Traceback.*)$", log, re.M)


def raw_call(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """One request written in one piece; the status, headers and body of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(request)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers, body


@pytest.mark.slow
def test_a_callers_fault_is_a_4xx_in_the_error_shape_and_one_line(
    service_factory: Any, mosquitto: Any, tmp_path: Path
) -> None:
    # before: a playlist was a 500 unsupported_media; a boundary over 256 characters a 500
    # text/plain with an ERROR traceback; a head of 40-100 KB written at once was served
    media = tmp_path / "media"
    media.mkdir()
    svc, url = api_service(service_factory, mosquitto, media)
    port = int(url.rsplit(":", 1)[1])
    playlist = b"#EXTM3U\n#EXTINF:10,\nhttp://example.com/a.mp3\n"
    answers = [
        httpx.post(url + "/asr", files={"audio_file": ("list.m3u8", playlist)}, headers=ALICE, timeout=30),
        httpx.post(url + "/asr", files={"audio_file": ("a.flac", playlist)}, headers=ALICE, timeout=30),
        httpx.post(
            url + "/v1/audio/transcriptions",
            files={"file": ("a.mp3", playlist)},
            data={"model": "whisper-1"},
            headers=ALICE,
            timeout=30,
        ),
    ]
    assert [r.status_code for r in answers] == [422, 422, 400], [r.text for r in answers]
    assert {r.json()["error"]["code"] for r in answers} == {"unsupported_media"}
    assert all(r.json()["error"]["type"] == "invalid_request_error" for r in answers)

    long_boundary = "b" * 300
    body = f'--{long_boundary}\r\nContent-Disposition: form-data; name="audio_file"; filename="a"\r\n\r\nx\r\n'
    r = httpx.post(
        url + "/asr",
        content=(body + f"--{long_boundary}--\r\n").encode(),
        headers={**ALICE, "Content-Type": f"multipart/form-data; boundary={long_boundary}"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
    assert "boundary" in r.json()["error"]["message"]

    # a request's head over 32 KiB, written at once, and in pieces
    for pad in (40_000, 100_000):
        head = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nX-Pad: {'a' * pad}\r\n\r\n"
        status, headers, answer = raw_call(port, head.encode())
        assert status == 400 and headers["content-type"] == "application/json", answer
        assert b'"invalid_request"' in answer and b"32 KiB" in answer and headers["x-request-id"].startswith("req_")
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Pad: ")
        try:
            for _ in range(5):
                s.sendall(b"a" * 10_000)
                time.sleep(0.05)  # separate writes: each arrives as a piece of an unfinished head
            s.sendall(b"\r\n\r\n")
        except OSError:
            pass  # answered and closed once the unfinished head passed 32 KiB
        split = s.recv(65536)
    assert split.startswith(b"HTTP/1.1 400 ") and b"application/json" in split and b'"invalid_request"' in split
    ok = httpx.get(url + "/v1/models", headers={**ALICE, "X-Pad": "a" * 20_000}, timeout=10)
    assert ok.status_code == 200  # under the bound: served

    # one line for each refused call, none an error, no traceback
    wait_until(lambda: len(refusal_lines(svc)) >= 7, 10, "the refusals logged")
    log = svc.log()
    assert not errors(log), log[-3000:]
    assert len(refusal_lines(svc)) == 7, refusal_lines(svc)
    assert all(re.match(r"(INFO|WARNING) ", line) for line in refusal_lines(svc)), refusal_lines(svc)


@pytest.mark.slow
def test_a_bad_speaker_value_is_refused_naming_its_own_field(
    service_factory: Any, mosquitto: Any, tmp_path: Path
) -> None:
    # before: min_speakers=0 (and the like) answered param null, naming options.min_speakers
    media = tmp_path / "media"
    media.mkdir()
    _, url = api_service(service_factory, mosquitto, media)
    audio = {"audio_file": ("a.flac", b"never transcribed")}
    for query, param in (
        ("min_speakers=0", "min_speakers"),
        ("min_speakers=33", "min_speakers"),
        ("max_speakers=1000000000", "max_speakers"),
        ("min_speakers=3&max_speakers=2", "max_speakers"),
        ("min_speakers=%D9%A2", "min_speakers"),
        ("diarize=maybe", "diarize"),
    ):
        asked = query if query.startswith("diarize") else f"diarize=true&{query}"
        asr = httpx.post(f"{url}/asr?{asked}", files=audio, headers=ALICE, timeout=30)
        form = dict(pair.split("=") for pair in query.replace("%D9%A2", "\u0662").split("&"))
        openai = httpx.post(
            url + "/v1/audio/transcriptions",
            files={"file": ("a.flac", b"never transcribed")},
            data={"model": "gpt-4o-transcribe-diarize", **form},
            headers=ALICE,
            timeout=30,
        )
        for r in (asr, openai):
            error = r.json()["error"]
            assert r.status_code == 400 and error["code"] == "invalid_request", r.text
            assert error["param"] == param and error["message"].startswith(f"{param}: "), (query, r.text)


@pytest.mark.slow
def test_a_stop_while_a_call_waits_is_a_503_with_retry_after(
    service_factory: Any, mosquitto: Any, speech: Path, tmp_path: Path
) -> None:
    # before: the caller got 500 text/plain "Internal Server Error" and the log a traceback
    media = tmp_path / "media"
    media.mkdir()
    svc, url = api_service(service_factory, mosquitto, media)
    with svc.watcher("response/#") as w:
        assert svc.request("pause", {}, w)["status"] == "ok"  # the call's job stays queued: it waits
    answers: list[Any] = []

    def call() -> None:
        try:
            answers.append(
                httpx.post(
                    url + "/asr",
                    files={"audio_file": ("jfk.flac", (speech / "jfk.flac").read_bytes())},
                    headers=ALICE,
                    timeout=60,
                )
            )
        except httpx.HTTPError as e:
            answers.append(e)

    caller = threading.Thread(target=call)
    caller.start()
    wait_until(lambda: [j for j in jobs_listed(svc) if j["state"] == "queued"], 30, "the call's job queued")
    # the job is committed, so its call holds its submit's answer: it waits for the job's end
    svc.proc.send_signal(signal.SIGTERM)
    caller.join(60)
    assert svc.proc.wait(30) == 0
    assert len(answers) == 1
    answer = answers[0]
    if isinstance(answer, httpx.Response):  # or the connection closed, as the docs allow
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "stopping" and int(answer.headers["retry-after"]) > 0
    else:
        assert isinstance(answer, httpx.RemoteProtocolError | httpx.ReadError), repr(answer)
    log = svc.log()
    assert "Traceback" not in log and "Exception in ASGI" not in log, log[-3000:]


@pytest.mark.slow
def test_openai_clients_get_openais_answers(
    service_factory: Any, mosquitto: Any, speech: Path, tmp_path: Path, model_installed: None, request: Any
) -> None:
    from openai import AuthenticationError, BadRequestError, NotFoundError, OpenAI

    media = tmp_path / "media"
    media.mkdir()
    svc, url = api_service(service_factory, mosquitto, media)
    flac = speech / "jfk.flac"
    # OpenAI's client needs a key: with api.anonymous_user set, a placeholder acts as that user
    # (before: 401)
    client = OpenAI(base_url=url + "/v1", api_key="sk-no-key-required", max_retries=0)
    request.addfinalizer(client.close)
    with open(flac, "rb") as f:
        raw = client.audio.transcriptions.with_raw_response.create(model="whisper-1", file=f)
    assert re.fullmatch(r"req_[0-9a-f]{32}", raw.headers["x-request-id"])  # before: no x-request-id
    text = raw.parse()
    assert "country" in text.text
    assert text.usage is not None and text.usage.type == "duration" and 10 < text.usage.seconds < 12  # before: none
    with open(flac, "rb") as f:
        verbose = client.audio.transcriptions.create(model="whisper-1", file=f, response_format="verbose_json")
    assert verbose.usage is not None and 10 < verbose.usage.seconds < 12
    assert {j["submitted_by"] for j in jobs_listed(svc)} == {"bazarr"}

    # GET /v1/models/{id} (before: 404 for every model)
    assert client.models.retrieve("whisper-1").id == "whisper-1"
    with pytest.raises(NotFoundError) as unknown:
        client.models.retrieve("gpt-4o-transcribe")
    assert unknown.value.code == "model_not_found"

    # stream=True is refused clearly (before: a 200 the client read as an empty stream)
    with pytest.raises(BadRequestError) as streamed, open(flac, "rb") as f:
        for _ in client.audio.transcriptions.create(model="whisper-1", file=f, stream=True):
            pass
    assert streamed.value.param == "stream"

    # an empty or non-audio file is OpenAI's 400, not 422 (BadRequestError handlers caught nothing)
    for data in (b"", b"not audio at all" * 100):
        with pytest.raises(BadRequestError) as bad:
            client.audio.transcriptions.create(model="whisper-1", file=("a.mp3", data))
        assert bad.value.code == "unsupported_media" and bad.value.request_id  # type: ignore[attr-defined]

    # without anonymous_user, a key that is not one of [api] keys is still refused
    svc.stop()
    svc2, url2 = api_service(service_factory, mosquitto, media, anonymous=False)
    with OpenAI(base_url=url2 + "/v1", api_key="sk-no-key-required", max_retries=0) as placeholder:
        with pytest.raises(AuthenticationError):
            placeholder.models.list()
    with OpenAI(base_url=url2 + "/v1", api_key=KEY, max_retries=0) as alice:
        assert alice.models.retrieve("whisper-1").id == "whisper-1"

    for s in (svc, svc2):
        log = s.log()
        assert not errors(log), log[-3000:]
    assert len(refusal_lines(svc)) == 4, refusal_lines(svc)  # unknown model, stream, empty, not audio
