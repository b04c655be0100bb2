"""A segment's own ``tokens`` where the transcription cuts a segment into several or joins two
(docs/topics.md, "`transcribe`"): plain functions over token ids, given the model's
:class:`Vocabulary`.

A segment is cut between words (a batched window into sentences, :func:`.whisper.cues`; a
segment over 7 s into cues, :func:`.subtitles.split`), and Whisper's words are whole tokens:
the decoder's tokens are cut where the text is, each piece keeping the tokens that spell its
text (a timestamp token, which spells nothing, stays with the text before it, and the first
piece keeps the ones before any text). Where the pieces' text is not the tokens' text read in
order (alignment gave other words), each piece gets its text encoded by the model's tokenizer:
tokens that spell the same text, not the decoder's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: A prefix of tokens that ends inside a character spells it so (the tokenizer's byte fallback).
PARTIAL = "\ufffd"


@dataclass(frozen=True)
class Vocabulary:
    """A model's tokenizer, as these functions use it: ``spell`` gives the text of token ids
    (special and timestamp tokens spell nothing), ``encode`` the ids of a text."""

    spell: Callable[[Sequence[int]], str]
    encode: Callable[[str], list[int]]


def vocabulary(hf_tokenizer: Any) -> Vocabulary | None:
    """The :class:`Vocabulary` of a faster-whisper model's ``hf_tokenizer`` (a
    ``tokenizers.Tokenizer``); None without one. Ids from ``<|endoftext|>`` on (the special and
    timestamp tokens) spell nothing, as in faster-whisper's own ``Tokenizer.decode``."""
    if hf_tokenizer is None:
        return None
    eot = hf_tokenizer.token_to_id("<|endoftext|>")

    def spell(ids: Sequence[int]) -> str:
        return str(hf_tokenizer.decode([t for t in ids if eot is None or t < eot], skip_special_tokens=False))

    def encode(text: str) -> list[int]:
        return list(hf_tokenizer.encode(text, add_special_tokens=False).ids)

    return Vocabulary(spell, encode)


def cut(tokens: Sequence[int], texts: Sequence[str], vocab: Vocabulary | None) -> list[list[int]]:
    """``tokens`` (a segment's) cut into one list per text of ``texts`` (its pieces, in order),
    each the tokens that spell that text; each text encoded when the tokens do not spell the
    texts joined or a piece ends inside a token. Without ``vocab``, empty lists."""
    if vocab is None:
        return [[] for _ in texts]
    whole = "".join(texts)
    if vocab.spell(tokens) != whole:
        return [vocab.encode(t) for t in texts]
    out: list[list[int]] = []
    k = 0
    done = 0  # characters of ``whole`` spelled by tokens[:k]
    for text in texts[:-1]:
        done += len(text)
        end = _prefix_end(tokens, k, whole[:done], vocab)
        if end is None:
            return [vocab.encode(t) for t in texts]
        out.append(list(tokens[k:end]))
        k = end
    out.append(list(tokens[k:]))
    return out


def _prefix_end(tokens: Sequence[int], start: int, target: str, vocab: Vocabulary) -> int | None:
    """The k >= ``start`` past which tokens[:k] spells ``target`` and the tokens after it spell
    nothing more (timestamp tokens); None when no prefix spells it."""
    found = None
    for k in range(start, len(tokens) + 1):
        spelled = vocab.spell(tokens[:k])
        if spelled == target:
            found = k
        elif found is not None or (len(spelled) > len(target) and not spelled.endswith(PARTIAL)):
            break
    return found


def joined(first: dict[str, Any], second: dict[str, Any], text: str, vocab: Vocabulary | None) -> list[int]:
    """The tokens of two segments joined into one of ``text``: theirs in order when they spell
    it, else ``text`` encoded (none without ``vocab``)."""
    tokens = [*first.get("tokens", []), *second.get("tokens", [])]
    if vocab is None:
        return []
    return tokens if vocab.spell(tokens) == text else vocab.encode(text)
