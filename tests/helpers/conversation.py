"""A two-voice conversation built from the shared clips, with an exact reference of who speaks
when, for the tests of ``diarize`` (docs/topics.md, "Speakers")."""

from __future__ import annotations

import wave
from pathlib import Path
from typing import Any

#: Seconds of silence between two turns.
GAP_S = 0.7


def conversation(speech: Path, path: Path) -> list[tuple[str, float, float]]:
    """JFK (cut in two turns at 5.2 s) and the LibriVox reader in turn, 0.7 s apart, as a 16 kHz
    WAV at ``path``; the reference ``(voice, start, end)`` of each turn (29 s in all): jfk,
    reader, jfk, reader, reader."""
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
    """The reference voice that speaks most of ``segment`` (``start``, ``end`` in s)."""
    return max(ref, key=lambda r: min(segment["end"], r[2]) - max(segment["start"], r[1]))[0]


def need_voice_model() -> None:
    """Skip (fail under ``CI=true``) when the voice encoder's weights are not installed."""
    from edge_queue.kinds import voice_encoder

    from ..conftest import need

    try:
        voice_encoder.weights_path()
    except voice_encoder.NoVoiceModel as e:
        need(False, str(e))
