"""A transcription's kept chunks (docs/topics.md, "Long jobs resume"): which of them a new
attempt may take, and how much of the recording they cover. Plain functions over the chunk
dicts :meth:`.transcribe.Transcribe.run` keeps (``signature``, ``offset_s``, ``duration_s``,
``declared_s``, ``language``, ``language_probability``, ``segments``).
"""

from __future__ import annotations

from typing import Any


def resumable(kept: list[dict[str, Any]], signature: str) -> list[dict[str, Any]]:
    """The kept chunks a new attempt may take: chunks 0, 1, ... in order while each matches
    ``signature`` and has the fields :meth:`.transcribe.Transcribe.run` reads; none when the input or the
    settings changed since they were kept."""
    out = []
    for item in kept:
        if not (
            isinstance(item, dict)
            and item.get("signature") == signature
            and isinstance(item.get("segments"), list)
            and _number(item.get("offset_s"))
            and _number(item.get("duration_s"))
            and isinstance(item.get("language"), (str, type(None)))
            and (item.get("language_probability") is None or _number(item.get("language_probability")))
            and all(_kept_segment(seg) for seg in item["segments"])
        ):
            break
        out.append(item)
    return out


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _kept_segment(seg: Any) -> bool:
    """A segment as :meth:`.transcribe.Transcribe.run` keeps it: ``start`` and ``end`` numbers, ``text`` a
    string, and ``words``, when there, a list."""
    return (
        isinstance(seg, dict)
        and _number(seg.get("start"))
        and _number(seg.get("end"))
        and isinstance(seg.get("text"), str)
        and isinstance(seg.get("words", []), list)
    )


def resumed_share(resume: list[dict[str, Any]]) -> float:
    """The share of the recording (0-1) that the kept chunks of ``resume`` cover: the end of the
    last one over the duration the container declared when it was kept (0 when unknown)."""
    if not resume:
        return 0.0
    last = resume[-1]
    declared = last.get("declared_s")
    if not isinstance(declared, (int, float)) or declared <= 0:
        return 0.0
    return min((last["offset_s"] + last["duration_s"]) / declared, 1.0)


def same_cut(kept: dict[str, Any], offset_s: float, duration_s: float) -> bool:
    """True when a kept chunk covers the same audio as the chunk cut now (to the sample)."""
    return abs(kept["offset_s"] - offset_s) < 1e-4 and abs(kept["duration_s"] - duration_s) < 1e-4
