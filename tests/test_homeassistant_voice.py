"""edge-queue's Wyoming listener (docs/home-assistant.md, "Voice (Assist)") as the real Home
Assistant Core uses it: announced by mDNS, discovered by Home Assistant's zeroconf integration
as a ``wyoming`` config flow and confirmed through the config-flow REST API, as the Discovered
card of Settings → Devices & services confirms it, and a spoken command
(espeak-ng) transcribed through Home Assistant's own speech-to-text REST API
(``/api/stt/<entity>``) and through an Assist pipeline run over its WebSocket API.

Home Assistant runs with ``--skip-pip``: the ``wyoming`` package its integration requires is
installed into its runtime once (``integration_requirements``).
"""

from __future__ import annotations

import io
import os
import shutil
import struct
import subprocess
import time
import wave
from pathlib import Path
from typing import Any

import pytest

from .conftest import need, wait_until
from .helpers.figures import figures
from .helpers.http_api import pcm_of
from .helpers.ports import free_port
from .homeassistant_support import HOME_ASSISTANT_MARKS, harness, integration_requirements, service

pytestmark = HOME_ASSISTANT_MARKS

SAID = "turn on the kitchen lights"
#: Home Assistant's header for a WAV of 16-kHz mono s16 in English (components/stt: the
#: language must be one of the entity's own, exactly: the ``en`` edge-queue's ``describe`` gives).
SPEECH_CONTENT = "format=wav; codec=pcm; sample_rate=16000; bit_rate=16; channel=1; language=en"


@pytest.fixture
def wyoming_requirements() -> None:
    """The ``wyoming`` integration's requirements, installed into Home Assistant's runtime
    before the session's Home Assistant (``ha``) starts, when this test is the first to use it."""
    integration_requirements(harness(), "wyoming")


def words(text: str | None) -> list[str]:
    return "".join(c for c in (text or "").lower() if c.isalpha() or c == " ").split()


def spoken_wav(tmp: Path) -> tuple[bytes, bytes]:
    """``SAID`` by espeak-ng: 16-kHz mono s16 PCM, and the same as a WAV file's bytes."""
    need(shutil.which("espeak-ng") is not None, "espeak-ng is not installed (apt-get install espeak-ng)")
    said = tmp / "said.wav"
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "150", "-w", str(said), SAID], check=True, timeout=30)
    pcm = pcm_of(said)
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm)
    return pcm, out.getvalue()


def post_speech(inst: dict[str, Any], entity_id: str, wav: bytes, content: str = SPEECH_CONTENT) -> tuple[int, Any]:
    """``POST /api/stt/<entity_id>`` with the WAV as its body, as a voice satellite sends it."""
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        f"{inst['url']}/api/stt/{entity_id}",
        data=wav,
        method="POST",
        headers={"Authorization": f"Bearer {inst['token']}", "X-Speech-Content": content},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def send_binary(ws: Any, data: bytes) -> None:
    """One binary WebSocket frame (masked, as a client sends it) on the harness's connection."""
    head = bytearray([0x82])
    n = len(data)
    if n < 126:
        head.append(0x80 | n)
    elif n < 65536:
        head += bytes([0x80 | 126]) + struct.pack(">H", n)
    else:
        head += bytes([0x80 | 127]) + struct.pack(">Q", n)
    mask = os.urandom(4)
    ws.sock.sendall(bytes(head) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))


def pipeline_transcript(h: Any, inst: dict[str, Any], pipeline_id: str, pcm: bytes) -> dict[str, Any]:
    """An Assist pipeline run of its speech-to-text stage alone (``assist_pipeline/run``), the
    audio sent as the Home Assistant app sends it (binary frames, the handler id first, an
    empty one to end); its ``stt-end`` event's data."""
    ws = h.WS("127.0.0.1", inst["http_port"], inst["token"])
    try:
        ws.send(
            {
                "id": 1,
                "type": "assist_pipeline/run",
                "start_stage": "stt",
                "end_stage": "stt",
                "input": {"sample_rate": 16000},
                "pipeline": pipeline_id,
            }
        )
        handler: int | None = None
        while True:
            msg = ws.recv()
            if msg.get("type") == "result":
                assert msg.get("success"), msg
                continue
            event = msg.get("event") or {}
            if event.get("type") == "run-start":
                handler = int(event["data"]["runner_data"]["stt_binary_handler_id"])
                prefix = bytes([handler])
                for i in range(0, len(pcm), 3200):  # 100-ms chunks
                    send_binary(ws, prefix + pcm[i : i + 3200])
                send_binary(ws, prefix)
            elif event.get("type") == "stt-end":
                return dict(event["data"])
            elif event.get("type") in ("error", "run-end"):
                raise AssertionError(f"the pipeline ended without a transcript: {msg}")
    finally:
        ws.close()


@pytest.mark.usefixtures("model_installed", "wyoming_requirements")
def test_home_assistant_transcribes_a_command_through_edge_queue(ha, tmp_path: Path) -> None:
    h, inst, broker = ha
    pcm, wav = spoken_wav(tmp_path)
    # Given edge-queue with its Wyoming listener on, on every interface, as a LAN box has it
    port = free_port()
    svc = service(broker, tmp_path, [tmp_path], "data")
    svc.env.update(
        EDGE_QUEUE_WYOMING__ENABLED="true",
        EDGE_QUEUE_WYOMING__HOST="0.0.0.0",
        EDGE_QUEUE_WYOMING__PORT=str(port),
        EDGE_QUEUE_WORKERS="1",
    )
    svc.start()
    entry_id = None
    url, tok = inst["url"], inst["token"]
    try:
        wait_until(lambda: "announced by zeroconf" in svc.log(), 30, "the Wyoming listener announced")

        def discovered() -> dict[str, Any] | None:
            flows = h.ws_call(inst, "config_entries/flow/progress")  # the Discovered cards
            return next(
                (f for f in flows if f["handler"] == "wyoming" and f["context"].get("source") == "zeroconf"), None
            )

        # When Home Assistant discovers it (the Discovered card) and its user confirms it
        flow = wait_until(discovered, 60, "Home Assistant's zeroconf discovery of the listener", interval=0.5)
        code, res = h.http("POST", f"{url}/api/config/config_entries/flow/{flow['flow_id']}", token=tok, body={})
        # Then the entry is created at the announced port, named as edge-queue's describe names
        # its service
        assert code == 200 and res.get("type") == "create_entry", (code, res)
        entry_id = res["result"]["entry_id"]
        assert res["title"] == "edge-queue", res
        entry = next(e for e in h.ws_call(inst, "config_entries/get") if e["entry_id"] == entry_id)
        assert entry["source"] == "zeroconf", entry

        def stt_entity() -> str | None:
            for e in h.ws_call(inst, "config/entity_registry/list"):
                if e.get("config_entry_id") == entry_id and e["entity_id"].startswith("stt."):
                    return str(e["entity_id"])
            return None

        eid = wait_until(stt_entity, 30, "the wyoming entry's speech-to-text entity", interval=0.2)
        code, spec = h.http("GET", f"{url}/api/stt/{eid}", token=tok)
        assert code == 200 and "en" in spec["languages"], (code, spec)
        # (a language that is not one of the entity's own exactly is refused, before any audio)
        assert post_speech(inst, eid, wav[:44], SPEECH_CONTENT.replace("=en", "=en-US"))[0] == 415
        # When a spoken command is posted to Home Assistant's speech-to-text API
        started = time.monotonic()
        code, answer = post_speech(inst, eid, wav)
        rest_s = time.monotonic() - started
        # Then Home Assistant answers with its words, a success
        assert code == 200, (code, answer)
        assert answer["result"] == "success" and words(answer["text"]) == SAID.split(), answer
        # and an Assist pipeline with edge-queue as its speech-to-text engine hears the same
        pipeline = h.ws_call(
            inst,
            "assist_pipeline/pipeline/create",
            conversation_engine="conversation.home_assistant",
            conversation_language="en",
            language="en",
            name="edge-queue voice",
            stt_engine=eid,
            stt_language="en",
            tts_engine=None,
            tts_language=None,
            tts_voice=None,
            wake_word_entity=None,
            wake_word_id=None,
        )
        started = time.monotonic()
        heard = pipeline_transcript(h, inst, pipeline["id"], pcm)
        pipeline_s = time.monotonic() - started
        assert words(heard["stt_output"]["text"]) == SAID.split(), heard
        h.ws_call(inst, "assist_pipeline/pipeline/delete", pipeline_id=pipeline["id"])
        figures(
            home_assistant=inst.get("ha_version"),
            stt_entity=eid,
            audio_s=round(len(pcm) / 32000, 2),
            rest_stt_s=round(rest_s, 2),
            pipeline_stt_s=round(pipeline_s, 2),
        )
    finally:
        if entry_id is not None:  # the next tests' Home Assistant has no entry left retrying
            h.http("DELETE", f"{url}/api/config/config_entries/entry/{entry_id}", token=tok)
        svc.stop()
