"""A stop of ``edge-queue serve`` (docs/cli.md, "`edge-queue serve`"; docs/http-api.md,
``stopping``): with HTTP callers waiting for their jobs, a second signal, the uploads a stop cut
short; against a real service process, the shared mosquitto and real speech."""

from __future__ import annotations

import re
import shutil
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from edge_queue.workers.processes import KILL_AFTER_S

from .conftest import ServiceProcess, wait_until
from .helpers.http_api import KEY, api_service

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("model_installed")]

ALICE = {"Authorization": f"Bearer {KEY}"}


def _running(svc: ServiceProcess, *, call: bool = False) -> None:
    """Waits until a job runs on the service's worker (and, with ``call``, a job of an HTTP
    call is queued: the call waits for its end)."""
    wait_until(
        lambda: " started: " in (log := svc.log()) and (not call or re.search(r"queued: transcribe \S*/uploads/", log)),
        120,
        "a job running" + (" and a call's job queued" if call else ""),
    )


def _timed_stop(svc: ServiceProcess) -> float:
    """SIGTERM, and the seconds until the process has exited (with code 0)."""
    assert svc.proc is not None
    t0 = time.monotonic()
    svc.proc.send_signal(signal.SIGTERM)
    assert svc.proc.wait(60) == 0, svc.log()[-3000:]
    return time.monotonic() - t0


def _asr(url: str, path: Path) -> tuple[httpx.Response | httpx.HTTPError, float]:
    """POST /asr of ``path``: the answer (or the error) and when it came (monotonic)."""
    try:
        answer: httpx.Response | httpx.HTTPError = httpx.post(
            url + "/asr", files={"audio_file": (path.name, path.read_bytes())}, headers=ALICE, timeout=120
        )
    except httpx.HTTPError as e:
        answer = e
    return answer, time.monotonic()


def _slow_upload(svc: ServiceProcess, url: str, query: str = "") -> socket.socket:
    """A call of POST /asr whose audio is still being sent (a slow client: 64 KiB of a
    declared 10 MB), once the service writes its unfinished file; the open connection."""
    boundary = "eqstopboundary"
    head = (
        f"POST /asr{query} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: 10000000\r\n\r\n"
        f'--{boundary}\r\nContent-Disposition: form-data; name="audio_file"; filename="a.pcm"\r\n\r\n'
    )
    s = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30)
    s.sendall(head.encode() + b"\0" * 65536)
    wait_until(lambda: list((svc.data_dir / "uploads").rglob(".part-*")), 30, "the upload's unfinished file")
    return s


def test_a_stop_with_a_caller_waiting_is_as_quick_as_one_without(
    service_factory: Any, mosquitto: Any, long_recording: Any, tmp_path: Path
) -> None:
    # before: 20.8-23 s with a caller waiting for its job against 10.9 s without; the caller's
    # 503 came at the end of the stop, after the running job's cancel_grace_s
    film, _ = long_recording(300)
    media = tmp_path / "media"
    media.mkdir()
    shutil.copy(film, media / "film.wav")
    # Given a stop with a film running and no caller
    svc, _ = api_service(service_factory, mosquitto, media)
    with svc.watcher("response/#") as w:
        assert svc.request("submit", {"input": str(media / "film.wav")}, w)["status"] == "ok"
    _running(svc)
    without = _timed_stop(svc)
    # and the same with the film's call waiting on POST /asr
    svc, url = api_service(service_factory, mosquitto, media)
    answers: list[Any] = []
    caller = threading.Thread(target=lambda: answers.append(_asr(url, media / "film.wav")))
    caller.start()
    _running(svc, call=True)
    # When it is stopped
    t0 = time.monotonic()
    took = _timed_stop(svc)
    caller.join(60)
    # Then the stop takes no longer than without the caller (a busy box: some slack), and
    # the caller got its 503 stopping at once, long before the job's grace ended
    answer, answered_at = answers[0]
    print(f"stop: {without:.1f} s without a caller, {took:.1f} s with one; 503 after {answered_at - t0:.1f} s")
    assert isinstance(answer, httpx.Response), repr(answer)
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "stopping", answer.text
    assert int(answer.headers["retry-after"]) > 0
    assert took <= 1.25 * without + 2, f"{took:.1f} s with a caller waiting, {without:.1f} s without"
    assert answered_at - t0 <= without / 2, f"the caller was answered {answered_at - t0:.1f} s into a {took:.1f}-s stop"
    assert "Traceback" not in svc.log(), svc.log()[-3000:]


def test_a_second_signal_stops_at_once(
    service_factory: Any, mosquitto: Any, long_recording: Any, tmp_path: Path
) -> None:
    # before: 10.9 s from the second SIGTERM to the exit with a caller waiting (the API's stop
    # waited 10 s for the call the service had not let go yet)
    film, _ = long_recording(300)
    media = tmp_path / "media"
    media.mkdir()
    shutil.copy(film, media / "film.wav")
    # Given a film running for a caller of POST /asr, and a stop waiting up to 30 s for it
    svc, url = api_service(service_factory, mosquitto, media, EDGE_QUEUE_CANCEL_GRACE_S="30")
    answers: list[Any] = []
    caller = threading.Thread(target=lambda: answers.append(_asr(url, media / "film.wav")))
    caller.start()
    _running(svc, call=True)
    assert svc.proc is not None
    svc.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: "stopping: waiting up to 30 s" in svc.log(), 30, "the stop to wait for the film")
    # When a second SIGTERM comes
    took = _timed_stop(svc)
    caller.join(60)
    # Then the service is gone within the worker's end (SIGTERM, SIGKILL 2 s later), the film
    # queued again, and the caller answered 503 stopping
    print(f"second signal to exit: {took:.1f} s")
    assert took <= 2 * KILL_AFTER_S + 1, f"{took:.1f} s from the second signal to the exit"
    assert "second stop signal: stopping now; 1 running job(s) are queued again" in svc.log()
    answer, _ = answers[0]
    assert isinstance(answer, httpx.Response) and answer.status_code == 503, repr(answer)
    assert answer.json()["error"]["code"] == "stopping", answer.text


def test_an_upload_cut_by_a_stop_leaves_no_unfinished_file_after_the_start(
    service_factory: Any, mosquitto: Any, tmp_path: Path
) -> None:
    # before: the .part-* file of the cut call stayed until the hourly sweep found it an hour old
    media = tmp_path / "media"
    media.mkdir()
    svc, url = api_service(service_factory, mosquitto, media)
    uploads = svc.data_dir / "uploads"
    # Given a call whose upload is being received
    with _slow_upload(svc, url):
        # When the service stops meanwhile, and starts again
        assert svc.proc is not None
        svc.proc.send_signal(signal.SIGTERM)
        assert svc.proc.wait(60) == 0
    left = [p.name for p in uploads.rglob(".part-*")]
    svc.start()
    # Then nothing of the cut call is left once it serves
    assert not list(uploads.rglob(".part-*")), f"left by the stop: {left}"


@pytest.mark.parametrize("raw_pcm", [False, True], ids=["encoded", "raw PCM (encode=false, as Bazarr sends)"])
def test_a_call_still_sending_its_audio_at_a_stop_gets_the_error_shape_and_no_traceback(
    service_factory: Any, mosquitto: Any, tmp_path: Path, raw_pcm: bool
) -> None:
    # before: uvicorn's grace ended the call: a text/plain 500 "Internal Server Error", and the
    # log an ERROR with a traceback (and, for raw PCM, the wave writer's "Exception ignored")
    media = tmp_path / "media"
    media.mkdir()
    svc, url = api_service(service_factory, mosquitto, media)
    # Given a call whose audio is still being sent
    with _slow_upload(svc, url, "?encode=false" if raw_pcm else "") as s:
        # When the service stops meanwhile
        assert svc.proc is not None
        svc.proc.send_signal(signal.SIGTERM)
        answer = b""
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except OSError:  # a reset: the connection closed, as the docs allow
            pass
        assert svc.proc.wait(60) == 0
    # Then the caller has 503 stopping in the error shape, or a closed connection
    log = svc.log()
    if answer:
        status, _, rest = answer.partition(b"\r\n")
        assert status.startswith(b"HTTP/1.1 503") and b'"code":"stopping"' in rest, answer[:500]
        assert b"retry-after: 10" in rest.lower(), answer[:500]
    # and the log no traceback
    assert "Traceback" not in log and "Exception ignored" not in log and "ERROR" not in log, log[-3000:]
