"""The form fields of OpenAI's ``POST /v1/audio/transcriptions`` and ``/translations``
(docs/http-api.md) read into a ``transcribe`` job's options, as plain data.

Speakers are asked for in OpenAI's way, the model ``gpt-4o-transcribe-diarize`` (our configured
model with ``diarize``) or ``response_format=diarized_json``, or in ours, the fields
``diarize``, ``min_speakers`` and ``max_speakers`` (as ``/asr``'s query parameters).
OpenAI's ``known_speaker_names[]`` and ``known_speaker_references[]`` are refused as their part
begins (:data:`REFUSED_FIELDS`), before a reference clip's bytes are read: speakers are told
apart, never named from references.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edge_queue.errors import ErrorCode, RequestError

from .uploads import Upload, field
from .values import flag, speaker_bounds

#: The model name OpenAI's clients send by default: the configured ``transcribe.model``.
DEFAULT_MODEL = "whisper-1"
#: OpenAI's diarizing model: the configured ``transcribe.model`` with ``diarize``.
DIARIZE_MODEL = "gpt-4o-transcribe-diarize"
#: ``response_format`` of each task (translations have no ``diarized_json``, as OpenAI's).
FORMATS = {
    "transcribe": ("json", "text", "srt", "verbose_json", "vtt", "diarized_json"),
    "translate": ("json", "text", "srt", "verbose_json", "vtt"),
}
#: Fields refused as their part begins (a form field's name as the ``openai`` package sends it
#: -> the answer's message); the answer's ``param`` is the name without ``[]``.
KNOWN_SPEAKERS_REFUSED = (
    "known speakers are not supported: speakers are told apart and labelled A, B, ... in order of first "
    "appearance (send the call without known_speaker_names[] and known_speaker_references[])"
)
REFUSED_FIELDS = {
    f"known_speaker_{what}{brackets}": KNOWN_SPEAKERS_REFUSED
    for what in ("names", "references")
    for brackets in ("[]", "")
}


@dataclass(frozen=True, slots=True)
class OpenAiCall:
    """What a call asks for: the job's ``options``, the answer's ``response_format`` and the
    ``timestamp_granularities[]`` (``word``, ``segment``)."""

    options: dict[str, Any]
    response_format: str
    granularities: frozenset[str]


def model_names(models: dict[str, Any]) -> list[str]:
    """The names of ``GET /v1/models``: ``whisper-1``, ``gpt-4o-transcribe-diarize``, then each
    other name of ``transcribe.models`` (``models``; those two names always mean the configured
    ``transcribe.model``)."""
    return [DEFAULT_MODEL, DIARIZE_MODEL, *(m for m in models if m not in (DEFAULT_MODEL, DIARIZE_MODEL))]


def read_call(upload: Upload, task: str, models: dict[str, Any]) -> OpenAiCall:
    """The job a call of ``task`` (``transcribe``, ``translate``) asks for, from its form fields
    (``model``, ``language``, ``prompt``, ``response_format``, ``timestamp_granularities[]``,
    ``stream``; ``diarize``, ``min_speakers``, ``max_speakers``); ``models`` is
    ``transcribe.models``. Raises :class:`~edge_queue.errors.RequestError` ``invalid_request``
    (naming OpenAI's ``param``) for a missing model, a bad value or ``stream``, and
    ``model_not_found`` for a model not in :func:`model_names`."""
    model = field(upload, "model")
    if not model:
        raise RequestError("model is required (GET /v1/models lists them)", code=ErrorCode.INVALID_REQUEST)
    if model not in model_names(models):
        raise RequestError(
            f"no model {model[:100]!r}; GET /v1/models lists them", code=ErrorCode.MODEL_NOT_FOUND, field="model"
        )
    if flag(field(upload, "stream"), False, "stream"):
        raise RequestError(
            "stream is not supported: send the call without it for the text",
            code=ErrorCode.INVALID_REQUEST,
            field="stream",
        )
    fmt = field(upload, "response_format", "json")
    if fmt not in FORMATS[task]:
        raise RequestError(
            f"response_format must be one of {', '.join(FORMATS[task])}",
            code=ErrorCode.INVALID_REQUEST,
            field="response_format",
        )
    granularities = frozenset(
        upload.fields.get("timestamp_granularities[]", []) + upload.fields.get("timestamp_granularities", [])
    )
    if granularities - {"word", "segment"}:
        raise RequestError("timestamp_granularities[] takes word and segment", code=ErrorCode.INVALID_REQUEST)
    options: dict[str, Any] = {"task": task}
    if model not in (DEFAULT_MODEL, DIARIZE_MODEL):
        options["model"] = model
    if task == "transcribe" and field(upload, "language"):
        options["language"] = field(upload, "language")
    if field(upload, "prompt"):
        options["initial_prompt"] = field(upload, "prompt")
    if "word" in granularities:
        options["word_timestamps"] = True
    if flag(field(upload, "diarize"), False, "diarize") or model == DIARIZE_MODEL or fmt == "diarized_json":
        options["diarize"] = True
    options.update(speaker_bounds(field(upload, "min_speakers"), field(upload, "max_speakers")))
    return OpenAiCall(options, fmt, granularities)
