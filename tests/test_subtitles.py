"""Subtitle cues (edge_queue/kinds/subtitles.py; docs/topics.md, "`transcribe`"): no two cues
overlap, and none is longer than 7 s where the speech allows a cut. Plain data, milliseconds."""

from __future__ import annotations

from typing import Any

import pytest

from edge_queue.kinds.subtitles import MAX_CUE_S, subtitle_cues
from edge_queue.kinds.transcribe import render


def seg(start: float, end: float, text: str, words: list[tuple[float, float, str]] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"start": start, "end": end, "text": text}
    if words is not None:
        out["words"] = [{"start": s, "end": e, "word": w, "probability": 0.9} for s, e, w in words]
    return out


def check(cues: list[dict[str, Any]]) -> None:
    for before, after in zip(cues, cues[1:], strict=False):
        assert before["end"] <= after["start"], (before, after)
    assert all(c["end"] >= c["start"] and c["text"] == c["text"].strip() and c["text"] for c in cues)


def test_a_repeat_inside_the_cue_before_is_dropped() -> None:
    # as measured on an hour of speech: "Hello" 340.73-342.73, then "Hello." 341.75-342.43
    cues = subtitle_cues([seg(340.73, 342.73, " Hello"), seg(341.75, 342.43, " Hello."), seg(343.0, 344.0, " Bye.")])
    assert [(c["start"], c["end"], c["text"]) for c in cues] == [(340.73, 342.73, "Hello"), (343.0, 344.0, "Bye.")]


def test_an_overlap_ends_the_earlier_cue_where_the_next_begins() -> None:
    cues = subtitle_cues([seg(10.0, 13.0, " The end of a chunk"), seg(12.4, 15.0, " the start of the next.")])
    assert [(c["start"], c["end"]) for c in cues] == [(10.0, 12.4), (12.4, 15.0)]
    check(cues)


def test_cues_come_in_start_order_and_empty_ones_go() -> None:
    cues = subtitle_cues([seg(5.0, 6.0, " Second."), seg(1.0, 2.0, " First."), seg(3.0, 4.0, "  ")])
    assert [c["text"] for c in cues] == ["First.", "Second."]


def test_a_long_cue_with_word_times_is_cut_after_a_sentence() -> None:
    words = [(0.0, 0.5, " One"), (0.5, 1.0, " two."), (1.2, 3.0, " Three"), (3.0, 6.5, " four,"), (6.6, 9.0, " five")]
    cues = subtitle_cues([seg(0.0, 9.0, " One two. Three four, five", words)])
    assert [(c["start"], c["end"], c["text"]) for c in cues] == [(0.0, 6.5, "One two. Three four,"), (6.6, 9.0, "five")]
    check(cues)


def test_a_long_cue_without_punctuation_is_cut_at_its_longest_pause() -> None:
    words = [(float(i), i + 0.6, f" w{i}") for i in range(4)] + [
        (5.5, 6.0, " w4"),
        (6.1, 6.9, " w5"),
        (7.0, 12.0, " w6"),
    ]
    cues = subtitle_cues([seg(0.0, 12.0, "".join(w for *_, w in words), words)])
    assert cues[0]["text"] == "w0 w1 w2 w3" and cues[1]["start"] == 5.5
    assert all(c["end"] - c["start"] <= MAX_CUE_S for c in cues)
    check(cues)


def test_a_long_cue_without_word_times_is_cut_at_sentences_timed_by_characters() -> None:
    text = " First sentence here. Second one is here too. Third is the last one of them."
    cues = subtitle_cues([seg(100.0, 115.0, text)])
    assert [c["text"] for c in cues] == [
        "First sentence here.",
        "Second one is here too.",
        "Third is the last one of them.",
    ]
    assert cues[0]["start"] == 100.0 and cues[-1]["end"] == 115.0
    assert all(c["end"] - c["start"] <= MAX_CUE_S for c in cues)
    check(cues)


def test_a_long_cue_with_no_place_to_cut_stays_whole() -> None:
    cues = subtitle_cues([seg(0.0, 9.0, " oneverylongwordwithoutanyplacetocut")])
    assert [(c["start"], c["end"]) for c in cues] == [(0.0, 9.0)]


@pytest.mark.parametrize("fmt", ["srt", "vtt"])
def test_srt_and_vtt_show_the_cues_and_json_keeps_the_segments(fmt: str) -> None:
    segments = [seg(0.0, 2.0, " Hello"), seg(1.5, 2.0, " Hello.")]
    text = render(fmt, segments, {})
    assert text.count("-->") == 1 and "Hello." not in text
    assert '"Hello."' in render("json", segments, {}).replace(" Hello.", "Hello.")


def test_any_segments_give_ordered_cues_that_never_overlap() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    times = st.floats(min_value=0, max_value=600, allow_nan=False)
    texts = st.sampled_from([" a", " Hello.", " one, two", " This is it. And more.", "  ", " x y z"])
    segments = st.lists(st.tuples(times, st.floats(min_value=0, max_value=40), texts), max_size=30)

    @settings(max_examples=300, deadline=None)
    @given(segments)
    def run(raw: list[tuple[float, float, str]]) -> None:
        cues = subtitle_cues([seg(s, s + d, t) for s, d, t in raw])
        check(cues)
        assert [c["start"] for c in cues] == sorted(c["start"] for c in cues)

    run()
