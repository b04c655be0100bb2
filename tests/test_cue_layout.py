"""srt and vtt cues that read like subtitles (edge_queue/kinds/cue_layout.py; docs/topics.md,
"Subtitles"): at most 2 lines of 42 characters (fewer for CJK) broken at natural places, 5/6 s
to 7 s on screen, at most 20 characters a second, 2 frames between events, the words unchanged.
Milliseconds."""

from __future__ import annotations

import random

from edge_queue.kinds.cue_layout import BY_LANGUAGE, LATIN, escaped, kept, laid_out, rules_for
from edge_queue.kinds.documents import render
from edge_queue.requests.outputs import cues as read_cues


def words_of(text: str, start: float, step: float) -> list[dict]:
    out, t = [], start
    for w in text.split(" "):
        out.append({"start": round(t, 3), "end": round(t + step * 0.8, 3), "word": " " + w, "probability": 0.9})
        t += step
    return out


def seg(text: str, start: float, step: float, with_words: bool = True) -> dict:
    words = words_of(text, start, step)
    out = {"start": start, "end": words[-1]["end"], "text": "".join(w["word"] for w in words)}
    if with_words:
        out["words"] = words
    return out


def flat(items: list[dict]) -> list[str]:
    return " ".join(i["text"] for i in items).split()


def test_a_long_line_is_two_lines_broken_after_the_comma() -> None:
    # jfk.flac's one segment, 107 characters on one line before
    text = "And so my fellow Americans, ask not what your country can do for you, ask what you can do for your country."
    events = laid_out([seg(text, 0.3, 0.5)])
    assert flat(events) == text.split()
    assert all(len(line) <= 42 for e in events for line in e["text"].split("\n")), events
    assert all(len(e["text"].split("\n")) <= 2 for e in events), events
    assert events[0]["text"].split("\n")[0] == "And so my fellow Americans,", events
    assert kept(events, LATIN) == {"lines": 100.0, "duration": 100.0, "speed": 100.0, "gap": 100.0}


def test_a_line_does_not_end_on_an_article() -> None:
    text = "We went down to the river for a swim in the cold water of the morning"
    (event,) = laid_out([seg(text, 0.0, 0.3)])
    top, bottom = event["text"].split("\n")
    assert top.split()[-1] not in ("the", "a"), event
    assert bottom.split()[0] in ("for", "in", "of", "to"), event


def test_hello_on_a_call_is_one_cue_long_enough_to_read() -> None:
    # A telephone call's "Hello." came out as six cues of 0.06-0.3 s, one after another
    pieces = [{"start": 1.0 + 0.2 * i, "end": 1.06 + 0.2 * i + 0.1 * (i % 3), "text": " Hello."} for i in range(6)]
    pieces.append(seg("Hi, it's me, do you have a minute?", 4.0, 0.3))
    events = laid_out(pieces)
    assert flat(events) == flat(pieces)
    assert events[0]["text"].count("Hello.") == 6, events
    assert events[0]["end"] - events[0]["start"] >= 5 / 6 - 1e-3, events
    assert events[0]["end"] <= events[1]["start"] - 2 / 24 + 1e-3, events
    # and a lone short word is held on screen into the silence after it
    (alone,) = laid_out([{"start": 3.0, "end": 3.2, "text": " Yes."}])
    assert alone["end"] - alone["start"] >= 5 / 6 - 1e-3 and alone["start"] == 3.0


def test_fast_speech_is_held_into_the_silence_after_it() -> None:
    text = "Well that is exactly what I told you yesterday"  # 46 characters in 1.5 s: 30 a second
    events = laid_out([{"start": 0.0, "end": 1.5, "text": " " + text}, seg("Right.", 6.0, 0.4)])
    assert events[0]["end"] - events[0]["start"] >= 46 / 20 - 1e-3, events
    assert kept(events, LATIN)["speed"] == 100.0


def test_a_word_too_long_for_a_line_or_for_7_s_is_an_event_of_its_own() -> None:
    # French for the English-only model, VAD off: one 12-s segment of "$1,000,000,000,...", and
    # the layout failed on it
    number = "$" + ",000" * 30
    for segments in (
        [{"start": 0.8, "end": 12.8, "text": " " + number}],
        [{"start": 0.0, "end": 1.0, "text": " Then"}, {"start": 1.0, "end": 13.0, "text": " Hmmmmmm."}],
        [seg("It cost " + number + " in the end.", 0.0, 2.0)],
    ):
        events = laid_out(segments)
        assert flat(events) == flat(segments), events
        assert any(e["text"] in (number, "Hmmmmmm.") for e in events), events


def test_events_do_not_touch() -> None:
    events = laid_out([seg("One sentence here.", 0.0, 0.5), seg("Then right after it.", 1.5, 0.5)])
    assert events[1]["start"] - events[0]["end"] >= 2 / 24 - 1e-3, events


def test_cjk_lines_are_shorter() -> None:
    text = "今日はとても良い天気ですね。散歩に行きましょうか。公園でお弁当を食べましょう。"
    events = laid_out([{"start": 0.0, "end": 6.0, "text": text}], "ja")
    assert "".join(e["text"].replace("\n", "") for e in events) == text
    rules = BY_LANGUAGE["ja"]
    assert all(len(line) <= rules.line_chars for e in events for line in e["text"].split("\n")), events
    assert rules_for(None, "你好，世界。我们今天去公园。") == BY_LANGUAGE["zh"]
    assert rules_for("en", "hello") == LATIN


def test_an_arrow_in_the_text_does_not_make_a_cue() -> None:
    segments = [{"start": 0.0, "end": 2.0, "text": " 00:00:05,000 --> 00:00:06,000"}, seg("Next.", 3.0, 0.4)]
    for fmt in ("srt", "vtt"):
        doc = render(fmt, laid_out(segments), {})
        assert len(read_cues(doc, fmt)) == 2, doc
        assert "-->" not in read_cues(doc, fmt)[0]["text"]
    assert escaped("a --> b", "vtt") == "a --&gt; b" and escaped("a --> b", "srt") == "a -> b"


def test_any_transcript_is_laid_out_within_the_rules_with_its_words_unchanged() -> None:
    rng = random.Random(53)
    vocab = ["a", "the", "and", "house", "extraordinary", "I", "go", "Hello.", "yes,", "but", "to", "internationally"]
    totals = {"lines": 0.0, "duration": 0.0, "speed": 0.0}
    for _ in range(150):
        segs, t = [], rng.uniform(0, 3)
        for _ in range(rng.randint(1, 20)):
            n = rng.randint(1, 30)
            s = seg(" ".join(rng.choice(vocab) for _ in range(n)), t, rng.uniform(0.3, 0.6), rng.random() < 0.5)
            segs.append(s)
            t = s["end"] + rng.choice([0.0, 0.05, 0.3, 2.0])
        before = [dict(s) for s in segs]
        events = laid_out(segs)
        assert segs == before  # the segments (txt, json) are not changed
        assert flat(events) == flat(segs)
        for a, b in zip(events, events[1:], strict=False):
            assert a["start"] < a["end"] <= b["start"] - 2 / 24 + 1e-3, (a, b)
        for e in events:
            rows = e["text"].split("\n")
            assert len(rows) <= 2 and all(len(r) <= 42 for r in rows), e
            assert e["end"] - e["start"] <= 7.0 + 1e-3, e
        for k, v in kept(events, LATIN).items():
            if k in totals:
                totals[k] += v / 150
    # durations and reading speed depend on how fast the words come and the room after them
    assert totals["lines"] > 99.99 and totals["duration"] >= 95 and totals["speed"] >= 90, totals
