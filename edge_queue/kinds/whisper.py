"""faster-whisper, as ``transcribe`` uses it: the warm model of a worker, and the decoding of
one chunk of audio, one 30-s window after another or several windows at once.

Decoding several windows at once (faster-whisper's ``BatchedInferencePipeline``) takes about
half the CPU of decoding them one after another, at about 55-110 MiB more peak memory per
window of a batch (tiny.en, int8, 2 threads, 10 minutes of speech; docs/benchmarks.md, P3).
The pipeline is run without timestamp tokens, as faster-whisper runs it by default: with them,
it dropped the first words of one window in four (a WER of 0.073 against 0.021 without). Its
segments are then whole windows of up to 30 s; they are cut into cues at the ends of sentences
and at pauses, from word timestamps (:func:`cues`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

#: Loaded models of this worker process, keyed by (path or name, compute_type, cpu_threads, device).
_MODELS: dict[tuple[str, str, int, str], Any] = {}
#: A batched window's words are cut into a new cue after a word ending a sentence (not one of
#: :data:`ABBREVIATIONS`: "Mr. John" stays together), or at a pause of :data:`PAUSE_S`.
PAUSE_S = 1.0
ABBREVIATIONS = frozenset("mr. mrs. ms. dr. st. jr. sr. prof. vs. etc. e.g. i.e. no. mt.".split())
#: ... and a cue that has grown this long is cut after its next comma, or at its next word.
CUE_SOFT_S, CUE_HARD_S = 12.0, 20.0
#: A cue starts where the one before it ended when the pause between them is shorter than this,
#: as the sequential decoder's segments do (they were within 0.3 s of each other, measured).
CONTIGUOUS_S = 2.0
SENTENCE_END = (".", "?", "!", "。", "？", "！")


class InfoAsDebug(logging.Filter):
    """faster-whisper logs two INFO lines per call ("Processing audio with duration ...", "VAD
    filter removed ..."): 68 for a 1-hour file. They are DEBUG lines here, dropped unless
    ``log_level`` is DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.INFO:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger().isEnabledFor(logging.DEBUG)
        return True


def load_model(model: str, compute_type: str, cpu_threads: int, device: str = "cpu") -> Any:
    """A cached ``faster_whisper.WhisperModel`` on ``device`` (``cpu`` or ``cuda``; 0.3-0.5 s
    the first time on the CPU). One model per worker process: loading another drops the first."""
    key = (model, compute_type, cpu_threads, device)
    if key not in _MODELS:
        from faster_whisper import WhisperModel

        quiet = logging.getLogger("faster_whisper")
        if not any(isinstance(f, InfoAsDebug) for f in quiet.filters):
            quiet.addFilter(InfoAsDebug())
        _MODELS.clear()  # one model per worker: memory stays bounded
        _MODELS[key] = WhisperModel(model, device=device, compute_type=compute_type, cpu_threads=cpu_threads)
    return _MODELS[key]


class OneWindowEncoder:
    """A ``WhisperModel`` whose ``encode`` runs the encoder on one window at a time and hands
    the pipeline their outputs as one batch: the decoder still decodes the batch's windows
    together, and the encoder's attention (about 100 MiB per 30-s window with tiny.en) is held
    for one window only. Measured on 10 minutes of speech, batches of 4: 15.4 CPU-s and 546 MiB
    peak against 17.3 CPU-s and 632 MiB with the batch encoded at once.

    ``BatchedInferencePipeline`` reaches the encoder through its model's public ``encode``
    (faster-whisper 1.2.1, pinned in pyproject.toml); tests/test_transcribe_batched.py fails
    when it no longer does."""

    def __init__(self, model: Any) -> None:
        self.model_ = model
        self.windows_encoded = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model_, name)

    def encode(self, features: Any) -> Any:
        import ctranslate2
        import numpy as np

        if features.ndim == 2 or features.shape[0] == 1:
            self.windows_encoded += 1
            return self.model_.encode(features)
        outputs = []
        for i in range(features.shape[0]):
            outputs.append(np.array(self.model_.encode(features[i : i + 1])))
            self.windows_encoded += 1
        return ctranslate2.StorageView.from_array(np.ascontiguousarray(np.concatenate(outputs)))


def decode(
    model: Any, audio: Any, offset_s: float, *, batch_size: int, vad: bool, words: bool, **options: Any
) -> tuple[Iterator[dict[str, Any]], Any]:
    """Transcribe one chunk (``audio``: 16 kHz mono float32 samples starting ``offset_s``
    seconds into the recording). Returns the segments as they are decoded (dicts of ``start``,
    ``end`` in seconds of the recording, ``text``, and ``words`` when ``words``) and
    faster-whisper's ``TranscriptionInfo``. ``batch_size`` > 1 with ``vad`` decodes that many
    windows at once; ``options``: ``language``, ``task``, ``beam_size``, ``initial_prompt``."""
    if batch_size > 1 and vad:  # batches need VAD to find their windows
        from faster_whisper import BatchedInferencePipeline

        it, info = BatchedInferencePipeline(OneWindowEncoder(model)).transcribe(
            audio, batch_size=batch_size, vad_filter=True, without_timestamps=True, word_timestamps=True, **options
        )
        return (cue for seg in it for cue in cues(seg, offset_s, words)), info
    it, info = model.transcribe(audio, vad_filter=vad, word_timestamps=words, **options)
    return (segment(seg, offset_s, words) for seg in it), info


def segment(seg: Any, offset_s: float, words: bool) -> dict[str, Any]:
    """A faster-whisper ``Segment`` as a dict, its times shifted by ``offset_s``."""
    item: dict[str, Any] = {"start": seconds(offset_s + seg.start), "end": seconds(offset_s + seg.end)}
    item["text"] = str(seg.text)
    if words and seg.words:
        item["words"] = [word(w, offset_s) for w in seg.words]
    return item


def seconds(value: Any) -> float:
    """A time as a Python float, in seconds to the millisecond (faster-whisper gives numpy
    floats for some of its word times, which JSON encoders refuse)."""
    return round(float(value), 3)


def word(w: Any, offset_s: float) -> dict[str, Any]:
    return {
        "start": seconds(offset_s + w.start),
        "end": seconds(offset_s + w.end),
        "word": str(w.word),
        "probability": seconds(w.probability),
    }


def cues(seg: Any, offset_s: float, words: bool) -> list[dict[str, Any]]:
    """A batched window (up to 30 s, without timestamp tokens) cut into cues from its word
    timestamps: after a sentence's end and a pause, at a longer pause, after a comma once a cue
    has lasted :data:`CUE_SOFT_S`, at any word once it has lasted :data:`CUE_HARD_S`. A window
    without words stays one segment."""
    if not seg.words:
        return [segment(seg, offset_s, False)] if seg.text.strip() else []
    groups: list[list[Any]] = [[]]
    for w in seg.words:
        cur = groups[-1]
        if cur:
            last, length, pause = cur[-1], w.end - cur[0].start, w.start - cur[-1].end
            text = last.word.strip().rstrip("\"'”’)]»")
            if (
                (text.endswith(SENTENCE_END) and text.lower() not in ABBREVIATIONS)
                or pause >= PAUSE_S
                or (length > CUE_SOFT_S and text.endswith((",", ";", ":", "、", "，")))
                or length > CUE_HARD_S
            ):
                groups.append([])
        groups[-1].append(w)
    out: list[dict[str, Any]] = []
    for group in groups:
        start = group[0].start
        if out and start - out[-1]["end_raw"] < CONTIGUOUS_S:
            start = out[-1]["end_raw"]
        item: dict[str, Any] = {
            "start": seconds(offset_s + start),
            "end": seconds(offset_s + group[-1].end),
            "text": "".join(str(w.word) for w in group),
            "end_raw": group[-1].end,
        }
        if words:
            item["words"] = [word(w, offset_s) for w in group]
        out.append(item)
    for item in out:
        del item["end_raw"]
    return out
