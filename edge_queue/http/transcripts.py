"""A finished transcription in the formats the HTTP API's callers ask for (docs/http-api.md,
"Formats"): plain functions from the job's own ``json`` output to bytes.

``txt``, ``srt`` and ``vtt`` are never rebuilt here: the API sends the job's own files, so a
caller gets exactly what an MQTT job of the same audio writes. The rest are made from the
``json`` output (``{"language", "duration_s", "text", "segments": [{"id", "start", "end",
"text", "words"?, ...}], ...}``, docs/topics.md, "`transcribe`"):

- ``tsv``: whisper-asr-webservice's (openai-whisper's ``WriteTSV``): a ``start end text``
  header, then integer milliseconds and the text of each segment, tab-separated.
- ``json`` of ``/asr``: openai-whisper's result, ``{"text", "segments", "language"}``.
- OpenAI's ``json`` (``{"text"}``), ``text`` and ``verbose_json`` (``{"task", "language"
  (a language name, as OpenAI gives it), "duration", "text", "segments", "words"?}``; the
  ``segments`` with OpenAI's fields: ``tokens``, ``avg_logprob``, ``compression_ratio`` and
  ``no_speech_prob`` as the model gave them (:func:`confidence`), ``seek`` and ``temperature``,
  which the job does not keep, 0; segments and words carry the job's ``speaker`` when it has
  one).
- OpenAI's ``diarized_json`` (:func:`openai_diarized`): the segments with their speakers
  labelled as OpenAI labels them, ``A``, ``B``, ...
"""

from __future__ import annotations

from typing import Any

import orjson

#: Formats of ``POST /asr`` (``output``); OpenAI's routes' are in :mod:`.openai_form`.
ASR_FORMATS = ("txt", "vtt", "srt", "tsv", "json")
#: The job's own output files that are sent as they are.
FILE_FORMATS = ("txt", "srt", "vtt")

#: Content types, as whisper-asr-webservice and OpenAI send them.
CONTENT_TYPES = {
    "txt": "text/plain; charset=utf-8",
    "text": "text/plain; charset=utf-8",
    "srt": "text/plain; charset=utf-8",
    "vtt": "text/vtt; charset=utf-8",
    "tsv": "text/tab-separated-values; charset=utf-8",
    "json": "application/json",
    "verbose_json": "application/json",
    "diarized_json": "application/json",
}


def segments_of(document: dict[str, Any]) -> list[dict[str, Any]]:
    """The well-formed segments of a ``json`` output: those with numeric ``start`` and ``end``
    and a string ``text`` (anything else is left out, never trusted)."""
    raw = document.get("segments")
    if not isinstance(raw, list):
        return []
    return [
        s
        for s in raw
        if isinstance(s, dict)
        and isinstance(s.get("start"), int | float)
        and isinstance(s.get("end"), int | float)
        and isinstance(s.get("text"), str)
    ]


def tsv(document: dict[str, Any]) -> bytes:
    """whisper-asr-webservice's ``tsv``: ``start\\tend\\ttext`` in integer milliseconds."""
    lines = ["start\tend\ttext"]
    for s in segments_of(document):
        text = s["text"].strip().replace("\t", " ").replace("\n", " ")
        lines.append(f"{round(1000 * s['start'])}\t{round(1000 * s['end'])}\t{text}")
    return ("\n".join(lines) + "\n").encode()


def whisper_json(document: dict[str, Any]) -> bytes:
    """``/asr``'s ``json``: ``{"text", "segments", "language"}`` as openai-whisper returns it."""
    segments = [
        {
            "id": i,
            "seek": 0,
            "start": s["start"],
            "end": s["end"],
            "text": s["text"],
            "temperature": 0.0,
            **confidence(s),
            **({"words": s["words"]} if isinstance(s.get("words"), list) else {}),
            **({"speaker": s["speaker"]} if isinstance(s.get("speaker"), str) else {}),
        }
        for i, s in enumerate(segments_of(document))
    ]
    found = {s["speaker"] for s in segments if "speaker" in s}
    return orjson.dumps(
        {
            "text": _text(document),
            "segments": segments,
            "language": document.get("language"),
            **({"speakers": len(found)} if found else {}),
        }
    )


def confidence(segment: dict[str, Any]) -> dict[str, Any]:
    """A segment's ``tokens``, ``avg_logprob``, ``compression_ratio`` and ``no_speech_prob`` as
    the job's ``json`` output holds them (the model's own, kinds/whisper.py); a value that is
    not there (a job of an earlier release) or not a number is left out of a list, or 0."""

    def number(key: str) -> float:
        value = segment.get(key)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0

    tokens = segment.get("tokens")
    return {
        "tokens": [t for t in tokens if isinstance(t, int) and not isinstance(t, bool)]
        if isinstance(tokens, list)
        else [],
        "avg_logprob": number("avg_logprob"),
        "compression_ratio": number("compression_ratio"),
        "no_speech_prob": number("no_speech_prob"),
    }


def openai_json(document: dict[str, Any]) -> bytes:
    """OpenAI's ``json``: ``{"text", "usage"}``."""
    return orjson.dumps({"text": _text(document), "usage": usage(document)})


def openai_text(document: dict[str, Any]) -> bytes:
    """OpenAI's ``text``: the transcript as one line of text."""
    return (_text(document) + "\n").encode()


def openai_verbose(document: dict[str, Any], task: str, words: bool, segments: bool = True) -> bytes:
    """OpenAI's ``verbose_json``: ``task``, ``language`` (its name), ``duration`` (seconds),
    ``text``, ``segments`` (unless only word times were asked for) and, with ``words``, every
    word with its ``start`` and ``end`` (when the job was made with word times)."""
    listed = segments_of(document)
    out: dict[str, Any] = {
        "task": task,
        "language": language_name(document.get("language")),
        "duration": float(document.get("duration_s") or (listed[-1]["end"] if listed else 0.0)),
        "text": _text(document),
    }
    if segments:
        out["segments"] = [
            {
                "id": i,
                "seek": 0,
                "start": float(s["start"]),
                "end": float(s["end"]),
                "text": s["text"],
                "temperature": 0.0,
                **confidence(s),
                **({"speaker": s["speaker"]} if isinstance(s.get("speaker"), str) else {}),
            }
            for i, s in enumerate(listed)
        ]
    if words:
        out["words"] = [
            {
                "word": w["word"],
                "start": float(w["start"]),
                "end": float(w["end"]),
                **({"speaker": w["speaker"]} if isinstance(w.get("speaker"), str) else {}),
            }
            for s in listed
            for w in s.get("words") or []
            if isinstance(w, dict)
            and isinstance(w.get("word"), str)
            and isinstance(w.get("start"), int | float)
            and isinstance(w.get("end"), int | float)
        ]
    out["usage"] = usage(document)
    return orjson.dumps(out)


def openai_diarized(document: dict[str, Any]) -> bytes:
    """OpenAI's ``diarized_json`` (the ``openai`` package's ``TranscriptionDiarized``):
    ``{"task": "transcribe", "duration" (seconds), "text", "segments": [{"type":
    "transcript.text.segment", "id": "seg_<n>", "start", "end", "text", "speaker"}], "usage"}``,
    a segment of the job's each, its speaker as OpenAI labels one (:func:`speaker_letter`)."""
    listed = segments_of(document)
    return orjson.dumps(
        {
            "task": "transcribe",
            "duration": float(document.get("duration_s") or (listed[-1]["end"] if listed else 0.0)),
            "text": _text(document),
            "segments": [
                {
                    "type": "transcript.text.segment",
                    "id": f"seg_{i}",
                    "start": float(s["start"]),
                    "end": float(s["end"]),
                    "text": s["text"],
                    "speaker": speaker_letter(s.get("speaker")),
                }
                for i, s in enumerate(listed)
            ],
            "usage": usage(document),
        }
    )


def speaker_letter(label: Any) -> str:
    """OpenAI's label of a speaker: ``SPEAKER_00`` -> ``A``, ``SPEAKER_01`` -> ``B``, ...,
    ``SPEAKER_26`` -> ``AA`` (as spreadsheet columns); any other string as it is, and no label
    ``A``."""
    if not isinstance(label, str):
        return "A"
    prefix, _, number = label.rpartition("_")
    if prefix != "SPEAKER" or not number.isdigit():
        return label
    n, letters = int(number) + 1, ""
    while n:
        n, rest = divmod(n - 1, 26)
        letters = chr(ord("A") + rest) + letters
    return letters


def usage(document: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's ``usage`` of a model billed by audio duration: ``{"type": "duration",
    "seconds"}``, the recording's seconds (the ``openai`` package's ``UsageDuration``)."""
    listed = segments_of(document)
    seconds = document.get("duration_s") or (listed[-1]["end"] if listed else 0.0)
    return {"type": "duration", "seconds": round(float(seconds), 3)}


def _text(document: dict[str, Any]) -> str:
    text = document.get("text")
    if isinstance(text, str):
        return text
    return " ".join(s["text"].strip() for s in segments_of(document) if s["text"].strip())


def language_name(code: Any) -> str | None:
    """The English name of an ISO 639-1 (or 639-3) code, lower case as Whisper and OpenAI give
    it (``en`` -> ``english``), from pycountry's ISO 639 tables; the code itself when unknown."""
    if not isinstance(code, str) or not code:
        return None
    import pycountry

    found = pycountry.languages.get(alpha_2=code) if len(code) == 2 else pycountry.languages.get(alpha_3=code)
    return str(found.name).lower() if found is not None else code
