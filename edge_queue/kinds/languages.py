"""Languages (docs/topics.md, "Languages"): which ones a model speaks, which model a language
goes to (``transcribe.language_models``), and the spoken language of a recording as the model
itself tells it, with its own probability, before anything is decoded.

Detection runs the multilingual model's encoder on the recording's first speech (Silero VAD,
as faster-whisper's), in two passes. The quick pass encodes at most :data:`QUICK_S` seconds of
speech as they are, unpadded: 0.1-0.35 CPU-s with base (int8, 2 threads), and its answer is
taken at :data:`QUICK_SURE` or above (English, Spanish and Italian speech here: 0.97-1.0).
Otherwise a second pass encodes the first :data:`STANDARD_S` seconds of speech padded with
silence to that length, and its answer is the one given: 0.58-0.62 CPU-s for both passes,
where a padded 30-s window (Whisper's input) took 1.37-1.49 and told the same languages, sure
or uncertain alike (espeak German ``de 0.79``, French ``fr 0.31``, Dutch ``la 0.40``; measured
with bench/p9_languages.py). Before a language is named, the speech gate (:func:`speaks`)
checks that the speech VAD found is speech: loud pink or white noise that Silero passes as
speech had been told as ``nn`` at 0.59-0.65. Audio without speech has no language: Whisper's
answer on silence or noise is never given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_queue.errors import ErrorCode, JobError, RequestError

from .bundled import BASE, TINY_EN, label

#: Whisper's language codes: ``faster_whisper.tokenizer._LANGUAGE_CODES`` (OpenAI Whisper's
#: ``tokenizer.LANGUAGES``), checked against it by the tests.
WHISPER_LANGUAGES = frozenset(
    "af am ar as az ba be bg bn bo br bs ca cs cy da de el en es et eu fa fi fo fr gl gu ha haw he hi "
    "hr ht hu hy id is it ja jw ka kk km kn ko la lb ln lo lt lv mg mi mk ml mn mr ms mt my ne nl nn "
    "no oc pa pl ps pt ro ru sa sd si sk sl sn so sq sr su sv sw ta te tg th tk tl tr tt uk ur uz vi "
    "yi yo zh yue".split()
)
#: A Whisper model is multilingual when its vocabulary has at least this many tokens
#: (CTranslate2's ``WhisperModel.is_multilingual``; the English-only ``.en`` models have 51,864).
MULTILINGUAL_VOCABULARY = 51_865
_MODEL_LANGUAGES: dict[str, frozenset[str]] = {}

#: Sample rate of the audio detection reads (Hz), and frames of log-Mel features per second.
SAMPLE_RATE, FRAMES_S = 16_000, 100
#: Seconds of speech the quick pass encodes, unpadded; its answer is taken at this probability.
QUICK_S, QUICK_SURE = 10.0, 0.9
#: The second pass: the first seconds of speech, padded with silence to this length.
STANDARD_S = 20.0
#: Less speech than this (seconds, after VAD) has no language.
MIN_SPEECH_S = 0.5
#: The speech gate (:func:`speaks`): Silero's probability that counts as sure speech, the share
#: of the speech found that must be sure, and the model's own no-speech probability (of its
#: first decoding step) over which it does not hear speech either (faster-whisper's
#: ``no_speech_threshold``).
SURE_VAD, SURE_SHARE, NO_SPEECH = 0.8, 0.5, 0.6


def model_languages(ref: str) -> frozenset[str]:
    """The language codes a model may be told to use: all of :data:`WHISPER_LANGUAGES` for a
    multilingual model, only ``en`` for an English-only one. A model folder is judged by the
    size of its vocabulary (``vocabulary.txt`` or ``vocabulary.json``), a model name by its
    ``.en`` ending."""
    if ref not in _MODEL_LANGUAGES:
        folder = Path(ref)
        size: int | None = None
        if (folder / "vocabulary.txt").is_file():
            with open(folder / "vocabulary.txt", "rb") as fh:
                size = sum(1 for _ in fh)
        elif (folder / "vocabulary.json").is_file():
            size = len(json.loads((folder / "vocabulary.json").read_text()))
        english_only = size < MULTILINGUAL_VOCABULARY if size is not None else folder.name.endswith(".en")
        _MODEL_LANGUAGES[ref] = frozenset({"en"}) if english_only else WHISPER_LANGUAGES
    return _MODEL_LANGUAGES[ref]


def multilingual(ref: str) -> bool:
    """True when the model of ``ref`` (a folder or a name) can tell"""
    return len(model_languages(ref)) > 1


def routes(cfg: Any) -> dict[str, str]:
    """The model each language goes to (``cfg``: the ``[transcribe]`` settings):
    ``transcribe.language_models`` when set; else, while ``transcribe.model`` is unset (the
    bundled base), English to the bundled tiny.en, which transcribes English as well for less
    CPU (bench/p9_languages.py); with a ``transcribe.model`` of the user's, none."""
    if cfg.language_models is not None:
        return dict(cfg.language_models)
    return {"en": TINY_EN} if cfg.model is None else {}


def name_of(code: str | None) -> str:
    """A language code's English name for messages (``es`` -> ``Spanish``), else the code."""
    if not code:
        return "no language"
    import pycountry

    found = pycountry.languages.get(alpha_2=code) if len(code) == 2 else pycountry.languages.get(alpha_3=code)
    return str(found.name) if found is not None else code


def unsupported(language: str, label: str, setting: str) -> JobError:
    """The error of a job whose language (given or detected) its model does not speak."""
    return JobError(
        f"the spoken language is {name_of(language)} ({language}), and the model {label!r} ({setting}) "
        "is English-only: it cannot transcribe it. Configure a multilingual model for it "
        '(docs/configuration.md, "Models"), or send English speech',
        code=ErrorCode.LANGUAGE_UNSUPPORTED,
    )


def cannot_detect(label: str, setting: str) -> JobError:
    """The error of a language detection asked of an English-only model."""
    return JobError(
        f"the model {label!r} ({setting}) is English-only: it cannot tell the spoken language. "
        "Leave transcribe.model unset (the bundled multilingual base) or set a multilingual model, "
        "or give the language",
        code=ErrorCode.LANGUAGE_UNSUPPORTED,
    )


def uncertain(found: Detection, threshold: float) -> JobError:
    """The error of a job whose spoken language the model could not tell surely enough."""
    return JobError(
        f"the spoken language is uncertain: the model's best guess is {name_of(found.language)} "
        f"({found.language}) at probability {found.probability:.2f}, below transcribe.language_threshold "
        f"{threshold:g}; give the language (options.language, the API's language)",
        code=ErrorCode.LANGUAGE_UNCERTAIN,
    )


@dataclass(frozen=True)
class Detection:
    """The spoken language as the model told it: ``language`` (a Whisper code, ``None`` when
    no speech was found), the model's own ``probability`` of it (0 without speech), the
    seconds of speech found (``speech_s``) and the encoder passes it took (0-2); ``sure_share``
    and ``no_speech``: what the speech gate (:func:`speaks`) read, when it ran."""

    language: str | None
    probability: float
    speech_s: float
    passes: int
    sure_share: float | None = None
    no_speech: float | None = None


def speaks(sure_share: float, no_speech: float) -> bool:
    """The speech gate: whether the speech VAD found is speech enough to name its language.
    Not when both say no: Silero is sure (:data:`SURE_VAD`) of less than :data:`SURE_SHARE` of
    it, and the model's own no-speech probability is over :data:`NO_SPEECH`. Noise Silero
    passes as speech (pink, white; 0.8-41.6 s of 10-60 s) had 0 % sure and a no-speech
    probability of 0.85-0.99; speech (the shared clips, espeak voices) 74-100 % sure, its
    no-speech probability 0.003-0.79 (docs/topics.md, "Languages")."""
    return sure_share >= SURE_SHARE or no_speech <= NO_SPEECH


def detect(model: Any, audio: Any) -> Detection:
    """The spoken language of ``audio`` (16 kHz mono float32 samples) by ``model`` (a
    multilingual ``faster_whisper.WhisperModel``), from its first speech (see the module's
    docstring); no language when the speech gate (:func:`speaks`) finds no speech."""
    import numpy as np
    from faster_whisper.vad import VadOptions, collect_chunks, get_speech_timestamps

    stamps = get_speech_timestamps(audio, VadOptions())
    speech_s = round(sum(s["end"] - s["start"] for s in stamps) / SAMPLE_RATE, 3)
    if speech_s < MIN_SPEECH_S:
        return Detection(None, 0.0, speech_s, 0)
    pieces, _ = collect_chunks(audio, stamps)
    speech = np.concatenate(pieces)[: int(STANDARD_S * SAMPLE_RATE)]
    sure = get_speech_timestamps(speech, VadOptions(threshold=SURE_VAD))
    sure_share = round(sum(s["end"] - s["start"] for s in sure) / len(speech), 3)
    encoded = _encode(model, model.feature_extractor(speech)[:, : int(QUICK_S * FRAMES_S)])
    language, probability = _top(model, encoded)
    no_speech = _no_speech(model, encoded, language)
    if not speaks(sure_share, no_speech):
        return Detection(None, 0.0, speech_s, 1, sure_share, no_speech)
    if probability >= QUICK_SURE:
        return Detection(language, probability, speech_s, 1, sure_share, no_speech)
    padded = np.pad(speech, (0, int(STANDARD_S * SAMPLE_RATE) - len(speech)))
    features = model.feature_extractor(padded)[:, : int(STANDARD_S * FRAMES_S)]
    language, probability = _top(model, _encode(model, features))
    return Detection(language, probability, speech_s, 2, sure_share, no_speech)


def _encode(model: Any, features: Any) -> Any:
    """The encoder's output for log-Mel ``features`` (80 x frames)."""
    import numpy as np

    return model.encode(np.ascontiguousarray(features))


def _top(model: Any, encoded: Any) -> tuple[str, float]:
    """The most probable language of an encoder's output and its probability."""
    token, probability = model.model.detect_language(encoded)[0][0]
    return str(token)[2:-2], round(float(probability), 4)


def _no_speech(model: Any, encoded: Any, language: str) -> float:
    """The model's own no-speech probability of an encoder's output: its first decoding step,
    as faster-whisper's decoder reads it for a window, with ``language``."""
    tokenizer = model.hf_tokenizer
    prompt = [tokenizer.token_to_id(t) for t in ("<|startoftranscript|>", f"<|{language}|>", "<|transcribe|>")]
    prompt.append(tokenizer.token_to_id("<|notimestamps|>"))
    result = model.model.generate(encoded, [prompt], max_length=1, return_no_speech_prob=True)
    return round(float(result[0].no_speech_prob), 4)


def check_language(options: Any, cfg: Any) -> None:
    """A ``transcribe`` submit's language checks (``options``: its options, ``cfg``: the
    ``[transcribe]`` settings): a Whisper code its model speaks, its model's by
    ``transcribe.language_models``; a ``detect`` task without a language, on a model that can
    tell one. Raises :class:`RequestError` naming the option and the setting."""
    setting = f"transcribe.models.{options.model}" if options.model else "transcribe.model"
    ref = cfg.models[options.model] if options.model else (cfg.model or BASE)
    if options.language is None:
        if options.task == "detect" and not multilingual(ref):
            raise RequestError(
                cannot_detect(label(ref), setting).message, code=ErrorCode.LANGUAGE_UNSUPPORTED, field="options.task"
            )
        return
    if options.task == "detect":
        raise RequestError("options.language: a detect task tells the language; leave it out", field="options.language")
    if options.language not in WHISPER_LANGUAGES:
        raise RequestError(
            f"options.language: {options.language[:8]!r} is not a Whisper language code; "
            f"one of: {', '.join(sorted(WHISPER_LANGUAGES))}",
            field="options.language",
        )
    routed = {} if options.model else routes(cfg)
    if options.language in routed:
        ref, setting = routed[options.language], f"transcribe.language_models.{options.language}"
    if options.language not in model_languages(ref):
        raise RequestError(
            f"options.language: {unsupported(options.language, label(ref), setting).message}",
            code=ErrorCode.LANGUAGE_UNSUPPORTED,
            field="options.language",
        )


class Told(Exception):  # noqa: N818 - not an error: a detect task's answer, found
    """A ``detect`` task's language, told: ends the job's decoding loop at once."""

    def __init__(self, found: Detection, uncertain: bool) -> None:
        super().__init__(found.language)
        self.found, self.uncertain = found, uncertain


def detected(found: Detection, uncertain: bool, declared_s: float | None, model: str) -> dict[str, Any]:
    """The result of a ``detect`` task (docs/topics.md, "Languages"): the language and the
    model's own probability of it, ``language_uncertain`` below ``transcribe.language_threshold``
    (``null`` and 0 without speech); no text, no outputs."""
    return {
        "language": found.language,
        "language_probability": found.probability,
        "language_uncertain": uncertain,
        "duration_s": declared_s,
        "text": "",
        "text_truncated": False,
        "segments": 0,
        "chunks": 0,
        "chunks_resumed": 0,
        "outputs": {},
        "model": model,
        "realtime_factor": None,
    }
