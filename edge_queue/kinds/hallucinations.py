"""Text the model made up, left out of the transcript (docs/topics.md, "`transcribe`", Made-up
text): plain functions over the segment dicts the transcription makes (``text``, and the
model's own ``no_speech_prob``, ``avg_logprob``, ``compression_ratio``, optional ``words``
with their ``probability``).

Whisper writes text on silence, music and noise, and on speech in a language its model does not
speak: "you", "Thank you for watching", a line again and again. faster-whisper's sequential
decoder leaves out a window its model marks as no speech (``no_speech_threshold`` 0.6 with
``log_prob_threshold`` -1.0) and decodes a too repetitive one again at a higher temperature
(``compression_ratio_threshold`` 2.4), but keeps the last try; its batched pipeline does
neither. The same thresholds are applied here to every segment, with loops within a segment,
a line repeated, and the phrases Whisper is known to make up when the model doubts them.
"""

from __future__ import annotations

import re
from typing import Any

#: faster-whisper's defaults (``WhisperModel.transcribe``): a segment is no speech when both
#: hold...
NO_SPEECH_THRESHOLD = 0.6
LOG_PROB_THRESHOLD = -1.0
#: ... and too repetitive above this gzip compression ratio of its text.
COMPRESSION_RATIO_THRESHOLD = 2.4
#: A run of 1 to :data:`LOOP_MAX_WORDS` words said this many times in a row is a loop...
LOOP_TIMES = 4
LOOP_MAX_WORDS = 8
#: The model doubts a segment when its no-speech probability is over this, its average log
#: probability under :data:`DOUBT_LOG_PROB`, or its words' mean probability under
#: :data:`DOUBT_WORD_PROB`.
DOUBT_NO_SPEECH = 0.2
DOUBT_LOG_PROB = -0.7
DOUBT_WORD_PROB = 0.5
#: Text Whisper makes up on silence, music and noise (its training data's subtitle credits and
#: video endings), compared without case and punctuation: a whole segment of one of these...
JUNK_LINES = frozenset(
    {
        "you",
        "thank you",
        "thanks",
        "bye",
        "bye bye",
        "thank you very much",
        "thank you so much",
    }
)
#: ... or a segment holding one of these.
JUNK_PHRASES = (
    "thank you for watching",
    "thanks for watching",
    "thank you very much for watching",
    "thank you so much for watching",
    "thanks for listening",
    "thank you for listening",
    "see you in the next video",
    "see you next time",
    "the end of the video",
    "please subscribe",
    "subscribe to my channel",
    "like and subscribe",
    "subtitles by",
    "amara org",
    "transcribed by",
    "translated by",
)
_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)*")


def words_of(text: str) -> list[str]:
    """``text``'s words in lower case, without punctuation."""
    return _WORD.findall(text.lower())


def no_speech(seg: dict[str, Any]) -> bool:
    """Whether the model marks ``seg`` as no speech, as faster-whisper's sequential decoder
    does (a no-speech probability over 0.6 with an average log probability under -1.0)."""
    return (
        float(seg.get("no_speech_prob", 0.0)) > NO_SPEECH_THRESHOLD
        and float(seg.get("avg_logprob", 0.0)) < LOG_PROB_THRESHOLD
    )


def looped(text: str) -> bool:
    """Whether ``text`` holds a run of 1 to :data:`LOOP_MAX_WORDS` words said
    :data:`LOOP_TIMES` times in a row ("my baby, my baby, my baby, my baby")."""
    words = words_of(text)
    for n in range(1, LOOP_MAX_WORDS + 1):
        for i in range(len(words) - n * LOOP_TIMES + 1):
            run = words[i : i + n]
            if all(words[i + k * n : i + (k + 1) * n] == run for k in range(1, LOOP_TIMES)):
                return True
    return False


def repetitive(seg: dict[str, Any]) -> bool:
    """Whether ``seg``'s text repeats itself as a made-up loop does: :func:`looped`, or a
    compression ratio over 2.4 (faster-whisper's threshold) in a segment the model
    :func:`doubted`. A sentence said again and again, clearly (a refrain, a window holding the
    same sentence twice), compresses as well as a loop; the model is sure of it, and it stays."""
    if looped(str(seg.get("text", ""))):
        return True
    return float(seg.get("compression_ratio", 0.0)) > COMPRESSION_RATIO_THRESHOLD and unsure_of_words(seg)


def doubted(seg: dict[str, Any]) -> bool:
    """Whether the model doubts ``seg`` (:data:`DOUBT_NO_SPEECH`, :data:`DOUBT_LOG_PROB`,
    :data:`DOUBT_WORD_PROB`)."""
    probs = [float(w["probability"]) for w in seg.get("words") or [] if isinstance(w, dict) and "probability" in w]
    return (
        float(seg.get("no_speech_prob", 0.0)) > DOUBT_NO_SPEECH
        or float(seg.get("avg_logprob", 0.0)) < DOUBT_LOG_PROB
        or bool(probs and sum(probs) / len(probs) < DOUBT_WORD_PROB)
    )


def unsure_of_words(seg: dict[str, Any]) -> bool:
    """Whether the model is unsure of ``seg``'s words: an average log probability under
    :data:`DOUBT_LOG_PROB`, its words' mean probability under :data:`DOUBT_WORD_PROB`, or a
    no-speech probability over :data:`NO_SPEECH_THRESHOLD`. A no-speech probability between 0.2
    and 0.6 alone does not count here: a batched window of clear speech had 0.37 (with an average
    log probability of -0.06), and every segment cut from a window carries the window's."""
    probs = [float(w["probability"]) for w in seg.get("words") or [] if isinstance(w, dict) and "probability" in w]
    return (
        float(seg.get("avg_logprob", 0.0)) < DOUBT_LOG_PROB
        or bool(probs and sum(probs) / len(probs) < DOUBT_WORD_PROB)
        or float(seg.get("no_speech_prob", 0.0)) > NO_SPEECH_THRESHOLD
    )


def junk(text: str) -> bool:
    """Whether ``text`` is one of the lines or holds one of the phrases Whisper is known to
    make up (:data:`JUNK_LINES`, :data:`JUNK_PHRASES`)."""
    plain = " ".join(words_of(text))
    return plain in JUNK_LINES or any(p in plain for p in JUNK_PHRASES)


#: A line is compared with the lines of this many segments kept before it.
REPEATED_WITHIN = 3


def why_left_out(seg: dict[str, Any], previous: list[dict[str, Any]]) -> str | None:
    """Why ``seg`` is left out of the transcript, or ``None`` to keep it: ``no_speech``
    (:func:`no_speech`), ``repetitive`` (:func:`repetitive`), ``junk`` (:func:`junk` text, or
    text without a word, that the model :func:`doubted`), ``repeated`` (the text of one of ``previous``, the last
    :data:`REPEATED_WITHIN` segments kept before it, again, its words :func:`unsure_of_words`)."""
    text = str(seg.get("text", ""))
    if no_speech(seg):  # with words or without (". . ." on loud noise)
        return "no_speech"
    if not words_of(text):  # punctuation alone: made up on noise when the model doubts it
        return "junk" if doubted(seg) else None
    if repetitive(seg):
        return "repetitive"
    if junk(text) and doubted(seg):
        return "junk"
    if any(words_of(text) == words_of(str(p.get("text", ""))) for p in previous[-REPEATED_WITHIN:]):
        if unsure_of_words(seg):  # said again clearly ("Can you hear me?" twice on a call) is speech
            return "repeated"
    return None


def real_speech(segments: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """``segments`` without those :func:`why_left_out` leaves out, in order, and how many were
    left out for each reason."""
    kept: list[dict[str, Any]] = []
    left_out: dict[str, int] = {}
    for seg in segments:
        reason = why_left_out(seg, kept[-REPEATED_WITHIN:])
        if reason is None:
            kept.append(seg)
        else:
            left_out[reason] = left_out.get(reason, 0) + 1
    return kept, left_out
