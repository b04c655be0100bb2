"""faster-whisper, as ``transcribe`` uses it: the warm model of a worker, and the decoding of
one chunk of audio, one 30-s window after another or several windows at once.

Decoding several windows at once (faster-whisper's ``BatchedInferencePipeline``) takes about
two thirds of the CPU of decoding them one after another, at about 30 MiB more peak memory per
window of a batch (tiny.en, int8, 2 threads, 10 minutes of speech; docs/benchmarks.md, P3).
The pipeline is run without timestamp tokens, as faster-whisper runs it by default: with them,
it dropped the first words of one window in four (a WER of 0.073 against 0.021 without). Its
segments are then whole windows of up to 30 s; they are cut into cues at the ends of sentences
and at pauses, from word timestamps (:func:`cues`).

A batched window can end early: the decoder gives its end-of-text token after the first
sentences, and the rest of the window's speech is lost (22 s of a 10-minute file, seen with
batches of 6). Speech the batched decoder left out between two windows' words is decoded again
one window after another (:func:`batched_segments`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

from .segment_tokens import cut, vocabulary

log = logging.getLogger(__name__)

#: Loaded models of this worker process, keyed by (path or name, compute_type, cpu_threads,
#: device, replicas), least recently used first, with the monotonic time of their last use.
_MODELS: dict[tuple[str, str, int, str, int], Any] = {}
_USED: dict[tuple[str, str, int, str, int], float] = {}
#: Loaded models kept past ``transcribe.idle_unload_s`` (:func:`keep_warm_since`).
_KEPT_WARM: set[tuple[str, str, int, str, int]] = set()
#: Models a worker keeps loaded at once: the multilingual one that tells the language and the
#: one a language goes to (``transcribe.language_models``: base and tiny.en, 237 MiB of
#: weights in memory together); loading a third drops the least recently used. While a job
#: decodes, the worker holds ``transcribe.keep_models`` of them (:func:`hold_while_decoding`).
KEEP_MODELS = 2
#: Held by a chunk's VAD and feature extraction, and by each window's encoder (uncontended when
#: one chunk is decoded at a time). With ``transcribe.chunks_at_once`` > 1 the steps with the
#: largest transient memory (about 85 MiB for VAD on 120 s, 135 MiB for a window's encoder
#: attention with tiny.en) do not add up; the decoders and the aligners run side by side.
HEAVY_STEP = threading.RLock()
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
#: Sample rate of the audio faster-whisper decodes (Hz).
SAMPLE_RATE = 16_000
#: A stretch of at least this many seconds between the words of two batched windows (or
#: before the first, or after the last) is checked for speech the batched decoder left out...
MISSED_GAP_S = 2.0
#: ... from this far after the word before it to this far before the word after it (word
#: times from alignment are about 0.2 s off), and its speech is decoded one window after
#: another when VAD finds at least :data:`MISSED_SPEECH_MS` of it.
MISSED_MARGIN_S = 0.3
MISSED_SPEECH_MS = 500
#: A window decodes at most :data:`TOKENS_S` tokens per second of the audio it is given (up to
#: 30 s), plus :data:`TOKENS_MIN`, and never more than :data:`MAX_NEW_TOKENS`: the most that
#: fit beside the longest prompt faster-whisper builds (448, the model's length, less 1 + 223
#: tokens of previous text + 4 of the start sequence). Speech decoded here took 3-8 tokens a
#: second (espeak French the most); a loop fills the window: 448 tokens for 6.6 s of espeak
#: French, and again at each higher temperature faster-whisper retries it at (docs/topics.md,
#: "Made-up text").
TOKENS_S, TOKENS_MIN, MAX_NEW_TOKENS = 12, 16, 220


class InfoAsDebug(logging.Filter):
    """faster-whisper logs two INFO lines per call ("Processing audio with duration ...", "VAD
    filter removed ..."): 68 for a 1-hour file. They are DEBUG lines here, dropped unless
    ``log_level`` is DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.INFO:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger().isEnabledFor(logging.DEBUG)
        return True


def load_model(model: str, compute_type: str, cpu_threads: int, device: str = "cpu", replicas: int = 1) -> Any:
    """A cached ``faster_whisper.WhisperModel`` on ``device`` (``cpu`` or ``cuda``; 0.3-0.5 s
    the first time on the CPU), with ``replicas`` that may decode at once from as many threads
    (``num_workers``; they share the weights), each on ``cpu_threads`` threads. At most
    :data:`KEEP_MODELS` per worker process: loading another drops the least recently used."""
    key = (model, compute_type, cpu_threads, device, replicas)
    if key not in _MODELS:
        from faster_whisper import WhisperModel

        quiet = logging.getLogger("faster_whisper")
        if not any(isinstance(f, InfoAsDebug) for f in quiet.filters):
            quiet.addFilter(InfoAsDebug())
        while len(_MODELS) >= KEEP_MODELS:  # memory stays bounded
            _drop(next(iter(_MODELS)))
        limit_arenas(SHARED_ARENAS if replicas > 1 else WORKER_ARENAS)
        release_free_memory()  # the last job's freed buffers, before the load's own peak
        t0 = time.monotonic()
        _MODELS[key] = WhisperModel(
            model, device=device, compute_type=compute_type, cpu_threads=cpu_threads, num_workers=replicas
        )
        log.debug("model %s (%s) loaded in %.1f s", model, compute_type, time.monotonic() - t0)
    _MODELS[key] = _MODELS.pop(key)  # the most recently used last
    _USED[key] = time.monotonic()
    return _MODELS[key]


def _drop(key: tuple[str, str, int, str, int]) -> None:
    del _MODELS[key]
    _USED.pop(key, None)
    _KEPT_WARM.discard(key)


def keep_warm_since(since: float) -> int:
    """Keep the models used since ``since`` (monotonic seconds) loaded past
    ``transcribe.idle_unload_s`` (:func:`unload_idle` passes over them; a job that needs a
    third model, or ``transcribe.keep_models``, still releases them): the worker calls it after
    a voice command, whose caller waits for the model to load (0.2-1.5 s) when it was released
    in a quiet spell. Returns how many models are kept so."""
    used = {key for key, at in _USED.items() if at >= since}
    _KEPT_WARM.update(used)
    return len(used)


def to_release(held: list[Any], using: Any, keep: int) -> list[Any]:
    """The models to release before a job decodes with ``using`` (``held``: the models loaded,
    least recently used first): all but ``using`` and the ``keep`` - 1 others used last."""
    others = [key for key in held if key != using]
    return others[: max(0, len(others) - (keep - 1))]


def hold_while_decoding(model: Any, keep: int) -> int:
    """Release the models other than ``model`` (one :func:`load_model` gave) down to ``keep``
    models held (``transcribe.keep_models``), and give their memory back to the system, before
    a job decodes with ``model``. With 1, an English job holds tiny.en alone as it decodes, not
    base beside it, which told its language: a worker peaked at 401 MiB on 5 minutes of
    English, against 483 with base held and 386 with English given (bench/p9_worker_memory.py,
    docs/configuration.md ``transcribe.keep_models``). Returns how many were released."""
    using = next((key for key, held in _MODELS.items() if held is model), None)
    gone = to_release(list(_MODELS), using, keep)
    _release(gone)
    return len(gone)


def _release(keys: list[tuple[str, str, int, str, int]]) -> None:
    for key in keys:
        _drop(key)
    if keys:
        import gc

        gc.collect()  # CTranslate2 frees the weights when the last reference goes
        release_free_memory()


def unload_idle(idle_s: float, now: float | None = None) -> int:
    """Release the models not used for ``idle_s`` seconds (``transcribe.idle_unload_s``; 0
    releases none) at ``now`` (monotonic seconds), but those kept warm
    (:func:`keep_warm_since`), and give their memory back to the system.
    Returns how many were released. Called by the worker between jobs."""
    if idle_s <= 0:
        return 0
    now = time.monotonic() if now is None else now
    idle = [key for key, used in _USED.items() if now - used >= idle_s]
    if kept := [key for key in idle if key in _KEPT_WARM]:
        log.debug("kept warm %d model(s) unused for %g s: a voice command's", len(kept), idle_s)
        idle = [key for key in idle if key not in _KEPT_WARM]
    _release(idle)
    if idle:
        log.info("released %d model(s) unused for %g s (transcribe.idle_unload_s)", len(idle), idle_s)
    return len(idle)


def loaded_models() -> int:
    """How many models this worker process holds now."""
    return len(_MODELS)


class OneWindowEncoder:
    """A ``WhisperModel`` whose ``encode`` runs the encoder on one window at a time and hands
    the pipeline their outputs as one batch: the decoder still decodes the batch's windows
    together, and the encoder's attention (about 100 MiB per 30-s window with tiny.en) is held
    for one window only. Measured on 10 minutes of speech, batches of 4: 15.4 CPU-s and 546 MiB
    peak against 17.3 CPU-s and 632 MiB with the batch encoded at once.

    Word times are aligned one window at a time too (``add_word_timestamps``): aligning a batch
    of 4 at once held about 130 MiB more at the peak and took more CPU (2.6-3.1 s against
    1.9-2.2 s for 10 minutes).

    ``BatchedInferencePipeline`` reaches the encoder and the aligner through its model's public
    ``encode`` and ``add_word_timestamps`` (faster-whisper 1.2.1, pinned in pyproject.toml);
    tests/test_transcribe_batched.py fails when it no longer does."""

    def __init__(self, model: Any) -> None:
        self.model_ = model
        self.windows_encoded = 0
        self.windows_aligned = 0
        self.batch_output: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model_, name)

    def encode(self, features: Any) -> Any:
        """``features``: log-Mel windows, shape (batch, 80, 3000) or (80, 3000). Returns the
        encoder's output for all of them, shape (batch, 1500, width), as a ``StorageView``."""
        import ctranslate2
        import numpy as np

        if features.ndim == 2:
            features = features[None]
        outputs = []
        for i in range(features.shape[0]):
            with HEAVY_STEP:
                outputs.append(np.array(self.model_.encode(features[i : i + 1])))
            self.windows_encoded += 1
        self.batch_output = np.ascontiguousarray(np.concatenate(outputs))
        return ctranslate2.StorageView.from_array(self.batch_output)

    def add_word_timestamps(
        self,
        segments: list[list[dict[str, Any]]],
        tokenizer: Any,
        encoder_output: Any,
        num_frames: list[int],
        prepend_punctuations: str,
        append_punctuations: str,
        last_speech_timestamp: float,
    ) -> float:
        """``WhisperModel.add_word_timestamps`` for the batch :meth:`encode` encoded last, one
        window after another (``segments``: per window, its segments; ``num_frames``: per
        window). Returns the end of the last speech, in seconds, as faster-whisper does."""
        import ctranslate2

        for i, window in enumerate(segments):
            if not window:
                continue
            last_speech_timestamp = self.model_.add_word_timestamps(
                [window],
                tokenizer,
                ctranslate2.StorageView.from_array(self.batch_output[i : i + 1]),
                [num_frames[i]],
                prepend_punctuations,
                append_punctuations,
                last_speech_timestamp,
            )
            self.windows_aligned += 1
        return last_speech_timestamp


#: glibc's ``mallopt`` parameter for the most arenas a process keeps (``M_ARENA_MAX``).
M_ARENA_MAX = -8
#: Arenas a worker's heap may use: one for the worker's own thread and one shared by
#: CTranslate2's and onnxruntime's threads. glibc's default (8 per core) gave each thread an
#: arena of its own, and memory one thread freed stayed resident beside the next thread's
#: allocations: a 1-hour file peaked at 513-528 MiB against 464 with 2 arenas (batches of 6).
WORKER_ARENAS = 2
#: ... and when chunks are decoded at once (``transcribe.chunks_at_once``): one, shared by
#: every thread, so that what one chunk's decoder frees serves the other's. Two chunks at once
#: on 10 minutes (prototype, batches of 4): 462-485 MiB against 508-532 with 2 arenas; one
#: chunk at a time: 389 against 385 (no gain).
SHARED_ARENAS = 1


@functools.cache
def _libc() -> Any:
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim, libc.mallopt  # noqa: B018 - glibc's, or nothing
        return libc
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return None


def limit_arenas(arenas: int = WORKER_ARENAS) -> None:
    """Keep the worker's heap in ``arenas`` glibc arenas (``mallopt(M_ARENA_MAX)``; a no-op
    elsewhere). Called before the model starts its threads: a thread keeps the arena it first
    allocated in."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_ARENA_MAX, arenas)


def release_free_memory() -> None:
    """Give the pages the heap holds free back to the system (glibc's ``malloc_trim(0)``;
    a no-op elsewhere). CTranslate2 decodes on threads of its own: without this, what VAD
    freed on this thread stayed resident while the decoder grew, and the chunk before's decoder
    buffers while VAD ran. Called before and after each batched chunk's VAD: peak 435-442 MiB
    against 498-502 with batches of 6 on 10 minutes of speech (docs/benchmarks.md, P3)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def decode(
    model: Any, audio: Any, offset_s: float, *, batch_size: int, vad: bool, words: bool, **options: Any
) -> tuple[Iterator[dict[str, Any]], Any]:
    """Transcribe one chunk (``audio``: 16 kHz mono float32 samples starting ``offset_s``
    seconds into the recording). Returns the segments as they are decoded (dicts of ``start``,
    ``end`` in seconds of the recording, ``text``, and ``words`` when ``words``) and
    faster-whisper's ``TranscriptionInfo``. ``batch_size`` > 1 with ``vad`` decodes that many
    windows at once; ``options``: ``language``, ``task``, ``beam_size``, ``initial_prompt``.
    Each window decodes at most :func:`token_budget` tokens."""
    options = {"max_new_tokens": token_budget(len(audio) / SAMPLE_RATE), **options}
    if batch_size > 1 and vad:  # batches need VAD to find their windows
        from faster_whisper import BatchedInferencePipeline

        with HEAVY_STEP:  # VAD and the features run here; the windows are decoded as they are read
            release_free_memory()  # the chunk before's decoder buffers, before VAD runs
            it, info = BatchedInferencePipeline(OneWindowEncoder(model)).transcribe(
                audio,
                batch_size=batch_size,
                vad_filter=True,
                without_timestamps=True,
                word_timestamps=True,
                **options,
            )
            release_free_memory()  # VAD's buffers, before the decoder's
        return batched_segments(model, audio, offset_s, it, words, options), info
    it, info = model.transcribe(audio, vad_filter=vad, word_timestamps=words, **options)
    return (segment(seg, offset_s, words) for seg in it), info


def token_budget(audio_s: float) -> int:
    """The most tokens each window of a chunk of ``audio_s`` seconds decodes (:data:`TOKENS_S`)."""
    return min(MAX_NEW_TOKENS, TOKENS_MIN + math.ceil(TOKENS_S * min(audio_s, 30.0)))


def missed_stretch(heard_s: float, next_s: float, duration_s: float) -> tuple[float, float] | None:
    """Where to look for speech a batched decoder left out before a word: ``heard_s``, the end
    of the last word decoded (0 before the first), ``next_s``, the start of the next word (or
    ``duration_s``, the chunk's end), all in seconds of the chunk. ``None`` when the two are
    less than :data:`MISSED_GAP_S` apart; else the stretch between them, narrowed by
    :data:`MISSED_MARGIN_S` on the sides that touch a word."""
    if next_s - heard_s < MISSED_GAP_S:
        return None
    start = heard_s + MISSED_MARGIN_S if heard_s > 0 else 0.0
    end = next_s - MISSED_MARGIN_S if next_s < duration_s else duration_s
    return start, end


def batched_segments(
    model: Any, audio: Any, offset_s: float, windows: Any, words: bool, options: dict[str, Any]
) -> Iterator[dict[str, Any]]:
    """The batched pipeline's windows (``windows``: faster-whisper ``Segment``s with words) as
    cues (:func:`cues`), in order, with the speech it left out between them
    (:func:`missed_stretch`) decoded again one window after another."""
    duration_s, heard_s = len(audio) / SAMPLE_RATE, 0.0
    for seg in windows:
        first = seg.words[0].start if seg.words else seg.start
        yield from decode_missed(model, audio, offset_s, missed_stretch(heard_s, first, duration_s), words, options)
        yield from cues(seg, offset_s, words, getattr(model, "hf_tokenizer", None))
        heard_s = max(heard_s, seg.words[-1].end if seg.words else seg.end)
    yield from decode_missed(model, audio, offset_s, missed_stretch(heard_s, duration_s, duration_s), words, options)


def decode_missed(
    model: Any, audio: Any, offset_s: float, stretch: tuple[float, float] | None, words: bool, options: dict[str, Any]
) -> Iterator[dict[str, Any]]:
    """The segments of ``stretch`` (seconds of the chunk ``audio``) decoded one window after
    another; none when VAD finds less than :data:`MISSED_SPEECH_MS` of speech in it."""
    if stretch is None:
        return
    from faster_whisper.vad import VadOptions

    start, end = stretch
    piece = audio[int(start * SAMPLE_RATE) : int(end * SAMPLE_RATE)]
    options = {**options, "max_new_tokens": token_budget(len(piece) / SAMPLE_RATE)}
    it, _ = model.transcribe(
        piece,
        vad_filter=True,
        vad_parameters=VadOptions(min_speech_duration_ms=MISSED_SPEECH_MS),
        word_timestamps=words,
        **options,
    )
    found = [segment(seg, offset_s + start, words) for seg in it]
    if found:
        log.info(
            "the batched decoder left out speech at %.1f-%.1f s; decoded it one window after another",
            offset_s + start,
            offset_s + end,
        )
    yield from found


def segment(seg: Any, offset_s: float, words: bool) -> dict[str, Any]:
    """A faster-whisper ``Segment`` as a dict, its times shifted by ``offset_s``, with the
    model's own :func:`confidence`."""
    item: dict[str, Any] = {"start": seconds(offset_s + seg.start), "end": seconds(offset_s + seg.end)}
    item["text"] = str(seg.text)
    item.update(confidence(seg))
    item["tokens"] = [int(t) for t in seg.tokens or []]
    if words and seg.words:
        item["words"] = [word(w, offset_s) for w in seg.words]
    return item


def seconds(value: Any) -> float:
    """A time as a Python float, in seconds to the millisecond (faster-whisper gives numpy
    floats for some of its word times, which JSON encoders refuse)."""
    return round(float(value), 3)


def confidence(seg: Any) -> dict[str, float]:
    """What the model says of a ``Segment``'s text, as faster-whisper computes it:
    ``avg_logprob`` (the decoded tokens' mean log probability), ``no_speech_prob`` (of its
    no-speech token) and ``compression_ratio`` (of its text, gzip). The batched pipeline gives
    them per window: every cue cut from a window has its window's."""
    return {
        "avg_logprob": round(float(seg.avg_logprob), 4),
        "no_speech_prob": round(float(seg.no_speech_prob), 4),
        "compression_ratio": round(float(seg.compression_ratio), 4),
    }


def word(w: Any, offset_s: float) -> dict[str, Any]:
    return {
        "start": seconds(offset_s + w.start),
        "end": seconds(offset_s + w.end),
        "word": str(w.word),
        "probability": seconds(w.probability),
    }


def cues(seg: Any, offset_s: float, words: bool, tokenizer: Any = None) -> list[dict[str, Any]]:
    """A batched window (up to 30 s, without timestamp tokens) cut into cues from its word
    timestamps: after a sentence's end and a pause, at a longer pause, after a comma once a cue
    has lasted :data:`CUE_SOFT_S`, at any word once it has lasted :data:`CUE_HARD_S`. A window
    without words stays one segment. Each cue has its window's :func:`confidence`, and as
    ``tokens`` the window's tokens that spell its text (:func:`.segment_tokens.cut`;
    ``tokenizer``: the model's ``hf_tokenizer``; none without)."""
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
            **confidence(seg),
            "tokens": [],
        }
        if words:
            item["words"] = [word(w, offset_s) for w in group]
        out.append(item)
    for item, tokens in zip(out, cut(seg.tokens or [], [c["text"] for c in out], vocabulary(tokenizer)), strict=True):
        del item["end_raw"]
        item["tokens"] = [int(t) for t in tokens]
    return out
