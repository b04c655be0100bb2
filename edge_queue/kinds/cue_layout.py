"""Subtitle cues laid out as broadcasters and streaming services lay them out (docs/topics.md,
"Subtitles"): plain functions from the transcript's cues (:func:`.subtitles.subtitle_cues`) to
the events of an ``srt`` or ``vtt`` file. Only the layout changes: the words, read in order,
are the transcript's; ``txt`` and ``json`` keep the segments as they are.

The rules are Netflix's Timed Text Style Guide, General Requirements: at most 2 lines an event,
broken after punctuation and before conjunctions and prepositions (not after an article or a
subject pronoun); at least 5/6 s and at most 7 s on screen; at least 2 frames between events.
Line lengths and reading speeds are the language guides': 42 characters a line and 20
characters a second (English, adult programmes, and the Latin-script languages), 13 a line and
4 a second (Japanese), 16 a line and 9 a second (Chinese), 16 a line and 12 a second (Korean).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Rules:
    """One language's layout rules: characters a line, lines an event, shortest and longest
    time on screen (s), characters a second, the least gap between two events (s)."""

    line_chars: int = 42
    lines: int = 2
    min_s: float = 5 / 6
    max_s: float = 7.0
    cps: float = 20.0
    gap_s: float = 2 / 24  # 2 frames at 24 fps


LATIN = Rules()
#: Netflix's Japanese, Chinese (Simplified and Traditional) and Korean guides.
BY_LANGUAGE = {
    "ja": Rules(line_chars=13, cps=4.0),
    "zh": Rules(line_chars=16, cps=9.0),
    "yue": Rules(line_chars=16, cps=9.0),
    "ko": Rules(line_chars=16, cps=12.0),
}
#: Text mostly in these scripts, in a language not named above, gets the Chinese guide's rules.
CJK_RULES = BY_LANGUAGE["zh"]
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef\u3000-\u303f"
_IS_CJK = re.compile(f"[{_CJK}]")
#: A token: one CJK character, or a run of other characters up to the next space; with the
#: spaces before it.
_TOKEN = re.compile(rf"\s*(?:[{_CJK}]|[^\s{_CJK}]+)")

SENTENCE_END = (".", "?", "!", "…", "。", "？", "！")
CLAUSE_END = (",", ";", ":", "—", "–", "、", "，", "；", "：")
#: A line or an event may start with these (English, French, German, Spanish, Italian, Dutch,
#: Portuguese): conjunctions first, then prepositions.
CONJUNCTIONS = frozenset(
    "and but or nor so because which that who whom whose when where while if than although though unless until "
    "et mais ou donc car que qui quand lorsque si parce puisque "
    "und aber oder denn weil dass wenn als ob sondern "
    "y e o pero porque que cuando si aunque pues "
    "ma perché che quando se anche "
    "en maar of want omdat dat wanneer als "
    "mas porque quando".split()
)
PREPOSITIONS = frozenset(
    "in on at to for with from by about of into over after before under between through during without "
    "à de dans pour avec sur sans chez par en zu mit von bei nach für über unter auf aus "
    "con para por sin sobre entre di da per tra fra met van voor naar op bij".split()
)
#: A line does not end on these: an article or a determiner before its noun, a subject pronoun
#: before its verb, an auxiliary before its verb.
NO_BREAK_AFTER = frozenset(
    "a an the my your his her its our their this that these those i you he she we they it "
    "is are was were be been have has had do does did will would can could shall should may might must not "
    "le la les un une des du mon ton son ma ta sa je tu il elle nous vous ils elles "
    "der die das ein eine einen dem den des ich du er sie es wir ihr "
    "el los las una unos yo él lo il gli lo uno io het een ik jij hij zij wij".split()
)


def rules_for(language: str | None, text: str) -> Rules:
    """The rules for a transcript in ``language`` (an ISO 639-1 code, or ``None``): its guide's,
    else the Chinese guide's when most of ``text``'s letters are CJK, else :data:`LATIN`."""
    if language in BY_LANGUAGE:
        return BY_LANGUAGE[str(language)]
    letters = [c for c in text if c.isalpha()]
    if letters and sum(1 for c in letters if _IS_CJK.match(c)) > len(letters) / 2:
        return CJK_RULES
    return LATIN


def tokens(cue: dict[str, Any]) -> list[dict[str, Any]]:
    """A cue's words (``{"start", "end", "word"}``; ``word`` with the spaces before it): its own
    ``words`` when they spell its text, else its text cut into words (CJK characters one by one)
    with the cue's time shared out by their characters. The first word of a cue starts with a
    space unless it is CJK, so that two cues joined read as two words."""
    text = str(cue.get("text") or "")
    own = cue.get("words")
    words: list[dict[str, Any]]
    if isinstance(own, list) and own and "".join(str(w.get("word", "")) for w in own).split() == text.split():
        words = [{"start": float(w["start"]), "end": float(w["end"]), "word": str(w["word"])} for w in own]
        words = [w for w in words if w["word"].strip()]
    else:
        parts = _TOKEN.findall(text)
        total = sum(len(p) for p in parts) or 1
        start, span, done = float(cue["start"]), float(cue["end"]) - float(cue["start"]), 0
        words = []
        for p in parts:
            a = start + span * done / total
            done += len(p)
            words.append({"start": a, "end": start + span * done / total, "word": p})
    if words and not words[0]["word"][:1].isspace() and not _IS_CJK.match(words[0]["word"][:1]):
        words[0] = {**words[0], "word": " " + words[0]["word"]}
    return words


def joined(words: list[dict[str, Any]]) -> str:
    return "".join(w["word"] for w in words).strip()


def breakable(words: list[dict[str, Any]], k: int) -> bool:
    """Whether a line (or an event) may end before ``words[k]``: at a space, or between two
    CJK characters."""
    nxt, prev = words[k]["word"], words[k - 1]["word"].strip()
    return nxt[:1].isspace() or bool(_IS_CJK.match(nxt[:1]) and prev and _IS_CJK.match(prev[-1]))


def _bare(word: str) -> str:
    return word.strip().strip("\"'“”‘’()[]«»¿¡").lower()


def natural(words: list[dict[str, Any]], k: int) -> float:
    """How natural a break before ``words[k]`` is: after a sentence's end 3, after a clause's 2,
    before a conjunction 1.5, before a preposition 1, after an article, a subject pronoun or an
    auxiliary -2, else 0."""
    prev = words[k - 1]["word"].strip().rstrip("\"'”’)]»")
    if prev.endswith(SENTENCE_END):
        return 3.0
    if prev.endswith(CLAUSE_END):
        return 2.0
    nxt, before = _bare(words[k]["word"]), _bare(prev)
    if before in NO_BREAK_AFTER:
        return -2.0
    if nxt in CONJUNCTIONS:
        return 1.5
    if nxt in PREPOSITIONS:
        return 1.0
    return 0.0


def lines(words: list[dict[str, Any]], rules: Rules) -> list[str]:
    """The event's text in lines: one when it fits :attr:`Rules.line_chars`, else two broken
    at the most natural place where both fit (:func:`natural`, then the more even lengths); when
    no break gives two lines that fit, the fewest lines filled word by word."""
    text = joined(words)
    if len(text) <= rules.line_chars or len(words) < 2:
        return [text]
    best: tuple[float, int] | None = None
    for k in range(1, len(words)):
        if not breakable(words, k):
            continue
        a, b = joined(words[:k]), joined(words[k:])
        if len(a) > rules.line_chars or len(b) > rules.line_chars:
            continue
        score = natural(words, k) - abs(len(a) - len(b)) / rules.line_chars
        if best is None or score > best[0]:
            best = (score, k)
    if best is not None:
        return [joined(words[: best[1]]), joined(words[best[1] :])]
    out, cur = [], [words[0]]
    for k in range(1, len(words)):
        if breakable(words, k) and len(joined([*cur, words[k]])) > rules.line_chars:
            out.append(joined(cur))
            cur = []
        cur.append(words[k])
    return [*out, joined(cur)]


def fits(words: list[dict[str, Any]], rules: Rules) -> bool:
    """Whether ``words`` make one event: at most :attr:`Rules.lines` lines of at most
    :attr:`Rules.line_chars`, spoken within :attr:`Rules.max_s`."""
    got = lines(words, rules)
    return (
        len(got) <= rules.lines
        and all(len(line) <= rules.line_chars for line in got)
        and words[-1]["end"] - words[0]["start"] <= rules.max_s
    )


def pieces(words: list[dict[str, Any]], rules: Rules) -> list[list[dict[str, Any]]]:
    """``words`` (one cue's) in events that :func:`fits`, each as long as it may be, ended at
    the most natural place (:func:`natural`, a pause after the word counting up to 2), never
    leaving a last event of a few characters where another end is possible; a single word too
    long for a line is an event of its own."""
    out: list[list[dict[str, Any]]] = []
    rest = words
    while rest:
        if len(rest) == 1 or fits(rest, rules):
            out.append(rest)
            break
        longest = 1
        while longest < len(rest) and fits(rest[: longest + 1], rules):
            longest += 1
        ks = [k for k in range(1, longest + 1) if breakable(rest, k)] or [longest]
        k = max(ks, key=lambda k: (end_score(rest, k, rules), k))
        out.append(rest[:k])
        rest = rest[k:]
    return out


def end_score(words: list[dict[str, Any]], k: int, rules: Rules) -> float:
    """How good an end before ``words[k]`` is for an event: :func:`natural`, plus twice the
    pause after it (up to 1 s), plus twice the share of the event's room it fills, less 2 when
    it leaves fewer than 12 characters after it."""
    pause = min(words[k]["start"] - words[k - 1]["end"], 1.0)
    fill = len(joined(words[:k])) / (rules.lines * rules.line_chars)
    return natural(words, k) + 2 * pause + 2 * fill - (2.0 if len(joined(words[k:])) < 12 else 0.0)


def events_of(cues: list[dict[str, Any]], rules: Rules, marks: bool = False) -> list[dict[str, Any]]:
    """Each cue cut into :func:`pieces`: ``{"start", "end", "words"}``, the first starting at
    the cue's start, the last ending at its end, the others at their words' times. With
    ``marks``, a cue whose ``speaker`` is not the one before it starts with ``[SPEAKER_01] ``,
    held to its first word (counted in the line, never a line of its own)."""
    out: list[dict[str, Any]] = []
    before = None
    for cue in cues:
        words = tokens(cue)
        if not words:
            continue
        who = cue.get("speaker")
        if marks and who and who != before:
            words[0] = {**words[0], "word": f" [{who}]" + words[0]["word"]}
        before = who or before
        parts = pieces(words, rules)
        for i, part in enumerate(parts):
            start = float(cue["start"]) if i == 0 else part[0]["start"]
            end = float(cue["end"]) if i == len(parts) - 1 else part[-1]["end"]
            out.append({"start": start, "end": max(end, start), "words": part, "speaker": cue.get("speaker")})
    return out


def needed_s(event: dict[str, Any], rules: Rules) -> float:
    """The time an event needs on screen: :attr:`Rules.min_s`, or its characters at
    :attr:`Rules.cps`, whichever is longer, within :attr:`Rules.max_s`."""
    return min(max(rules.min_s, len(joined(event["words"])) / rules.cps), rules.max_s)


def merged_short(events: list[dict[str, Any]], rules: Rules) -> list[dict[str, Any]]:
    """Events shorter than they need (:func:`needed_s`), even with the silence after them,
    joined with the next (or else the one before) where the two make one event that
    :func:`fits`, spoken within :attr:`Rules.max_s`, at most 1 s apart, by the same speaker."""
    out = list(events)
    i = 0
    while i < len(out):
        ev = out[i]
        room = (out[i + 1]["start"] - rules.gap_s) if i + 1 < len(out) else float("inf")
        if min(room, ev["start"] + rules.max_s) - ev["start"] >= needed_s(ev, rules) - 1e-9:
            i += 1
            continue
        for j in (i, i - 1):  # with the next, else with the one before
            if j < 0 or j + 1 >= len(out):
                continue
            a, b = out[j], out[j + 1]
            words = a["words"] + b["words"]
            same = a.get("speaker") == b.get("speaker")
            if same and b["start"] - a["end"] <= 1.0 and b["end"] - a["start"] <= rules.max_s and fits(words, rules):
                out[j : j + 2] = [{"start": a["start"], "end": b["end"], "words": words, "speaker": a.get("speaker")}]
                i = max(j - 1, 0)
                break
        else:
            i += 1
    return out


def timed(events: list[dict[str, Any]], rules: Rules) -> list[dict[str, Any]]:
    """Each event's end moved on into the silence after it until it has the time it needs
    (:func:`needed_s`), never within :attr:`Rules.gap_s` of the next event; then events closer
    than that to the next end that much before it (or, when that would leave the event less
    than half its time, the next starts that much later)."""
    out = [dict(e) for e in events]
    for i, ev in enumerate(out):
        nxt = out[i + 1]["start"] if i + 1 < len(out) else float("inf")
        want = ev["start"] + needed_s(ev, rules)
        if ev["end"] < want:
            ev["end"] = max(ev["end"], min(want, nxt - rules.gap_s))
        if i + 1 < len(out) and nxt - ev["end"] < rules.gap_s:
            if nxt - rules.gap_s - ev["start"] >= (ev["end"] - ev["start"]) / 2:
                ev["end"] = nxt - rules.gap_s
            else:
                out[i + 1]["start"] = min(ev["end"] + rules.gap_s, out[i + 1]["end"])
    return out


def escaped(text: str, fmt: str) -> str:
    """Cue text as a file of ``fmt`` can hold it: no ``-->`` (it would read as a cue's
    timing line): ``--&gt;`` in a vtt (WebVTT's character reference, shown as ``-->``), ``->``
    in an srt (SubRip has none); no blank line (it would end the cue)."""
    text = re.sub(r"\n\s*\n", "\n", text)
    return text.replace("-->", "--&gt;" if fmt == "vtt" else "->")


def laid_out(cues: list[dict[str, Any]], language: str | None = None, marks: bool = False) -> list[dict[str, Any]]:
    """The transcript's cues (in order, none overlapping: :func:`.subtitles.subtitle_cues`) as
    subtitle events ``{"start", "end", "text"}`` (seconds; lines joined by ``\\n``) by the rules
    of ``language`` (:func:`rules_for`): cut into events that fit (:func:`pieces`), short ones
    joined (:func:`merged_short`), timed (:func:`timed`). The words, read in order, are the
    cues'. With speakers (``diarize``), each event is one speaker's and carries its ``speaker``;
    with ``marks`` (srt), the speaker is written where it changes (:func:`events_of`)."""
    rules = rules_for(language, " ".join(str(c.get("text") or "") for c in cues[:50]))
    events = timed(merged_short(events_of(cues, rules, marks), rules), rules)
    return [
        {
            "start": round(e["start"], 3),
            "end": round(e["end"], 3),
            "text": "\n".join(lines(e["words"], rules)),
            **({"speaker": e["speaker"]} if e.get("speaker") else {}),
        }
        for e in events
    ]


def kept(events: list[dict[str, Any]], rules: Rules) -> dict[str, float]:
    """The share of ``events`` (``{"start", "end", "text"}``, lines joined by ``\\n``) that
    keep each rule, in percent: ``lines`` (at most :attr:`Rules.lines` lines of at most
    :attr:`Rules.line_chars`), ``duration`` (:attr:`Rules.min_s` to :attr:`Rules.max_s`, to the
    millisecond), ``speed`` (at most :attr:`Rules.cps` characters a second, a line break not
    counted), ``gap`` (at least :attr:`Rules.gap_s` before the next, to the millisecond)."""
    n = len(events) or 1
    ok = {"lines": 0, "duration": 0, "speed": 0, "gap": 0}
    for i, e in enumerate(events):
        d = e["end"] - e["start"]
        rows = e["text"].split("\n")
        ok["lines"] += len(rows) <= rules.lines and all(len(r) <= rules.line_chars for r in rows)
        ok["duration"] += rules.min_s - 1e-3 <= d <= rules.max_s + 1e-3
        ok["speed"] += d > 0 and len(e["text"].replace("\n", " ")) / d <= rules.cps + 1e-6
        ok["gap"] += i + 1 == len(events) or events[i + 1]["start"] - e["end"] >= rules.gap_s - 1e-3
    return {k: 100.0 * v / n for k, v in ok.items()}
