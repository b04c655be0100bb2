"""The Wyoming listener (docs/home-assistant.md, "Voice (Assist)") against a hostile or broken
caller on the LAN, over raw sockets: every refusal is Wyoming's ``error`` event with one of the
documented codes, nothing of a refused command is submitted or left in the voice folder, and a
caller that stops sending, or stops reading, gives its connection back.

The listener is the real one, on a free port, in this process; its loop side is a recorder that
answers every command at once (the queue's own path is tests/test_wyoming.py's): these tests
are about the stream, not the job, and take a few seconds in all.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from wyoming.event import Event, async_read_event

from edge_queue.config.settings import Settings
from edge_queue.voice.server import VoiceServer

from .conftest import wait_until
from .helpers.ports import free_port

#: Seconds without a byte before the listener closes a connection (short, for the tests).
IDLE_S = 3.0
#: How long a connection must stay open after its answers to count as "open": well inside
#: ``IDLE_S``, whose clock starts at the last byte the listener read, before it answered.
OPEN_S = 0.5
A16 = {"rate": 16_000, "width": 2, "channels": 1}


class Recorder:
    """The loop's side: each command is answered at once with a ``transcript`` of its WAV's size."""

    def __init__(self) -> None:
        self.commands: list[int] = []

    def transcribe(self, wav: Path, language: str | None) -> tuple[Future[dict[str, Any]], Future[dict[str, Any]]]:
        self.commands.append(wav.stat().st_size)
        answered: Future[dict[str, Any]] = Future()
        ended: Future[dict[str, Any]] = Future()
        answered.set_result({"status": "ok", "data": {"jobs": [{"job_id": "j1"}]}})
        ended.set_result({"state": "succeeded", "result": {"text": str(wav.stat().st_size)}})
        return answered, ended

    def cancel(self, job_id: str) -> None:
        pass


@pytest.fixture(scope="module")
def listener(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VoiceServer, Recorder]]:
    data_dir = tmp_path_factory.mktemp("hostile")
    wyoming = {"enabled": True, "host": "127.0.0.1", "port": free_port(), "idle_timeout_s": IDLE_S}
    recorder = Recorder()
    server = VoiceServer(Settings(data_dir=data_dir, wyoming=wyoming), recorder)
    server.start()
    yield server, recorder
    server.stop()


def header(kind: str, **fields: Any) -> bytes:
    return (json.dumps({"type": kind, **fields}) + "\n").encode()


def chunk(pcm: bytes, **fmt: Any) -> bytes:
    return header("audio-chunk", data=fmt, payload_length=len(pcm)) + pcm


def exchange(port: int, sent: bytes, wait_s: float = 3.0) -> list[Any]:
    """What the listener answers ``sent`` with: ``(type, code)`` per event, then ``"closed"``
    when it closes the connection, or ``"open"`` when it is still open after ``wait_s``."""

    async def go() -> list[Any]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(sent)
        out: list[Any] = []
        try:
            while True:
                event = await asyncio.wait_for(async_read_event(reader), wait_s)
                if event is None:
                    out.append("closed")
                    break
                out.append((event.type, event.data.get("code")))
        except TimeoutError:
            # an "open" read longer than OPEN_S races the listener's idle timeout
            assert wait_s <= OPEN_S, f"a connection idle {wait_s:g} s may be closed for idling"
            out.append("open")
        except ConnectionResetError:
            out.append("closed")
        writer.close()
        return out

    return asyncio.run(go())


def still_serves(port: int) -> bool:
    return exchange(port, header("describe"), wait_s=OPEN_S) == [("info", None), "open"]


@pytest.mark.parametrize(
    "sent",
    [
        b'{"type": "describe", "data_length": Infinity}\n',  # json reads it; int() of it overflows
        b'{"type": "describe", "data_length": NaN}\n',
        b"[" * 40_000 + b"\n",  # nesting past the JSON decoder's recursion limit
        header("describe", data_length=30_001) + b"[" * 30_001,  # in the additional data
        header("describe", data_length=2) + b"[]",  # additional data that is not an object
        header("describe", data_length=1.5) + b"{",
        header("describe", data_length="2") + b"{}",
        header("describe", payload_length=True) + b"x",
        header("describe", payload_length=-1),
        b"\x00\xff\xfe binary junk\n",
        b"not json\n",
    ],
    ids=["infinity", "nan", "deep", "deep-data", "data-list", "float", "string", "bool", "negative", "junk", "text"],
)
def test_a_malformed_event_is_answered_invalid_request(listener: tuple[VoiceServer, Recorder], sent: bytes) -> None:
    server, _ = listener
    assert server.port is not None
    assert exchange(server.port, sent) == [("error", "invalid_request"), "closed"]
    assert still_serves(server.port)


def test_a_refused_audio_start_is_told_once_and_its_audio_dropped(listener: tuple[VoiceServer, Recorder]) -> None:
    """Formats past 48 kHz stereo (192 kHz, 4 bytes, 8 channels: 184 MB in 30 s) are refused;
    the chunks and ``audio-stop`` that follow get nothing more."""
    server, recorder = listener
    assert server.port is not None
    before = len(recorder.commands)
    for fmt in ({"rate": 192_000, "width": 4, "channels": 8}, {"rate": 16_000, "width": 2, "channels": 3}, {}):
        sent = header("transcribe") + header("audio-start", data=fmt) + chunk(b"\0" * 64, **fmt) * 5
        answers = exchange(server.port, sent + header("audio-stop") + header("describe"), wait_s=OPEN_S)
        assert answers == [("error", "invalid_request"), ("info", None), "open"], fmt
    assert len(recorder.commands) == before
    assert not list(server.voice_dir.iterdir())


@pytest.mark.parametrize(
    "bad",
    [
        chunk(b"\0" * 320, **{**A16, "rate": 48_000}),
        chunk(b"\0" * 320, **{**A16, "channels": 2}),
        chunk(b"\0" * 3, **A16),
    ],
    ids=["rate", "channels", "partial-frame"],
)
def test_a_chunk_unlike_its_audio_start_is_refused(listener: tuple[VoiceServer, Recorder], bad: bytes) -> None:
    server, recorder = listener
    assert server.port is not None
    before = len(recorder.commands)
    good = chunk(b"\0" * 320, **A16)
    sent = header("transcribe") + header("audio-start", data=A16) + good + bad + good + header("audio-stop")
    assert exchange(server.port, sent + header("describe"), wait_s=OPEN_S) == [
        ("error", "invalid_request"),
        ("info", None),
        "open",
    ]
    assert len(recorder.commands) == before
    assert not list(server.voice_dir.iterdir())
    # the same connection's next command, in order, is taken
    ok = header("transcribe") + header("audio-start", data=A16) + good + header("audio-stop")
    assert exchange(server.port, ok, wait_s=OPEN_S) == [("transcript", None), "open"]


def test_a_caller_that_stops_sending_is_told_timeout(listener: tuple[VoiceServer, Recorder]) -> None:
    server, _ = listener
    assert server.port is not None
    started = time.monotonic()
    half = header("transcribe") + header("audio-start", data=A16) + b'{"type": "audio-ch'
    assert exchange(server.port, half, wait_s=IDLE_S + 3) == [("error", "timeout"), "closed"]
    assert time.monotonic() - started < IDLE_S + 2
    assert not list(server.voice_dir.iterdir())


def test_a_caller_that_never_reads_gives_its_connection_back(listener: tuple[VoiceServer, Recorder]) -> None:
    """``describe`` after ``describe``, no answer read: once the answers have waited
    ``wyoming.idle_timeout_s`` the connection is dropped (before, it was held for good: four
    such callers took an address's every connection, 32 the listener's)."""
    server, _ = listener
    assert server.port is not None
    wait_until(lambda: server.open == 0, 5, "the listener idle")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    sock.settimeout(0.2)
    burst = header("describe") * 200
    deadline = time.monotonic() + IDLE_S + 5
    dropped = False
    while time.monotonic() < deadline and not dropped:
        try:
            sock.sendall(burst)
        except TimeoutError:
            pass  # the listener reads no more: it is stuck writing
        except OSError:
            dropped = True
        if server.open == 0:
            dropped = True
    sock.close()
    assert dropped, f"a caller that reads nothing still holds its connection after {IDLE_S + 5:g} s"
    assert still_serves(server.port)


def test_an_event_of_another_service_is_let_pass(listener: tuple[VoiceServer, Recorder]) -> None:
    server, _ = listener
    assert server.port is not None
    event = Event("ping", {"text": "x"})
    sent = header(event.type, data=event.data) + header("describe")
    assert exchange(server.port, sent, wait_s=OPEN_S) == [("info", None), "open"]


def test_a_chunk_is_at_most_a_second_of_the_largest_format(listener: tuple[VoiceServer, Recorder]) -> None:
    """1 s of 48-kHz stereo s16 in one chunk is taken; a chunk over 256 KiB is refused before
    it is read (at 2 MiB, 32 connections held some 200 MiB of the service's memory)."""
    server, _ = listener
    assert server.port is not None
    stereo = {"rate": 48_000, "width": 2, "channels": 2}
    second = header("transcribe") + header("audio-start", data=stereo) + chunk(b"\0" * 192_000, **stereo)
    assert exchange(server.port, second + header("audio-stop"), wait_s=OPEN_S) == [("transcript", None), "open"]
    over = header("audio-chunk", data=stereo, payload_length=256 * 1024 + 4)
    assert exchange(server.port, over) == [("error", "payload_too_large"), "closed"]


def test_a_command_that_would_take_the_disk_below_its_floor_is_refused(tmp_path: Path) -> None:
    """``audio-start`` when the command's longest audio would leave less than
    ``limits.min_free_disk_mb`` free: ``disk_full``, nothing written, the next command on a
    disk with room taken (before, the audio was written until the disk was full, under the
    store's own files)."""
    import shutil

    free_mb = shutil.disk_usage(tmp_path).free // 2**20
    wyoming = {"enabled": True, "host": "127.0.0.1", "port": free_port(), "idle_timeout_s": IDLE_S}
    # the floor: 1 MiB more than is free once this command's 30 s of 16-kHz s16 (0.92 MiB) are taken
    settings = Settings(data_dir=tmp_path, wyoming=wyoming, limits={"min_free_disk_mb": free_mb})
    recorder = Recorder()
    server = VoiceServer(settings, recorder)
    server.start()
    try:
        assert server.port is not None
        sent = header("transcribe") + header("audio-start", data=A16) + chunk(b"\0" * 320, **A16)
        answers = exchange(server.port, sent + header("audio-stop") + header("describe"), wait_s=OPEN_S)
        assert answers == [("error", "disk_full"), ("info", None), "open"]
        assert not recorder.commands and not list(server.voice_dir.iterdir())
    finally:
        server.stop()
