"""``diarize``: the voices of a transcript's segments, read from the recording once more as a
stream (docs/topics.md, "Speakers"). Each segment's audio (the speech the transcription found)
is raised to Resemblyzer's loudness and embedded by :mod:`.voice_encoder` in windows of 1.6 s;
:mod:`.speakers` does the rest. Memory is bounded by the longest segment and the audio between
two segments, not the recording.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from edge_queue.errors import ErrorCode, JobError

from .speakers import Voice, labelled
from .voice_encoder import SAMPLE_RATE, DamagedVoiceModel, NoVoiceModel, encoder, louder, partial_mels

#: Windows a second within a segment: Resemblyzer's ``embed_utterance`` default.
WINDOW_RATE = 1.3
#: Windows embedded at once: the LSTM's 480 steps are paid once a batch, not once a segment (132
#: windows of 2 minutes: 4.8 CPU-s a segment at a time). 32 windows' gates take 21 MB.
BATCH = 32


def require_voice_model() -> None:
    """The voice encoder loaded (0.1 s, kept for the process), before anything is decoded.
    Raises :class:`JobError` ``internal_error``, not retryable (another attempt on this box
    would fail the same), when the weights are not installed or cannot be loaded: the message
    names the file and the remedy."""
    try:
        encoder()
    except (NoVoiceModel, DamagedVoiceModel) as e:
        raise JobError(str(e), code=ErrorCode.INTERNAL_ERROR, retryable=False) from e


def segment_audio(blocks: Iterator[Any], spans: list[tuple[float, float]]) -> Iterator[Any]:
    """The audio (16 kHz float32) of each ``(start, end)`` of ``spans`` (s, in order of start)
    from ``blocks`` (16 kHz float32 blocks from the recording's start): audio before the next
    span's start is let go. A span past the end of the audio gets what there is (maybe none)."""
    import numpy as np

    buf, buf_start = np.zeros(0, np.float32), 0  # buf_start: the sample buf[0] is
    for start_s, end_s in spans:
        a, b = int(start_s * SAMPLE_RATE), max(int(end_s * SAMPLE_RATE), int(start_s * SAMPLE_RATE))
        while buf_start + buf.shape[0] < b:
            block = next(blocks, None)
            if block is None:
                break
            buf = np.concatenate([buf, block])
        drop = max(0, min(a - buf_start, buf.shape[0]))
        buf, buf_start = buf[drop:], buf_start + drop
        yield buf[max(0, a - buf_start) : max(0, b - buf_start)]


def voices(blocks: Iterator[Any], segments: list[dict[str, Any]], checkpoint: Callable[[], None]) -> list[Voice]:
    """A :class:`~.speakers.Voice` for each of ``segments`` (``start``, ``end`` in s, in order),
    from the recording's audio ``blocks``; ``checkpoint`` called between batches (a cancel
    raises there)."""
    import numpy as np

    enc = encoder()
    spans = [(float(s["start"]), float(s["end"])) for s in segments]
    mels, owners, windows_of = [], [], []
    for k, ((start_s, _), audio) in enumerate(zip(spans, segment_audio(blocks, spans), strict=True)):
        if audio.shape[0] == 0:
            audio = np.zeros(SAMPLE_RATE // 10, np.float32)
        windows, firsts = partial_mels(louder(audio), rate=WINDOW_RATE)
        mels.append(windows)
        owners += [k] * windows.shape[0]
        windows_of.append([(start_s + f / SAMPLE_RATE, start_s + f / SAMPLE_RATE + 1.6) for f in firsts])
    every = np.concatenate(mels)
    embedded = []
    for i in range(0, every.shape[0], BATCH):
        checkpoint()
        embedded.append(enc.embed_mels(every[i : i + BATCH]))
    embeddings = np.concatenate(embedded)
    out, at = [], 0
    for (start_s, end_s), wspans in zip(spans, windows_of, strict=True):
        mine = embeddings[at : at + len(wspans)]
        at += len(wspans)
        mean = mine.mean(axis=0)
        out.append(Voice(mean / max(float(np.linalg.norm(mean)), 1e-12), end_s - start_s, mine, wspans))
    return out


def diarized(
    blocks: Iterator[Any],
    segments: list[dict[str, Any]],
    min_speakers: int | None,
    max_speakers: int | None,
    checkpoint: Callable[[], None] = lambda: None,
) -> tuple[list[dict[str, Any]], int]:
    """``segments`` with their speakers (:func:`.speakers.labelled`) and the number found.
    Raises :class:`~.voice_encoder.NoVoiceModel` when the weights are not installed,
    :class:`~.voice_encoder.DamagedVoiceModel` when they cannot be loaded."""
    if not segments:
        return [], 0
    return labelled(segments, voices(blocks, segments, checkpoint), min_speakers or 1, max_speakers)
