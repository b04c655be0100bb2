"""Text the model made up, left out of the transcript (edge_queue/kinds/hallucinations.py;
docs/topics.md, "`transcribe`"): segments the model marks as no speech, loops, a line repeated,
and the phrases Whisper makes up on silence and noise when the model doubts them. Milliseconds;
the end-to-end runs on real audio are in tests/test_made_up_text.py."""

from __future__ import annotations

import random

import orjson

from edge_queue.http.transcripts import openai_verbose, whisper_json
from edge_queue.kinds.hallucinations import looped, real_speech, why_left_out
from edge_queue.kinds.whisper import MAX_NEW_TOKENS, token_budget


def seg(text: str, nsp: float = 0.05, lp: float = -0.3, cr: float = 1.3, **more: object) -> dict:
    return {
        "start": 0.0,
        "end": 2.0,
        "text": text,
        "no_speech_prob": nsp,
        "avg_logprob": lp,
        "compression_ratio": cr,
        **more,
    }


def test_what_the_model_marks_as_no_speech_is_left_out() -> None:
    # faster-whisper's own rule: no-speech probability over 0.6 with a log probability under -1
    assert why_left_out(seg(" Thank you very much.", nsp=0.61, lp=-1.14), []) == "no_speech"  # espeak Spanish
    assert why_left_out(seg(" We were told.", nsp=0.7, lp=-0.5), []) is None  # the model is sure of the words
    assert why_left_out(seg(" We were told.", nsp=0.3, lp=-1.5), []) is None  # unsure, but it heard speech
    # punctuation alone, on 60 s of loud pink noise (language en given): no words, no speech
    assert why_left_out(seg(" . .", nsp=0.94, lp=-1.59, cr=0.5), []) == "no_speech"
    assert why_left_out(seg(" ...", nsp=0.05, lp=-0.3), []) is None  # the model heard speech: not judged
    # punctuation alone that the model doubts: made up on loud pink noise with "en" given (these
    # numbers measured there, 6 such cues in 2 of 6 noises)
    assert why_left_out(seg(" .", nsp=0.91, lp=-0.57, cr=1.42), []) == "junk"
    assert why_left_out(seg(" . .", nsp=0.91, lp=-0.54, cr=1.75), []) == "junk"


def test_loops_and_repetitive_text_are_left_out() -> None:
    assert why_left_out(seg(" before my baby, my baby, my baby, my baby, my baby."), []) == "repetitive"
    assert why_left_out(seg(" It was it was it was it was", cr=1.2), []) == "repetitive"
    assert why_left_out(seg(" A long text that compresses well", cr=2.6, lp=-0.8), []) == "repetitive"
    # a window holding one sentence said twice, clearly (the model is sure): speech, kept
    jfk = " Ask not what your country can do for you, ask what you can do for your country."
    assert why_left_out(seg(jfk + jfk, cr=3.48, lp=-0.06, nsp=0.37), []) is None  # measured on jfk.flac x 6
    assert not looped("No, no, no. I said it was the third time, the third time.")
    assert looped("$1,000,000,000,000,000,000,000,000")


def test_known_junk_goes_when_the_model_doubts_it_and_stays_when_it_does_not() -> None:
    # silence, sequential decoder, no VAD: " You" with no-speech 0.94 and log probability -0.82
    assert why_left_out(seg(" You", nsp=0.94, lp=-0.82), []) == "junk"
    assert why_left_out(seg(" This is the end of the video, which is the end of the video.", nsp=0.52, lp=-1.22), [])
    assert why_left_out(seg(" Thanks for watching!", nsp=0.1, lp=-0.2, words=[{"probability": 0.2}]), []) == "junk"
    # said, and heard clearly: kept
    assert why_left_out(seg(" Thank you.", nsp=0.01, lp=-0.15), []) is None
    assert why_left_out(seg(" Thank you for watching.", nsp=0.02, lp=-0.2), []) is None


def test_a_line_repeated_is_left_out_once_kept() -> None:
    segments = [seg(" We can't do it.", nsp=0.52, lp=-0.78) for _ in range(3)] + [seg(" Then we left.")]
    kept, left_out = real_speech(segments)
    assert [s["text"] for s in kept] == [" We can't do it.", " Then we left."]
    assert left_out == {"repeated": 2}
    # a line made up again a line later (espeak French, VAD off): "I am trying to get a new
    # model," / "but we have to get a new model." / "I am trying to get a new model."
    kept, left_out = real_speech(
        [
            seg(" I am trying to get a new model,", lp=-0.8),
            seg(" but we have to get a new model.", lp=-0.8),
            seg(" I am trying to get a new model.", lp=-0.8),
        ]
    )
    assert len(kept) == 2 and left_out == {"repeated": 1}
    # a sentence said again clearly is speech (a caller asking twice, a recording played twice)
    again = [seg(" Can you hear me now?", nsp=0.37), seg(" Can you hear me now?", nsp=0.37), seg(" Yes.")]
    kept, left_out = real_speech(again)
    assert len(kept) == 3 and left_out == {}
    # a word said twice, clearly, stays
    kept, _ = real_speech([seg(" No."), seg(" No."), seg(" Please.")])
    assert len(kept) == 3


def test_speech_is_kept_as_it_is() -> None:
    rng = random.Random(4)
    vocab = "the river ran down to a house where we were told to wait for the rest of them".split()
    segments = [seg(" " + " ".join(rng.sample(vocab, rng.randint(3, 12))).capitalize() + ".") for _ in range(200)]
    kept, left_out = real_speech(segments)
    assert kept == segments and left_out == {}


def test_verbose_json_and_asr_json_carry_the_models_own_numbers() -> None:
    doc = {
        "language": "en",
        "segments": [seg(" Hello.", nsp=0.012, lp=-0.25, cr=0.9, tokens=[2425, 13], words=[])],
    }
    (out,) = orjson.loads(openai_verbose(doc, "transcribe", words=False))["segments"]
    assert (out["avg_logprob"], out["no_speech_prob"], out["compression_ratio"], out["tokens"]) == (
        -0.25,
        0.012,
        0.9,
        [2425, 13],
    )
    (out,) = orjson.loads(whisper_json(doc))["segments"]
    assert (out["avg_logprob"], out["no_speech_prob"], out["tokens"]) == (-0.25, 0.012, [2425, 13])


def test_a_window_decodes_tokens_in_proportion_to_its_audio() -> None:
    # 6.6 s of espeak French looped to 448 tokens a try; speech takes 3-8 tokens a second
    assert token_budget(6.6) == 16 + 80 and token_budget(1.0) == 28
    # a 30-s window keeps the most that fit beside faster-whisper's longest prompt (1 + 223 + 4)
    assert token_budget(30.0) == token_budget(3600.0) == MAX_NEW_TOKENS == 448 - 228
