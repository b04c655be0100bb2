"""Languages (docs/topics.md, "Languages"): which ones a model speaks, which model a language
goes to (``transcribe.language_models``), and the spoken language of a recording as the model
itself tells it, with its own probability, before anything is decoded.

Detection runs the multilingual model's encoder on the recording's first speech (Silero VAD,
as faster-whisper's), in two passes. The quick pass encodes at most :data:`QUICK_S` seconds of
speech as they are, unpadded: 0.2-0.5 CPU-s with base (int8, 2 threads), and its answer is
taken at :data:`QUICK_SURE` or above (English, Spanish and Italian speech here: 0.96-1.0).
Otherwise the standard pass encodes the first 30 s window, padded as Whisper was trained
(faster-whisper's ``detect_language``; 1.7 CPU-s), and its answer is the one given: the quick
pass alone said "en 0.38" for espeak German, the standard one "de 0.64" (measured with espeak
voices; bench/p9_py). Audio without speech has no language: Whisper's answer on
silence or noise (``nn 0.71``, ``en 0.30`` on tones) is never given.
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
#: The standard pass: one 30-s window of speech, padded (Whisper's input).
WINDOW_S = 30.0
#: Less speech than this (seconds, after VAD) has no language.
MIN_SPEECH_S = 0.5


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
    seconds of speech found (``speech_s``) and the encoder passes it took (0-2)."""

    language: str | None
    probability: float
    speech_s: float
    passes: int


def detect(model: Any, audio: Any) -> Detection:
    """The spoken language of ``audio`` (16 kHz mono float32 samples) by ``model`` (a
    multilingual ``faster_whisper.WhisperModel``), from its first speech (see the module's
    docstring)."""
    import numpy as np
    from faster_whisper.audio import pad_or_trim
    from faster_whisper.vad import VadOptions, collect_chunks, get_speech_timestamps

    stamps = get_speech_timestamps(audio, VadOptions())
    speech_s = sum(s["end"] - s["start"] for s in stamps) / SAMPLE_RATE
    if speech_s < MIN_SPEECH_S:
        return Detection(None, 0.0, round(speech_s, 3), 0)
    pieces, _ = collect_chunks(audio, stamps)
    speech = np.concatenate(pieces)[: int(WINDOW_S * SAMPLE_RATE)]
    features = model.feature_extractor(speech)
    language, probability = _top(model, features[:, : int(QUICK_S * FRAMES_S)])
    if probability >= QUICK_SURE:
        return Detection(language, probability, round(speech_s, 3), 1)
    language, probability = _top(model, pad_or_trim(features[:, : int(WINDOW_S * FRAMES_S)]))
    return Detection(language, probability, round(speech_s, 3), 2)


def _top(model: Any, features: Any) -> tuple[str, float]:
    """The most probable language of the log-Mel ``features`` (80 x frames) and its probability."""
    import numpy as np

    encoded = model.encode(np.ascontiguousarray(features))
    token, probability = model.model.detect_language(encoded)[0][0]
    return str(token)[2:-2], round(float(probability), 4)


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
