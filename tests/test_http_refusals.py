"""What a hostile caller on the LAN can cost others through the HTTP API (docs/http-api.md,
"Bounds" and "Errors"), against a real service: refused calls leave nothing on disk, a `none`
role is refused before its body is read, slow or greedy uploaders do not hold every upload slot,
one address does not hold every connection, each request's head has a deadline, a disk that
fills mid-upload is a 507, and Starlette's own refusals come in the error shape."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from edge_queue.http.api_server import HEADER_S

from .conftest import need, wait_until
from .helpers.http_api import KEY, NOBODY_KEY, api_service

ALICE = {"Authorization": f"Bearer {KEY}"}
#: docs/http-api.md, "Bounds": an upload under 16 KiB/s over 10 s is dropped; one address holds
#: at most a quarter of max(256, 4 x uploads_at_once) connections (64 with the default 32)
RATE_WINDOW_S, PER_ADDRESS = 10.0, 64


def uploads(svc: Any) -> list[str]:
    folder = svc.data_dir / "uploads"  # a folder per user
    return sorted(p.name for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []


def begin_upload(port: int, headers: str) -> socket.socket:
    """A ``POST /asr`` whose body is under way: its head and 1 KiB of its file sent, 64 MiB
    declared."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(
        f"POST /asr?task=evil HTTP/1.1\r\nHost: x\r\n{headers}"
        "Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 67108864\r\n\r\n"
        '--b\r\nContent-Disposition: form-data; name="audio_file"; filename="a"\r\n\r\n'.encode()
        + os.urandom(1024)
    )
    return s


def answer_of(s: socket.socket, wait_s: float) -> bytes:
    """What the service answered on ``s`` within ``wait_s`` seconds of quiet (b"": nothing)."""
    s.settimeout(wait_s)
    got = b""
    try:
        while more := s.recv(65536):
            got += more
            if got.rstrip().endswith(b"}"):
                break
    except OSError:  # nothing (more) within wait_s, or reset after the answer
        pass
    return got


def post(url: str, route: str, data: bytes, headers: dict[str, str], name: str = "audio_file", **form: str) -> Any:
    return httpx.post(url + route, files={name: ("a.flac", data)}, data=form, headers=headers, timeout=60)


@pytest.mark.slow
def test_a_refused_call_leaves_nothing_and_a_none_role_is_refused_first(
    service_factory: Any, mosquitto: Any, speech: Path, tmp_path: Path, model_installed: None
) -> None:
    # before: every refused upload stayed in <data_dir>/uploads for retention_days and a day
    # (a none-role key or a bad option filled the disk, and everyone got 507)
    media = tmp_path / "media"
    media.mkdir()
    svc, url = api_service(service_factory, mosquitto, media)
    noise = os.urandom(2 << 20)
    nobody = {"Authorization": f"Bearer {NOBODY_KEY}"}
    refused = [
        post(url, "/asr", noise, nobody),  # the none role
        post(url, "/asr?task=evil", noise, ALICE),  # a bad option, found at submit
        post(url, "/asr?language=" + "x" * 300, noise, {}),  # anonymous, a bad option
        post(url, "/v1/audio/transcriptions", noise, ALICE, name="file", model="large-v9"),
        post(url, "/v1/audio/transcriptions", noise, ALICE, name="file", model="whisper-1", response_format="doc"),
    ]
    assert [r.status_code for r in refused] == [403, 400, 400, 404, 400], [r.text for r in refused]
    assert all(r.json()["error"]["code"] for r in refused)
    assert uploads(svc) == []
    # the none role is refused on every route, before a byte of the body is read
    for route in ("/v1/models", "/api/system/status"):
        r = httpx.get(url + route, headers=nobody, timeout=10)
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    # a file part under another name is the wrong name, not a size problem (it was 413)
    wrong = post(url, "/asr", noise, ALICE, name="file")
    assert wrong.status_code == 400 and "audio_file" in wrong.json()["error"]["message"]
    # a call that makes a job keeps its file, and the same audio sent again still finds it
    audio = (speech / "jfk.flac").read_bytes()
    for _ in range(2):
        ok = post(url, "/asr?output=txt", audio, ALICE)
        assert ok.status_code == 200 and "country" in ok.text
    assert len(uploads(svc)) == 1
    # another caller's refused call of the same audio does not take the file from the job
    assert post(url, "/asr?task=evil", audio, {}).status_code == 400
    assert len(uploads(svc)) == 1
    again = post(url, "/asr?output=txt", audio, ALICE)
    assert again.status_code == 200 and again.text == ok.text
    # Starlette's own refusals are in the error shape too (they were text/plain)
    for method, route, status, code in (
        ("GET", "/asr", 405, "method_not_allowed"),
        ("POST", "/v1/x", 404, "not_found"),
    ):
        r = httpx.request(method, url + route, headers=ALICE, timeout=10)
        assert r.status_code == status and r.json()["error"]["code"] == code


def test_wrong_keys_are_held_to_the_rate_of_their_address(service_factory: Any, mosquitto: Any, tmp_path: Path) -> None:
    # before: 300 wrong keys from one address were all answered 401, none 429
    media = tmp_path / "media"
    media.mkdir()
    _, url = api_service(service_factory, mosquitto, media, EDGE_QUEUE_API__CALLS_PER_MINUTE="5", anonymous=False)
    codes = [
        httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer guess{i:028d}"}, timeout=10).status_code
        for i in range(8)
    ]
    # (the wait for the service to answer counted one call of the address)
    assert codes[:4] == [401] * 4 and set(codes[5:]) == {429}
    assert httpx.get(url + "/v1/models", headers=ALICE, timeout=10).status_code == 200  # alice is not held


def trickle(port: int, key: str, stop: threading.Event, answers: list[bytes]) -> None:
    """An upload that sends its head and then one byte every second."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(
            f"POST /asr HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 1000000\r\n\r\n"
            '--b\r\nContent-Disposition: form-data; name="audio_file"; filename="a"\r\n\r\n'.encode()
        )
        s.settimeout(1.0)
        while not stop.is_set():
            try:
                s.sendall(b"x")
                got = s.recv(4096)
                while got and not got.rstrip().endswith(b"}"):  # the JSON body may follow the head
                    more = s.recv(4096)
                    got += more
                    if not more:
                        break
                answers.append(got)
                return
            except TimeoutError:
                continue
            except OSError:
                answers.append(b"closed")
                return


@pytest.mark.slow
def test_a_slow_or_greedy_caller_does_not_hold_every_upload_slot(
    service_factory: Any, mosquitto: Any, tmp_path: Path
) -> None:
    # before: 4 uploads sending a byte a second held all 4 slots until idle_timeout_s (60 s),
    # and every other caller was answered 503 busy
    media = tmp_path / "media"
    media.mkdir()
    _, url = api_service(service_factory, mosquitto, media, EDGE_QUEUE_API__UPLOADS_AT_ONCE="4")
    port = int(url.rsplit(":", 1)[1])
    stop, answers = threading.Event(), []
    threads = [threading.Thread(target=trickle, args=(port, KEY, stop, answers)) for _ in range(4)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    try:
        # alice holds her share (3 of 4); another caller still gets the fourth slot
        wait_until(lambda: len(answers) >= 1, 30, "alice's fourth upload refused")
        assert b" 503 " in answers[0].split(b"\r\n", 1)[0] and b'"busy"' in answers[0]
        other = httpx.post(url + "/asr?encode=false", files={"audio_file": ("a", b"")}, timeout=30)
        assert other.status_code != 503, other.text
        # the three slow uploads are dropped once 10 s show them under 16 KiB/s
        wait_until(lambda: len(answers) == 4, RATE_WINDOW_S + 20, "the slow uploads dropped")
        assert time.monotonic() - t0 < RATE_WINDOW_S + 15
        assert sum(b" 408 " in a.split(b"\r\n", 1)[0] for a in answers) == 3, answers
        assert all(b"KiB/s" in a for a in answers if b" 408 " in a)
    finally:
        stop.set()
        for t in threads:
            t.join(30)


@pytest.mark.slow
def test_one_address_does_not_hold_every_connection_and_each_head_has_a_deadline(
    service_factory: Any, mosquitto: Any, tmp_path: Path
) -> None:
    # before: one host held every connection (each new caller answered 503 by uvicorn), and a
    # connection that had one answer could trickle its next request's head for ever
    media = tmp_path / "media"
    media.mkdir()
    _, url = api_service(service_factory, mosquitto, media)
    port = int(url.rsplit(":", 1)[1])
    share = PER_ADDRESS
    held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(share)]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as over:
            answer = over.recv(4096)
        assert b" 503 " in answer.split(b"\r\n", 1)[0] and b'"busy"' in answer
    finally:
        for s in held:
            s.close()
    wait_until(lambda: httpx.get(url + "/v1/models", headers=ALICE, timeout=5).status_code == 200, 15, "served")

    with socket.create_connection(("127.0.0.1", port), timeout=HEADER_S + 10) as s:
        s.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
        first = s.recv(65536)
        assert b" 200 " in first.split(b"\r\n", 1)[0]
        t0 = time.monotonic()
        s.settimeout(1.0)
        closed = False
        for byte in b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 100:
            try:
                s.sendall(bytes([byte]))
                if s.recv(4096) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
        assert closed and time.monotonic() - t0 < HEADER_S + 5


@pytest.fixture
def small_data_dir(tmp_path: Path) -> Any:
    """A 24 MiB tmpfs where the service's data_dir goes (mounted as root), unmounted after."""
    where = tmp_path / "data"
    where.mkdir()
    mounted = os.geteuid() == 0 and (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(where)], capture_output=True).returncode
        == 0
    )
    need(mounted, "cannot mount a 24 MiB tmpfs (needs root and CAP_SYS_ADMIN)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)


@pytest.mark.slow
def test_a_disk_that_fills_during_uploads_is_a_507_and_its_space_comes_back(
    service_factory: Any, mosquitto: Any, tmp_path: Path, small_data_dir: Path
) -> None:
    # before: ENOSPC while writing an upload was a text/plain 500, or a connection closed unanswered
    media = tmp_path / "media"
    media.mkdir()
    # three users (one user's uploads keep at most half of the space: docs/http-api.md, "Uploads")
    keys = {"alice": KEY, "bob": "b" * 32}
    svc, url = api_service(
        service_factory,
        mosquitto,
        media,
        EDGE_QUEUE_LIMITS__MIN_FREE_DISK_MB="0",
        EDGE_QUEUE_API__KEYS=json.dumps(keys),
        EDGE_QUEUE_ACCESS__USERS=json.dumps(["bazarr", "alice", "bob"]),
    )
    assert svc.data_dir == small_data_dir
    port = int(url.rsplit(":", 1)[1])
    # all three begin, so each is allowed half of the ~23 MiB left (9 MiB is within it) ...
    callers = [f"Authorization: Bearer {KEY}\r\n", f"Authorization: Bearer {keys['bob']}\r\n", ""]
    socks = [begin_upload(port, headers) for headers in callers]
    try:
        wait_until(lambda: len(uploads(svc)) == 3, 30, "three uploads begun")
        # ... then each sends 9 MiB more, one after the other: 27 MiB do not fit
        answers = []
        for s in socks:
            try:
                s.sendall(os.urandom(9 << 20))
            except OSError:  # answered and closed: the disk was full
                pass
            answers.append(answer_of(s, 1.0))
        told = [a for a in answers if a]
        assert told and all(b"application/json" in a for a in told), told
        assert any(a.startswith(b"HTTP/1.1 507 ") and b'"disk_full"' in a for a in told), told
    finally:
        for s in socks:
            s.close()  # the callers still uploading go away
    wait_until(lambda: uploads(svc) == [], 30, "the uploads deleted")
    assert uploads(svc) == []  # nothing of them is left: every byte of the disk came back
    assert httpx.get(url + "/api/system/status", timeout=10).status_code == 200


def test_a_caller_gone_mid_upload_is_one_line_not_an_error(
    service_factory: Any, mosquitto: Any, tmp_path: Path
) -> None:
    # before: each ClientDisconnect logged an ERROR with a 50-line traceback (6,000 a minute)
    media = tmp_path / "media"
    media.mkdir()
    svc, url = api_service(service_factory, mosquitto, media)
    port = int(url.rsplit(":", 1)[1])
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(
                f"POST /asr HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                "Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 1000000\r\n\r\n"
                '--b\r\nContent-Disposition: form-data; name="audio_file"; filename="a"\r\n\r\n'.encode()
                + b"x" * 10000
            )
    wait_until(lambda: svc.log().count("went away during its upload") == 3, 15, "three departures logged")
    assert "Traceback" not in svc.log() and " ERROR " not in svc.log()
    assert uploads(svc) == [] and not list((svc.data_dir / "uploads").rglob(".part-*"))
