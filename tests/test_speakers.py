"""Who speaks when, as plain functions (edge_queue/kinds/speakers.py, documents.py): clustering,
names by first appearance, segments and words labelled, a shared segment cut at the change,
and the formats that show the speakers. Synthetic embeddings; no audio, no model."""

from __future__ import annotations

from typing import Any

import pytest

from edge_queue.kinds.cue_layout import LATIN, kept, laid_out
from edge_queue.kinds.documents import render
from edge_queue.kinds.speakers import Voice, clusters, labelled, smoothed, speaker_names

np = pytest.importorskip("numpy")
DIM = 8


def unit(*values: float) -> Any:
    v = np.zeros(DIM, np.float32)
    v[: len(values)] = values
    return v / np.linalg.norm(v)


A, B, C = unit(1, 0.1), unit(0.1, 1), unit(0, 0.1, 1)


def voice(e: Any, start: float, end: float, windows: list[Any] | None = None) -> Voice:
    windows = windows or [e]
    step = (end - start) / len(windows)
    spans = [(start + k * step, start + k * step + 1.6) for k in range(len(windows))]
    return Voice(e, end - start, np.stack(windows), spans)


def seg(start: float, end: float, text: str = " words", words: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"start": start, "end": end, "text": text, **({"words": words} if words else {})}


def test_one_voice_alone_is_one_speaker() -> None:
    near = np.stack([unit(1, 0.1 * k) for k in range(6)])
    assert set(clusters(near)) == {0}


def test_two_voices_are_two_speakers_and_the_bounds_hold() -> None:
    two = np.stack([A, B, A, B, unit(1, 0.2), unit(0.2, 1)])
    labels = clusters(two)
    assert len(set(labels)) == 2 and labels[0] == labels[2] == labels[4] and labels[1] == labels[3] == labels[5]
    assert len(set(clusters(two, max_speakers=1))) == 1
    assert len(set(clusters(np.stack([A, unit(1, 0.12), unit(1, 0.14)]), min_speakers=2))) == 2


def test_three_voices_are_three_speakers_unless_max_speakers_says_two() -> None:
    three = np.stack([A, B, C, A, B, C])
    assert len(set(clusters(three))) == 3
    assert len(set(clusters(three, max_speakers=2))) == 2


def test_no_segment_is_no_speaker() -> None:
    assert clusters(np.zeros((0, DIM))) == []
    assert labelled([], []) == ([], 0)


def test_speakers_are_named_in_order_of_first_appearance() -> None:
    assert speaker_names([3, 3, 1, 3, 0]) == {3: "SPEAKER_00", 1: "SPEAKER_01", 0: "SPEAKER_02"}


def test_segments_and_words_carry_their_speakers() -> None:
    words = [{"start": 4.0, "end": 4.5, "word": " yes"}, {"start": 4.5, "end": 5.5, "word": " indeed"}]
    segments = [seg(0, 3), seg(4, 5.5, " yes indeed", words), seg(6, 9)]
    out, count = labelled(segments, [voice(B, 0, 3), voice(A, 4, 5.5), voice(B, 6, 9)])
    assert count == 2
    assert [s["speaker"] for s in out] == ["SPEAKER_00", "SPEAKER_01", "SPEAKER_00"]
    assert {w["speaker"] for w in out[1]["words"]} == {"SPEAKER_01"}


def test_a_short_segment_takes_the_nearest_speaker() -> None:
    out, count = labelled([seg(0, 3), seg(3.2, 3.6), seg(4, 7)], [voice(A, 0, 3), voice(B, 3.2, 3.6), voice(B, 4, 7)])
    assert count == 2 and out[1]["speaker"] == out[2]["speaker"] == "SPEAKER_01"


def test_a_segment_two_speakers_share_is_cut_at_the_word_where_the_speaker_changes() -> None:
    # Given a 6-s segment: A speaks its first 3 s, B its last 3 s, windows every 1 s
    words = [{"start": float(k), "end": k + 0.9, "word": f" w{k}", "probability": 0.9} for k in range(6)]
    shared = {**seg(0, 6, "".join(w["word"] for w in words), words), "tokens": [1, 2, 3], "avg_logprob": -0.2}
    windows = [A, A, A, B, B, B]
    spans = [(k - 0.3, k + 1.3) for k in range(6)]  # each window's middle on a word's
    segments = [seg(10, 14), shared, seg(20, 24)]
    voices = [voice(A, 10, 14), Voice(A, 6.0, np.stack(windows), spans), voice(B, 20, 24)]
    out, count = labelled(segments, voices)
    assert count == 2
    assert [(s["start"], s["end"], s["text"], s["speaker"]) for s in out[1:3]] == [
        (0, 2.9, " w0 w1 w2", "SPEAKER_00"),
        (3.0, 6, " w3 w4 w5", "SPEAKER_01"),
    ]
    assert "tokens" not in out[1] and out[1]["avg_logprob"] == -0.2


def test_a_turn_shorter_than_a_second_inside_a_segment_keeps_the_speaker_around_it() -> None:
    words = [{"start": k * 0.3, "end": k * 0.3 + 0.3, "word": " w"} for k in range(10)]
    assert smoothed(words, [0, 0, 0, 1, 1, 0, 0, 0, 0, 0]) == [0] * 10
    assert smoothed(words, [1, 0, 0, 0, 0, 0, 0, 0, 0, 0]) == [0] * 10
    assert smoothed(words, [0, 0, 0, 0, 0, 1, 1, 1, 1, 1]) == [0] * 5 + [1] * 5


def test_the_formats_show_who_speaks_where_the_speaker_changes() -> None:
    segments = [
        {"start": 0.0, "end": 2.0, "text": " Hello.", "speaker": "SPEAKER_00"},
        {"start": 2.5, "end": 4.0, "text": " Hello?", "speaker": "SPEAKER_01"},
        {"start": 4.5, "end": 6.0, "text": " Oh, hello.", "speaker": "SPEAKER_01"},
        {"start": 6.5, "end": 8.0, "text": " Hi.", "speaker": "SPEAKER_00"},
    ]
    assert render("txt", segments, {}) == "[SPEAKER_00] Hello.\n[SPEAKER_01] Hello? Oh, hello.\n[SPEAKER_00] Hi.\n"
    srt = render("srt", laid_out(segments, "en", marks=True), {})
    assert "\n[SPEAKER_00] Hello.\n" in srt and "\n[SPEAKER_01] Hello?\n" in srt
    assert "\nOh, hello.\n" in srt and "\n[SPEAKER_00] Hi.\n" in srt
    vtt = render("vtt", segments, {})
    assert "<v SPEAKER_01>Oh, hello.\n" in vtt and vtt.count("<v ") == 4


def test_a_speaker_mark_counts_in_the_line_and_stays_with_its_first_word() -> None:
    words = " Well, I think we should meet on Thursday afternoon, if that works for everybody."
    cue = {"start": 0.0, "end": 5.0, "text": words, "speaker": "SPEAKER_01"}
    events = laid_out([cue], "en", marks=True)
    assert events[0]["text"].startswith("[SPEAKER_01] Well,") and kept(events, LATIN)["lines"] == 100.0
    assert all("SPEAKER" not in e["text"] for e in events[1:])
    assert laid_out([cue], "en")[0]["text"].startswith("Well,")


def test_two_speakers_words_are_never_one_subtitle_event() -> None:
    # two short cues a blink apart would be joined into one event without speakers
    cues = [
        {"start": 0.0, "end": 0.4, "text": " Hello?", "speaker": "SPEAKER_00"},
        {"start": 0.5, "end": 0.9, "text": " Hello.", "speaker": "SPEAKER_01"},
    ]
    events = laid_out(cues, "en")
    assert [e["speaker"] for e in events] == ["SPEAKER_00", "SPEAKER_01"]
    assert all(a["end"] <= b["start"] for a, b in zip(events, events[1:], strict=False))
    assert len(laid_out([{k: v for k, v in c.items() if k != "speaker"} for c in cues], "en")) == 1


def test_max_speakers_below_min_speakers_is_refused_at_submit(tmp_path: Any) -> None:
    from edge_queue.config.settings import Settings
    from edge_queue.errors import ErrorCode, RequestError
    from edge_queue.kinds.transcribe import Transcribe

    settings = Settings(data_dir=tmp_path)
    Transcribe.check_options(Transcribe.Options(diarize=True, min_speakers=2, max_speakers=2), settings)
    with pytest.raises(RequestError) as refused:
        Transcribe.check_options(Transcribe.Options(diarize=True, min_speakers=3, max_speakers=2), settings)
    assert refused.value.code == ErrorCode.INVALID_REQUEST and refused.value.field == "options.max_speakers"


def test_a_recording_too_short_to_tell_voices_apart_is_one_speaker() -> None:
    out, count = labelled([seg(0.0, 0.6, " Hi.")], [voice(A, 0.0, 0.6)], min_speakers=1, max_speakers=4)
    assert count == 1 and out[0]["speaker"] == "SPEAKER_00"


def words_of(start: float, end: float) -> list[dict[str, Any]]:
    return [{"start": start + k, "end": start + k + 0.9, "word": f" w{k}"} for k in range(int(end - start))]


def test_min_speakers_holds_after_the_words_take_their_windows_speakers() -> None:
    # Given JFK, then a reader in two segments whose second's windows are nearer the first's voice
    b1, b2 = unit(0.1, 1, 0.05), unit(0.1, 1, 0.15)
    segments = [seg(0, 4, " a", words_of(0, 4)), seg(5, 10, " b", words_of(5, 10)), seg(11, 17, " c", words_of(11, 17))]
    voices = [voice(A, 0, 4, [A, A]), voice(b1, 5, 10, [b1, b1]), voice(b2, 11, 17, [b1, b1])]
    # When at least three speakers are asked for: three, each on its segment's words
    out, count = labelled(segments, voices, min_speakers=3)
    assert count == 3
    assert [s["speaker"] for s in out] == ["SPEAKER_00", "SPEAKER_01", "SPEAKER_02"]
    assert {w["speaker"] for w in out[2]["words"]} == {"SPEAKER_02"}
    # ...and without the floor, the method's own two
    assert labelled(segments, voices)[1] == 2


def test_max_speakers_holds_after_the_words_take_their_windows_speakers() -> None:
    # Given three voices, each segment's windows another voice's: words never bring a fourth
    segments = [seg(0, 4, " a", words_of(0, 4)), seg(5, 9, " b", words_of(5, 9)), seg(10, 14, " c", words_of(10, 14))]
    voices = [voice(A, 0, 4, [C, C]), voice(B, 5, 9, [A, A]), voice(C, 10, 14, [B, B])]
    for most in (1, 2):
        out, count = labelled(segments, voices, max_speakers=most)
        assert count == len({w["speaker"] for s in out for w in s["words"]}) <= most


def test_the_http_apis_speaker_bounds_are_plain_whole_numbers_within_1_to_32_naming_their_field() -> None:
    from edge_queue.errors import RequestError
    from edge_queue.http.values import flag, speaker_bounds

    assert speaker_bounds("2", "32") == {"min_speakers": 2, "max_speakers": 32}
    assert speaker_bounds(None, None) == {} and speaker_bounds("3", None) == {"min_speakers": 3}
    refused = [
        (("0", None), "min_speakers"),
        (("-1", None), "min_speakers"),
        (("33", None), "min_speakers"),
        ((None, "0"), "max_speakers"),
        ((None, "1000000000"), "max_speakers"),
        (("3", "2"), "max_speakers"),
        ((" 2", None), "min_speakers"),
        (("+2", None), "min_speakers"),
        (("\u0662", None), "min_speakers"),  # an Arabic-Indic two
        (("", None), "min_speakers"),
        ((None, "2.0"), "max_speakers"),
    ]
    for values, name in refused:
        with pytest.raises(RequestError) as bad:
            speaker_bounds(*values)
        assert bad.value.field == name and bad.value.message.startswith(f"{name}: "), (values, bad.value.message)
    with pytest.raises(RequestError) as maybe:
        flag("maybe", False, "diarize")
    assert maybe.value.field == "diarize"
