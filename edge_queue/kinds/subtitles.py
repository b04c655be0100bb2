"""A transcript's segments as subtitle cues: in order, none overlapping the next, none longer
than :data:`MAX_CUE_S` where the speech allows a cut (docs/topics.md, "`transcribe`"). Plain
functions over the segment dicts the transcription makes (``start``, ``end``
in seconds, ``text``, optional ``words``); every format written (txt, srt, vtt, json) is made
from the result, so they agree with each other and with the queue page's downloads.

Common subtitle guidance (Netflix's timed text style guide, the BBC's subtitle guidelines) keeps
a cue to at most 7 seconds; the sequential decoder's segments are usually shorter, but some run
to 10-30 s, and segments on both sides of a chunk boundary can overlap by up to a second.
"""

from __future__ import annotations

import math
import re
from typing import Any

from .segment_tokens import Vocabulary, cut, joined

#: The longest cue, in seconds, where a cut between two words is possible.
MAX_CUE_S = 7.0
#: A cut leaves at least this many seconds of the segment after it, where another cut allows:
#: no last word alone on the screen for a blink.
MIN_REST_S = 1.0
#: Text that ends a sentence, or a clause: the preferred places to cut.
SENTENCE_END = (".", "?", "!", "…", "。", "？", "！")
CLAUSE_END = (",", ";", ":", "、", "，")
_TOKEN = re.compile(r"\s*\S+")


def subtitle_cues(
    segments: list[dict[str, Any]], max_s: float = MAX_CUE_S, vocab: Vocabulary | None = None
) -> list[dict[str, Any]]:
    """``segments`` (each ``{"start", "end", "text", ...}``, seconds) as cues: sorted by start,
    each longer than ``max_s`` cut at word boundaries (at the words' times when the segment has
    ``words``, else at times shared out by characters), then each cue's end moved back to the
    next cue's start where it overlaps it; two cues that start together become one. Returns new
    dicts, ``id`` numbered from 0; the text, read in order, is unchanged. A cut or joined
    segment's ``tokens`` are its own (:mod:`.segment_tokens`, ``vocab``: the model's)."""
    pieces: list[dict[str, Any]] = []
    for seg in segments:
        pieces.extend(split(seg, max_s, vocab))
    pieces.sort(key=lambda s: (s["start"], s["end"]))  # (stable: segments in order stay in order)
    out: list[dict[str, Any]] = []
    for cue in pieces:
        if out and cue["start"] <= out[-1]["start"]:  # the same start: one cue
            prev = out.pop()
            cue = {**cue, "start": prev["start"], "text": prev["text"].rstrip() + " " + cue["text"].lstrip()}
            if "tokens" in prev or "tokens" in cue:
                cue["tokens"] = joined(prev, cue, cue["text"], vocab)
            if "words" in prev or "words" in cue:
                cue["words"] = prev.get("words", []) + cue.get("words", [])
        if out and out[-1]["end"] > cue["start"]:
            out[-1]["end"] = cue["start"]
        out.append(cue)
    return [{**cue, "id": i} for i, cue in enumerate(out)]


def split(seg: dict[str, Any], max_s: float, vocab: Vocabulary | None = None) -> list[dict[str, Any]]:
    """``seg`` cut into pieces of at most ``max_s`` seconds where a word boundary allows, each
    with the ``tokens`` of its text (:func:`.segment_tokens.cut`)."""
    if seg["end"] - seg["start"] <= max_s:
        return [dict(seg)]
    real = bool(seg.get("words")) and len(seg["words"]) > 1
    words = seg["words"] if real else shared_out(seg)
    if len(words) < 2:
        return [dict(seg)]
    pieces = []
    for i, group in enumerate(groups(words, max_s)):
        piece: dict[str, Any] = {
            **{k: v for k, v in seg.items() if k not in ("words", "start", "end", "text")},
            "start": seg["start"] if i == 0 else group[0]["start"],
            "end": group[-1]["end"],
            "text": "".join(w["word"] for w in group),
        }
        if real:
            piece["words"] = group
        pieces.append(piece)
    pieces[-1]["end"] = max(pieces[-1]["end"], seg["end"])
    if "tokens" in seg:
        for piece, tokens in zip(pieces, cut(seg["tokens"], [p["text"] for p in pieces], vocab), strict=True):
            piece["tokens"] = tokens
    return pieces


def shared_out(seg: dict[str, Any]) -> list[dict[str, Any]]:
    """The words of a segment without word times, each given the share of the segment's time
    its characters take."""
    tokens = _TOKEN.findall(seg["text"])
    total = sum(len(t) for t in tokens) or 1
    start, span = seg["start"], seg["end"] - seg["start"]
    words, done = [], 0
    for t in tokens:
        a = start + span * done / total
        done += len(t)
        words.append({"start": round(a, 3), "end": round(start + span * done / total, 3), "word": t})
    return words


def groups(words: list[dict[str, Any]], max_s: float) -> list[list[dict[str, Any]]]:
    """``words`` in runs of at most ``max_s`` seconds (a single longer word stays whole), each
    cut after a sentence's end where one falls in its second half, else after a clause's, else
    at the longest pause there; a cut leaving less than :data:`MIN_REST_S` of the words after
    it is taken only when no other is possible."""
    out: list[list[dict[str, Any]]] = []
    cur: list[dict[str, Any]] = []
    last_end = words[-1]["end"] if words else 0.0
    for w in words:
        while cur and w["end"] - cur[0]["start"] > max_s:
            k = best_cut(cur, w, last_end)
            out.append(cur[:k])
            cur = cur[k:]
        cur.append(w)
    if cur:
        out.append(cur)
    return out


def best_cut(cur: list[dict[str, Any]], following: dict[str, Any], last_end: float) -> int:
    """Where to end the run ``cur`` (``following``: the word after it; ``last_end``: the end of
    the segment's last word, s): the number of its words the run keeps, at least half of them
    (rounded up), at least one."""
    first = max(1, math.ceil(len(cur) / 2))

    def rest_s(k: int) -> float:
        return float(last_end - (cur[k] if k < len(cur) else following)["start"])

    ks: Any = range(len(cur), first - 1, -1)
    ks = [k for k in ks if rest_s(k) >= MIN_REST_S] or list(ks)

    def ends(k: int, marks: tuple[str, ...]) -> bool:
        return cur[k - 1]["word"].strip().rstrip("\"'”’)]»").endswith(marks)

    for marks in (SENTENCE_END, CLAUSE_END):
        found = next((k for k in ks if ends(k, marks)), None)
        if found is not None:
            return found

    def pause(k: int) -> float:
        nxt = cur[k] if k < len(cur) else following
        return float(nxt["start"] - cur[k - 1]["end"])

    return max(ks, key=lambda k: (pause(k), k))
