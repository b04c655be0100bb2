"""Subtitle cues from a transcript's segments: what ``srt`` and ``vtt`` show.

A transcript's segments come from the decoder as they are: a chunk's last segment may overlap
the next chunk's first, a stretch decoded again may repeat a word ("Hello" 340.73-342.73, then
"Hello." 341.75-342.43), and a segment may run for 20 s. A subtitle player shows overlapping
cues on top of each other and a long cue as a wall of text, so :func:`subtitle_cues` makes the
cues of ``srt`` and ``vtt`` follow the common subtitle rules (Netflix's timed text style guide:
at most 7 s a cue; no two cues on screen at once):

- **No overlap.** Cues are in start order, and each ends at or before the next one starts. A cue
  that lies within the one before it and repeats its words is dropped; otherwise the earlier
  cue ends where the next begins.
- **At most** :data:`MAX_CUE_S` **seconds**, where the speech allows a cut. With word timestamps
  (``word_timestamps``) a long cue is cut between words: after a sentence's end (if that leaves
  a cue of at least half the limit), else after a comma or a sentence's end, else at the
  longest pause. Without
  them, it is cut at the ends of sentences (then of clauses) in its text, each piece timed in
  proportion to its characters: an estimate, within the cue's own start and end. A cue with no
  such place in its text stays whole.

The ``txt`` and ``json`` outputs keep the segments as decoded. Pure functions over plain data.
"""

from __future__ import annotations

import re
from typing import Any

#: The longest a cue may be on screen (seconds), where the speech allows a cut.
MAX_CUE_S = 7.0
#: Word endings after which a cue is best cut.
SENTENCE_END = (".", "?", "!", "。", "？", "！", "…")
CLAUSE_END = (",", ";", ":", "、", "，", "—")
_CLOSERS = "\"'”’)]»"
#: A sentence's (or clause's) end in plain text: the punctuation and the space after it.
_SENTENCE_CUT = re.compile(r"(?<=[.?!。？！…])[\"'”’)\]»]*\s+")
_CLAUSE_CUT = re.compile(r"(?<=[,;:、，—])\s+")


def subtitle_cues(segments: list[dict[str, Any]], max_cue_s: float = MAX_CUE_S) -> list[dict[str, Any]]:
    """The cues to show for ``segments``.

    Args:
        segments: ``[{"start": s, "end": s, "text": str, "words"?: [{"start", "end", "word"}]}]``,
            times in seconds from the start of the recording, as ``transcribe`` keeps them.
        max_cue_s: the longest cue (seconds) where a cut is possible.

    Returns:
        ``[{"start": s, "end": s, "text": str}]`` in start order, none empty, each ending at or
        before the next one's start, each at most ``max_cue_s`` long unless its text has no
        place to cut. The input is not changed.
    """
    pieces: list[dict[str, Any]] = []
    for seg in sorted(segments, key=lambda s: (s["start"], s["end"])):
        if seg["text"].strip():
            pieces.extend(split_long(seg, max_cue_s))
    return without_overlap(pieces)


def without_overlap(cues: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``cues`` (in start order) with repeats dropped and each ending by the next one's start."""
    out: list[dict[str, Any]] = []
    for cue in cues:
        cue = {"start": cue["start"], "end": max(cue["end"], cue["start"]), "text": cue["text"].strip()}
        if out and cue["start"] < out[-1]["end"]:
            before = out[-1]
            if cue["end"] <= before["end"] and _words(cue["text"]) <= _words(before["text"]):
                continue  # said again inside the cue before: a repeat
            if cue["start"] <= before["start"]:  # starts together: one cue of both
                before["end"], before["text"] = max(before["end"], cue["end"]), f"{before['text']} {cue['text']}"
                continue
            before["end"] = cue["start"]
        out.append(cue)
    return out


def split_long(seg: dict[str, Any], max_cue_s: float = MAX_CUE_S) -> list[dict[str, Any]]:
    """``seg`` as one cue, or cut into cues of at most ``max_cue_s`` where it can be cut."""
    start, end, text = seg["start"], seg["end"], seg["text"].strip()
    if end - start <= max_cue_s:
        return [{"start": start, "end": end, "text": text}]
    words = [w for w in seg.get("words") or [] if str(w.get("word", "")).strip()]
    if len(words) > 1:
        return _split_words(words, max_cue_s)
    return _split_text(start, end, text, max_cue_s)


def _split_words(words: list[dict[str, Any]], max_cue_s: float) -> list[dict[str, Any]]:
    """Cues of whole words, each within ``max_cue_s`` unless one word alone is longer."""
    out: list[dict[str, Any]] = []
    rest = words
    while rest:
        if rest[-1]["end"] - rest[0]["start"] <= max_cue_s or len(rest) == 1:
            out.append(_cue(rest))
            break
        cut = _best_cut(rest, max_cue_s)
        out.append(_cue(rest[:cut]))
        rest = rest[cut:]
    return out


def _best_cut(words: list[dict[str, Any]], max_cue_s: float) -> int:
    """How many of ``words`` the next cue takes (at least 1, never all): within ``max_cue_s``,
    after the last sentence end if that makes a cue of at least half of it, else after the last
    sentence or clause end, else at the longest pause between words."""
    limit = words[0]["start"] + max_cue_s
    fit = max(1, sum(1 for w in words if w["end"] <= limit))
    fit = min(fit, len(words) - 1)
    ends = [str(w["word"]).strip().rstrip(_CLOSERS) for w in words[:fit]]
    sentence = max((i + 1 for i, e in enumerate(ends) if e.endswith(SENTENCE_END)), default=0)
    clause = max((i + 1 for i, e in enumerate(ends) if e.endswith(CLAUSE_END)), default=0)
    if sentence and words[sentence - 1]["end"] - words[0]["start"] >= max_cue_s / 2:
        return sentence
    if clause > sentence or sentence:
        return max(clause, sentence)
    if fit > 1:
        pauses = [(words[i]["start"] - words[i - 1]["end"], i) for i in range(1, fit + 1)]
        return max(pauses)[1]
    return fit


def _cue(words: list[dict[str, Any]]) -> dict[str, Any]:
    return {"start": words[0]["start"], "end": words[-1]["end"], "text": "".join(str(w["word"]) for w in words).strip()}


def _split_text(start: float, end: float, text: str, max_cue_s: float) -> list[dict[str, Any]]:
    """Cut at sentence ends (then clause ends) in ``text``, each part timed by its share of the
    characters; parts are joined again while they fit in ``max_cue_s``."""
    for cut in (_SENTENCE_CUT, _CLAUSE_CUT):
        parts = [p for p in cut.split(text) if p.strip()]
        if len(parts) > 1:
            break
    else:
        return [{"start": start, "end": end, "text": text}]
    total = sum(len(p) for p in parts)
    per_char = (end - start) / total
    out: list[dict[str, Any]] = []
    at = start
    for part in parts:
        part_end = at + len(part) * per_char
        if out and part_end - out[-1]["start"] <= max_cue_s:
            out[-1]["end"], out[-1]["text"] = part_end, f"{out[-1]['text']} {part.strip()}"
        else:
            out.append({"start": at, "end": part_end, "text": part.strip()})
        at = part_end
    out[-1]["end"] = end
    return [cue for piece in out for cue in split_long(piece, max_cue_s)] if len(out) > 1 else out


def _words(text: str) -> set[str]:
    return set(re.findall(r"\w+", text.lower()))
