"""Who said what through the real service (docs/topics.md, "Speakers"; docs/http-api.md): a
two-voice conversation built from the shared clips, with an exact reference, sent to
``POST /asr?diarize=true``; and ``max_speakers`` below ``min_speakers`` refused at submit over
MQTT."""

from __future__ import annotations

import json
import wave
from pathlib import Path
from typing import Any

import httpx
import pytest

from edge_queue.kinds import voice_encoder
from edge_queue.requests.outputs import cues

from .conftest import need
from .helpers.http_api import api_service

GAP_S = 0.7


def conversation(speech: Path, path: Path) -> list[tuple[str, float, float]]:
    """JFK (cut in two turns at 5.2 s) and the LibriVox reader in turn, 0.7 s apart, as a 16 kHz
    WAV at ``path``; the reference ``(voice, start, end)`` of each turn (29 s in all)."""
    import numpy as np

    from edge_queue.kinds.audio import decode_pcm

    def clip(name: str) -> Any:
        return np.concatenate(list(decode_pcm(str(speech / name))))

    jfk, cut = clip("jfk.flac"), int(5.2 * 16000)
    turns = [("jfk", jfk[:cut]), ("reader", clip("librivox-0870.wav")), ("jfk", jfk[cut:])]
    turns += [("reader", clip("librivox-0890.wav")), ("reader", clip("librivox-0930.wav"))]
    gap = np.zeros(int(GAP_S * 16000), np.float32)
    parts, ref, t = [], [], 0.0
    for who, audio in turns:
        parts += [audio, gap]
        ref.append((who, t, t + audio.shape[0] / 16000))
        t += audio.shape[0] / 16000 + GAP_S
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes((np.clip(np.concatenate(parts), -1, 1) * 32767).astype("<i2").tobytes())
    return ref


def voice_of(segment: dict[str, Any], ref: list[tuple[str, float, float]]) -> str:
    """The reference voice that speaks most of ``segment``."""
    return max(ref, key=lambda r: min(segment["end"], r[2]) - max(segment["start"], r[1]))[0]


@pytest.mark.slow
def test_asr_labels_a_two_voice_conversation_with_the_right_speakers(
    service_factory: Any, mosquitto: Any, speech: Path, tmp_path: Path, model_installed: None
) -> None:
    try:
        voice_encoder.weights_path()
    except voice_encoder.NoVoiceModel as e:
        need(False, str(e))
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
