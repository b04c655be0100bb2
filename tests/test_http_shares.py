"""What one caller may hold of the HTTP API (docs/http-api.md, "Bounds", "Uploads"): a failed
job's upload goes with it, a user's uploads on disk are bounded, an upload's time is bounded
and slow uploads give their slots to new calls, waiting calls are bounded per caller and per
job, and a connection past the box's bound is answered in the error shape. The rules in
milliseconds first, then against a real service over real HTTP."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from edge_queue.errors import RequestError
from edge_queue.http.callers import Caller
from edge_queue.http.shares import (
    SLOW_AFTER_S,
    SLOW_BYTES_S,
    WAITS_PER_CALLER,
    WAITS_PER_JOB,
    Shares,
    Slot,
    slowest,
    user_bytes_allowed,
)
from edge_queue.http.statuses import status_of
from edge_queue.http.uploads import sweep, user_folder

from .conftest import wait_until
from .helpers.http_api import KEY, api_service, jobs_listed

ALICE = {"Authorization": f"Bearer {KEY}"}
A, B, C = Caller("alice", "alice"), Caller("bazarr", "addr:10.0.0.2"), Caller("bazarr", "addr:10.0.0.3")

# -- rules, in milliseconds -------------------------------------------------------------------


def test_a_new_call_takes_the_slot_of_the_slowest_slow_upload() -> None:
    fast, slow, slower, young = Slot(A, 0.0), Slot(B, 0.0), Slot(C, 0.0), Slot(A, 15.0)
    fast.received, slow.received, slower.received, young.received = 40 * SLOW_BYTES_S, 100_000, 20_000, 0
    assert slowest([fast, slow, slower, young], 20.0) is slower
    assert slowest([fast, young], 20.0) is None  # a fast one and one too young to tell
    assert slowest([slow], SLOW_AFTER_S - 1) is None

    shares = Shares(2)
    first, second = shares.take(A, 0.0), shares.take(B, 0.0)
    with pytest.raises(RequestError) as e:  # nobody is slow yet: refused
        shares.take(C, 1.0)
    assert (status_of(e.value.code), e.value.code) == (503, "busy")
    first.received, second.received = 50 * SLOW_BYTES_S, 1000
    third = shares.take(C, 20.0)
    assert second.dropped.is_set() and not first.dropped.is_set()
    assert shares.slots == [first, third]


def test_a_caller_holds_at_most_its_share_of_the_slots() -> None:
    shares = Shares(4)
    for _ in range(3):
        shares.take(A, 0.0)
    with pytest.raises(RequestError):
        shares.take(A, 0.0)
    shares.take(B, 0.0)


def test_a_users_bytes_on_disk_leave_half_to_the_others() -> None:
    mib = 2**20
    assert user_bytes_allowed(0, 10_000 * mib, 100 * mib, 2048 * mib) == 2048 * mib  # the cap
    # a 400 MiB disk: one key keeps at most half of what uploads can have
    assert user_bytes_allowed(0, 400 * mib, 0, 2048 * mib) == 200 * mib
    assert user_bytes_allowed(200 * mib, 200 * mib, 0, 2048 * mib) == 200 * mib
    assert user_bytes_allowed(0, 50 * mib, 100 * mib, 2048 * mib) == 0


def test_waiting_calls_are_bounded_per_caller_and_per_job() -> None:
    shares = Shares(32)
    for _ in range(WAITS_PER_JOB):
        shares.wait(A, "job1")
    with pytest.raises(RequestError) as e:
        shares.wait(B, "job1")  # another caller, the same job
    assert (status_of(e.value.code), e.value.code, e.value.retry_after_s) == (503, "busy", 30)
    for i in range(WAITS_PER_CALLER - WAITS_PER_JOB):
        shares.wait(A, f"job{i + 2}")
    with pytest.raises(RequestError):
        shares.may_wait(A)
    shares.may_wait(B)
    shares.done(A, "job1")
    shares.wait(B, "job1")
    shares.may_wait(A)


def test_sweep_goes_into_the_users_folders(tmp_path: Path) -> None:
    folder = user_folder(tmp_path, "../evil")
    assert folder.parent == tmp_path and len(folder.name) == 16
    folder.mkdir()
    old, new = folder / "a.wav", folder / "b.wav"
    old.write_bytes(b"x")
    new.write_bytes(b"y")
    os.utime(old, (1000.0, 1000.0))
    assert sweep(tmp_path, 3600, 1000.0 + 7200) == 1
    assert not old.exists() and new.exists()
    assert sweep(tmp_path, 3600, time.time() + 7200) == 1
    assert list(tmp_path.iterdir()) == []  # the emptied user's folder goes too


# -- a real service -----------------------------------------------------------------------------


def files_under(svc: Any) -> list[Path]:
    folder = svc.data_dir / "uploads"
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []


def pause(svc: Any, paused: bool = True) -> None:
    with svc.watcher("response/#") as w:
        assert svc.request("pause", {"paused": paused}, w)["status"] == "ok"


def gone_after_upload(url: str, data: bytes, headers: dict[str, str], name: str = "a.wav") -> None:
    """A call that uploads, then goes away while its job waits (the job goes on)."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            url + "/asr?output=txt",
            files={"audio_file": (name, data)},
            headers=headers,
            timeout=httpx.Timeout(2.0, connect=5),
        )


@pytest.mark.slow
def test_a_failed_jobs_upload_goes_with_it(
    service_factory: Any, mosquitto: Any, tmp_path: Path, model_installed: None
) -> None:
    # before: random bytes failed in ms (422) and their upload stayed for retention_days and a
    # day: one key filled 300 of 400 MiB in 6 s and every other caller got 507
    media = tmp_path / "media"
    media.mkdir()
    svc, url = api_service(service_factory, mosquitto, media)
    noise = os.urandom(1 << 20)
    first = httpx.post(url + "/asr", files={"audio_file": ("a.mp3", noise)}, headers=ALICE, timeout=60)
    assert first.status_code == 422, first.text
    code = first.json()["error"]["code"]
    assert files_under(svc) == []
    # the same audio sent again is answered from the job's error, and leaves nothing either
    again = httpx.post(url + "/asr", files={"audio_file": ("a.mp3", noise)}, headers=ALICE, timeout=60)
    assert again.status_code == 422 and again.json()["error"]["code"] == code
    assert files_under(svc) == [] and len(jobs_listed(svc)) == 1
    assert list((svc.data_dir / "uploads").iterdir()) == []  # not even the user's folder
    # a job cancelled after its caller went away: its upload goes too (no call is there to see it)
    pause(svc)
    gone_after_upload(url, os.urandom(300_000), ALICE)
    assert len(files_under(svc)) == 1
    job_id = next(j["job_id"] for j in jobs_listed(svc) if j["state"] == "queued")
    with svc.watcher("response/#") as w:
        assert svc.request("cancel", {"job_id": job_id}, w)["status"] == "ok"
    wait_until(lambda: files_under(svc) == [], 15, "the cancelled job's upload deleted")
    # an MQTT retry of it has no audio to run on (docs/http-api.md, "Sent again"): it fails,
    # naming the missing input, and the audio sent again is what runs it
    pause(svc, False)
    with svc.watcher("response/#", "jobs/+") as w:
        assert svc.request("retry", {"job_id": job_id}, w)["status"] == "ok"
        ended = w.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] in ("failed", "succeeded"), timeout=60)
    assert ended["state"] == "failed" and ended["error"]["code"] == "input_not_found", ended


@pytest.mark.slow
def test_one_users_uploads_on_disk_are_bounded(service_factory: Any, mosquitto: Any, tmp_path: Path) -> None:
    # before: no bound per user: one key's uploads filled the disk and everyone else got 507
    media = tmp_path / "media"
    media.mkdir()
    svc, url = api_service(service_factory, mosquitto, media, EDGE_QUEUE_API__MAX_USER_UPLOADS_MB="1")
    pause(svc)  # the jobs stay queued: their uploads stay on disk
    for _ in range(2):
        gone_after_upload(url, os.urandom(400_000), ALICE)
    over = httpx.post(url + "/asr", files={"audio_file": ("a.wav", os.urandom(400_000))}, headers=ALICE, timeout=30)
    assert over.status_code == 507 and over.json()["error"]["code"] == "uploads_full", over.text
    assert "max_user_uploads_mb" in over.json()["error"]["message"]
    alice = user_folder(svc.data_dir / "uploads", "alice")
    assert sum(p.stat().st_size for p in alice.iterdir()) <= 2**20
    assert len(files_under(svc)) == 2
    # another user is not held by alice's uploads
    gone_after_upload(url, os.urandom(400_000), {})
    assert len(files_under(svc)) == 3 and len(jobs_listed(svc)) == 3


def drip(port: int, headers: str, stop: threading.Event, answers: list[bytes], source: str = "127.0.0.1") -> None:
    """An upload sending 2 KiB every 0.1 s (20 KiB/s: above the 16 KiB/s floor) until it is
    answered or ``stop``; its answer (or ``closed``) is appended to ``answers``."""
    with socket.socket() as s:
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
        s.sendall(
            f"POST /asr HTTP/1.1\r\nHost: x\r\n{headers}"
            "Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 100000000\r\n\r\n"
            '--b\r\nContent-Disposition: form-data; name="audio_file"; filename="a"\r\n\r\n'.encode()
        )
        s.settimeout(0.1)
        got = b""
        while not stop.is_set():
            try:
                if not got:
                    s.sendall(b"x" * 2048)
                more = s.recv(4096)
                if not more:
                    break
                got += more
                if got.rstrip().endswith(b"}"):
                    break
            except TimeoutError:
                continue
            except OSError:
                break
        answers.append(got or b"closed")


@pytest.mark.slow
def test_an_uploads_time_is_bounded(service_factory: Any, mosquitto: Any, tmp_path: Path) -> None:
    # before: an upload above 16 KiB/s was never dropped (a 1 GiB one could last 18 hours)
    media = tmp_path / "media"
    media.mkdir()
    _, url = api_service(service_factory, mosquitto, media, EDGE_QUEUE_API__MAX_UPLOAD_S="3")
    port = int(url.rsplit(":", 1)[1])
    stop, answers = threading.Event(), []
    t0 = time.monotonic()
    t = threading.Thread(target=drip, args=(port, f"Authorization: Bearer {KEY}\r\n", stop, answers), daemon=True)
    t.start()
    try:
        wait_until(lambda: answers, 10, "the upload dropped")
    finally:
        stop.set()
        t.join(10)
    assert b" 408 " in answers[0].split(b"\r\n", 1)[0] and b"max_upload_s" in answers[0], answers
    assert time.monotonic() - t0 < 6


@pytest.mark.slow
def test_slow_uploads_give_their_slots_before_others_are_refused(
    service_factory: Any, mosquitto: Any, tmp_path: Path
) -> None:
    # before: two callers uploading at 18 KB/s held every slot, and everyone else got 503 busy
    media = tmp_path / "media"
    media.mkdir()
    _, url = api_service(service_factory, mosquitto, media, EDGE_QUEUE_API__UPLOADS_AT_ONCE="2")
    port = int(url.rsplit(":", 1)[1])
    stop, answers = threading.Event(), []
    holders = [
        threading.Thread(target=drip, args=(port, f"Authorization: Bearer {KEY}\r\n", stop, answers), daemon=True),
        threading.Thread(target=drip, args=(port, "", stop, answers, "127.0.0.2"), daemon=True),
    ]
    for t in holders:
        t.start()
    t0 = time.monotonic()

    def probe() -> httpx.Response:
        return httpx.post(url + "/asr?encode=false", files={"audio_file": ("a", b"")}, timeout=30)

    try:
        # the probes stay under the address's api.calls_per_minute (120): a 429 is no slot given
        wait_until(lambda: probe().status_code == 503, 10, "both slots held", 0.6)  # and neither slow yet
        # once both have run 10 s at 20 KiB/s, a new call takes the slowest one's slot
        other = wait_until(lambda: (r := probe()).status_code != 503 and r, SLOW_AFTER_S + 10, "a slot given", 0.6)
        assert other.status_code != 429, other.text
        assert time.monotonic() - t0 >= SLOW_AFTER_S, other.text
        wait_until(lambda: answers, 10, "a slow upload dropped")
        assert b" 408 " in answers[0].split(b"\r\n", 1)[0] and b"slowest" in answers[0], answers
    finally:
        stop.set()
        for t in holders:
            t.join(10)


@pytest.mark.slow
def test_waiting_calls_are_bounded_per_job_and_per_caller(service_factory: Any, mosquitto: Any, tmp_path: Path) -> None:
    # before: resends of one audio all waited on one job, each holding a connection for up to
    # 3 h: 254 waiting calls from 4 addresses took every connection
    media = tmp_path / "media"
    media.mkdir()
    svc, url = api_service(service_factory, mosquitto, media, EDGE_QUEUE_API__CALLS_PER_MINUTE="1000")
    pause(svc)  # no job ends: every accepted call waits
    answers: list[httpx.Response] = []

    def call(data: bytes, headers: dict[str, str]) -> None:
        try:
            answers.append(httpx.post(url + "/asr", files={"audio_file": ("a.wav", data)}, headers=headers, timeout=60))
        except httpx.HTTPError:
            pass

    def start(data: bytes, headers: dict[str, str] = ALICE) -> threading.Thread:
        t = threading.Thread(target=call, args=(data, headers), daemon=True)
        t.start()
        return t

    def refused(data: bytes) -> httpx.Response | None:
        """The answer to one more call of ``data``; None when it waits (it goes away after 10 s)."""
        try:
            return httpx.post(url + "/asr", files={"audio_file": ("a.wav", data)}, headers=ALICE, timeout=10)
        except httpx.ReadTimeout:
            return None

    same = os.urandom(10_000)
    for _ in range(WAITS_PER_JOB):
        start(same)
    wait_until(lambda: svc.log().count("waits for job") == WAITS_PER_JOB, 30, "the calls waiting")
    resend = refused(same)
    assert resend is not None, "a fifth call waits for the job"
    assert resend.status_code == 503 and resend.json()["error"]["code"] == "busy", resend.text
    assert "wait for job" in resend.json()["error"]["message"] and resend.headers["retry-after"] == "30"
    for _ in range(WAITS_PER_CALLER - WAITS_PER_JOB):
        start(os.urandom(10_000))
    wait_until(lambda: svc.log().count("waits for job") == WAITS_PER_CALLER, 60, "every call waiting")
    over = refused(os.urandom(10_000))
    assert over is not None, "one call too many waits"
    assert over.status_code == 503 and "calls of this caller" in over.json()["error"]["message"], over.text
    assert len([j for j in jobs_listed(svc) if j["state"] == "queued"]) >= WAITS_PER_CALLER - WAITS_PER_JOB + 1
    assert answers == []  # the accepted calls still wait
    # another caller still gets in
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/asr", files={"audio_file": ("a.wav", os.urandom(10_000))}, timeout=httpx.Timeout(3.0))


@pytest.mark.slow
def test_a_connection_past_the_boxs_bound_is_answered_in_the_error_shape(
    service_factory: Any, mosquitto: Any, tmp_path: Path
) -> None:
    # before: past max(256, 4 x uploads_at_once) connections, uvicorn answered a text/plain 503
    # (a body Bazarr may store as the subtitle)
    media = tmp_path / "media"
    media.mkdir()
    _, url = api_service(service_factory, mosquitto, media)
    port = int(url.rsplit(":", 1)[1])
    held: list[socket.socket] = []
    try:
        for i in range(256):  # 64 from each of four addresses: each within its address's share
            s = socket.socket()
            s.bind((f"127.0.0.{2 + i // 64}", 0))
            s.connect(("127.0.0.1", port))
            held.append(s)
        with socket.socket() as s:
            s.bind(("127.0.0.6", 0))
            s.settimeout(10)
            s.connect(("127.0.0.1", port))
            s.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
            answer = b""
            while chunk := s.recv(4096):
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert b" 503 " in head.split(b"\r\n", 1)[0] and b"application/json" in head, answer
        assert b'"busy"' in body and b"every connection" in body
    finally:
        for s in held:
            s.close()
    wait_until(lambda: httpx.get(url + "/v1/models", headers=ALICE, timeout=5).status_code == 200, 15, "served")
