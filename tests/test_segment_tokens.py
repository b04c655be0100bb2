"""A segment's ``tokens`` are its own (docs/topics.md, "`transcribe`"): the tokens that spell its
text, also for a segment cut from a batched window or from a longer segment, or joined with
another. The rules on plain lists (edge_queue/kinds/segment_tokens.py), then the kind on real
speech, its tokens read back with the model's own tokenizer."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from edge_queue.config.settings import Settings
from edge_queue.kinds.segment_tokens import Vocabulary, cut, joined
from edge_queue.kinds.subtitles import subtitle_cues

from .helpers.worker_ctx import Ctx

#: A vocabulary of words: token i spells WORDS[i]; 100 and over (timestamps) spell nothing.
WORDS = [" And", " so,", " my", " fellow", " Americans.", " Ask", " not", "é", " é"]


def _spell(ids: Any) -> str:
    return "".join(WORDS[t] for t in ids if t < 100)


TOY = Vocabulary(_spell, lambda text: [WORDS.index(w) for w in text.replace(" ", "\0 ").split("\0") if w])


def test_a_cut_gives_each_piece_the_tokens_of_its_text() -> None:
    # Given a segment's tokens, timestamps at both ends (the sequential decoder's)
    tokens = [150, 0, 1, 2, 3, 4, 5, 6, 180]
    # When it is cut after " so," and after " Americans."
    got = cut(tokens, [" And so,", " my fellow Americans.", " Ask not"], TOY)
    # Then each piece has the decoder's tokens of its text, the timestamps with the text beside them
    assert got == [[150, 0, 1], [2, 3, 4], [5, 6, 180]]
    assert [_spell(t) for t in got] == [" And so,", " my fellow Americans.", " Ask not"]
    # and a timestamp between two pieces' text stays with the text before it
    assert cut([0, 1, 170, 2], [" And so,", " my"], TOY) == [[0, 1, 170], [2]]


def test_pieces_that_are_not_the_tokens_text_are_encoded() -> None:
    # Given pieces whose text, read in order, is not what the tokens spell (alignment's words)
    got = cut([0, 1, 2], [" And", " fellow"], TOY)
    # Then each piece's text is encoded: tokens that spell it
    assert got == [[0], [3]]
    # and without a vocabulary no piece is given tokens it does not hold
    assert cut([0, 1, 2], [" And", " so, my"], None) == [[], []]


def test_joined_segments_keep_both_tokens_when_they_spell_the_text() -> None:
    assert joined({"tokens": [0, 1]}, {"tokens": [2]}, " And so, my", TOY) == [0, 1, 2]
    assert joined({"tokens": [0]}, {"tokens": [2]}, " And my", TOY) == [0, 2]
    assert joined({"tokens": [0]}, {"tokens": [7]}, " And é", TOY) == [0, 8]  # "é" had no space before it
    assert joined({"tokens": [0]}, {"tokens": [1]}, " And so,", None) == []


def test_a_long_segment_cut_into_cues_has_its_own_tokens() -> None:
    # Given a 9-s segment with word times, longer than a cue may last (before: each cue kept
    # the whole segment's tokens)
    words = [{"start": i * 1.3, "end": i * 1.3 + 0.9, "word": w} for i, w in enumerate(WORDS[:7])]
    seg = {"start": 0.0, "end": 9.0, "text": "".join(WORDS[:7]), "tokens": [150, *range(7), 190], "words": words}
    got = subtitle_cues([seg], vocab=TOY)
    # Then it is cut after the sentence, and each cue holds the tokens of its own text
    assert [c["text"] for c in got] == [" And so, my fellow Americans.", " Ask not"]
    assert [c["tokens"] for c in got] == [[150, 0, 1, 2, 3, 4], [5, 6, 190]]


def _transcribe(tmp_path: Path, path: Path, name: str, **transcribe: Any) -> list[dict[str, Any]]:
    """The kind on ``path`` in this process (the bundled tiny.en): its json's segments."""
    from edge_queue.kinds.transcribe import Transcribe

    settings = Settings(data_dir=tmp_path / name, transcribe=transcribe)
    options = Transcribe.Options(formats=["json"], language="en", word_timestamps=True)
    result = Transcribe().run(Ctx(settings, tmp_path / name / "out"), str(path), options)
    return list(json.loads(Path(result["outputs"]["json"]).read_text())["segments"])


@pytest.mark.slow
@pytest.mark.usefixtures("model_installed")
@pytest.mark.parametrize("batch_size", [4, 1], ids=["batched", "sequential"])
def test_the_tokens_of_each_segment_spell_its_text_on_real_speech(
    tmp_path: Path, speech: Path, long_recording: Callable[[float], tuple[Path, str]], batch_size: int
) -> None:
    from faster_whisper.tokenizer import Tokenizer
    from tokenizers import Tokenizer as HfTokenizer

    from edge_queue.kinds.bundled import tiny_en

    # the model's own tokenizer, as faster-whisper reads tokens (special and timestamp ones spell nothing)
    tokenizer = Tokenizer(HfTokenizer.from_file(str(Path(str(tiny_en())) / "tokenizer.json")), False)
    # Given real speech: a short clip and 100 s of clips, decoded in batches (the default,
    # windows cut into sentences) or one window after another (segments over 7 s cut into cues)
    for name, path in [("jfk", speech / "jfk.flac"), ("long", long_recording(100.0)[0])]:
        segments = _transcribe(tmp_path, path, f"{name}-{batch_size}", batch_size=batch_size)
        assert segments
        # Then each segment's tokens, read with the model's tokenizer, spell its text
        for s in segments:
            assert s["tokens"], s
            assert tokenizer.decode(s["tokens"]) == s["text"], (name, s)
