"""A transcription's output documents, as written to its files: ``txt`` (one line a segment),
``srt`` and ``vtt`` (one cue an event, its text escaped for the format), ``json`` (the result's
fields and its segments) (docs/topics.md, "`transcribe`"). Plain functions over the segment and
event dicts the transcription makes (``start``, ``end`` in seconds, ``text``).
"""

from __future__ import annotations

import json
from typing import Any

from .cue_layout import escaped


def stamp(seconds: float, sep: str) -> str:
    """``seconds`` as a cue time, ``HH:MM:SS<sep>mmm`` (``,`` for srt, ``.`` for vtt)."""
    ms = int(round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def render(fmt: str, segments: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """One output document: ``txt`` (one line per segment), ``srt``, ``vtt`` (one cue per
    segment, its text :func:`.cue_layout.escaped`) or ``json``. With speakers (segments and
    events with ``speaker``, docs/topics.md "Speakers"): ``txt`` one line per turn, starting
    ``[SPEAKER_00] ``; ``srt`` a cue's text starting ``[SPEAKER_01] `` where the speaker
    changes (written into the events' text by :func:`.cue_layout.laid_out`, ``marks``); ``vtt``
    each cue in its voice span, ``<v SPEAKER_01>``."""
    if fmt == "txt":
        if any("speaker" in s for s in segments):
            return "".join(f"[{who}] {text}\n" for who, text in turns(segments))
        return "".join(s["text"].strip() + "\n" for s in segments)
    if fmt == "srt":
        return "\n".join(
            f"{i}\n{stamp(s['start'], ',')} --> {stamp(s['end'], ',')}\n{escaped(s['text'].strip(), fmt)}\n"
            for i, s in enumerate(segments, 1)
        )
    if fmt == "vtt":
        return "WEBVTT\n\n" + "\n".join(
            f"{stamp(s['start'], '.')} --> {stamp(s['end'], '.')}\n"
            + (f"<v {s['speaker']}>" if s.get("speaker") else "")
            + f"{escaped(s['text'].strip(), fmt)}\n"
            for s in segments
        )
    return json.dumps({**meta, "segments": segments}, ensure_ascii=False, indent=1)


def turns(segments: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """``(speaker, text)`` of each run of segments by one speaker, their texts joined by a
    space."""
    out: list[tuple[str, list[str]]] = []
    for s in segments:
        who, text = str(s.get("speaker") or ""), s["text"].strip()
        if out and out[-1][0] == who:
            out[-1][1].append(text)
        else:
            out.append((who, [text]))
    return [(who, " ".join(t for t in texts if t)) for who, texts in out]
