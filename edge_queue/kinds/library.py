"""What a media library already has, and how it names what it gets (docs/topics.md, "Media
libraries"): the rules a ``transcribe`` job follows for a film or an episode of a Jellyfin,
Plex or Emby library. Plain functions; languages by ISO 639 (pycountry's tables).

- A subtitle in a language is **beside** a recording when a file of its folder is named
  ``<stem>.<tags>.<srt|vtt|ass|ssa|sub|sup|smi>`` with one tag naming the language
  (``film.en.srt``, ``film.eng.forced.srt``, ``film.ger.sdh.ass``), as Jellyfin, Plex and Emby
  read them; it is **embedded** when a subtitle stream of the file is tagged with the
  language. A forced subtitle (the ``forced`` tag, or the stream's ``forced`` disposition)
  shows only foreign lines and does not count.
- A language is named in an output's name with its two-letter code (``film.en.srt``) or its
  three-letter bibliographic one (``film.ger.srt``), as ``language_tag`` says.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

#: Suffixes of subtitle files the media servers read beside a recording.
SUBTITLE_SUFFIXES = frozenset({"srt", "vtt", "ass", "ssa", "sub", "sup", "smi"})
#: Names in a folder looked at, at most (a folder of a film holds a few dozen).
MAX_NAMES = 10_000
#: Bytes of a subtitle file read to tell it holds something (:func:`has_content`).
CONTENT_BYTES = 4096
#: UTF-8, UTF-16 LE and BE byte-order marks: no content of their own.
BYTE_ORDER_MARKS = (b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")

Tag = Literal["alpha2", "alpha3"]


def language_codes(code: str) -> frozenset[str]:
    """Every ISO 639 code of the language ``code`` names: its two-letter code, its
    three-letter terminology and bibliographic codes (``de`` -> ``{de, deu, ger}``); the code
    itself, lower case, when pycountry does not know it (Whisper's ``jw``, ``haw``)."""
    import pycountry

    code = code.strip().lower()
    found = pycountry.languages.get(alpha_2=code) if len(code) == 2 else pycountry.languages.get(alpha_3=code)
    if found is None and len(code) == 3:
        found = next((lang for lang in pycountry.languages if getattr(lang, "bibliographic", None) == code), None)
    if found is None:
        return frozenset({code})
    names = {getattr(found, key, None) for key in ("alpha_2", "alpha_3", "bibliographic")}
    return frozenset(n.lower() for n in names if n) | {code}


def language_tag(code: str, style: Tag) -> str:
    """The language ``code`` as an output's name carries it: ``alpha2`` (``en``) or ``alpha3``
    (the bibliographic code FFmpeg and Bazarr use, ``ger``; the terminology one otherwise).
    A code with no such form is kept as it is."""
    import pycountry

    found = pycountry.languages.get(alpha_2=code) if len(code) == 2 else pycountry.languages.get(alpha_3=code)
    if found is None:
        return code
    if style == "alpha2":
        return str(getattr(found, "alpha_2", code))
    return str(getattr(found, "bibliographic", None) or found.alpha_3)


def subtitle_beside(input_path: str, language: str) -> str | None:
    """The path of a subtitle file in ``language`` beside ``input_path`` that is not forced
    (the first by name when there are several), or None (docs/topics.md, "Media libraries").
    An empty or unreadable file is no subtitle (:func:`has_content`). At most
    :data:`MAX_NAMES` names of the folder are looked at."""
    folder, stem = os.path.dirname(input_path) or ".", Path(input_path).stem
    codes = language_codes(language)
    found: list[str] = []
    try:
        with os.scandir(folder) as entries:
            for n, entry in enumerate(entries):
                if n >= MAX_NAMES:
                    break
                name = entry.name
                if not name.startswith(stem + ".") or name == os.path.basename(input_path):
                    continue
                parts = name[len(stem) + 1 :].lower().split(".")
                if len(parts) < 2 or parts[-1] not in SUBTITLE_SUFFIXES:
                    continue
                tags = set(parts[:-1])
                if "forced" not in tags and tags & codes and has_content(entry.path):
                    found.append(entry.path)
    except OSError:
        return None
    return min(found) if found else None


def has_content(path: str) -> bool:
    """True when ``path`` is a regular file this process can read whose first
    :data:`CONTENT_BYTES` bytes hold more than white space, byte-order marks and NULs: a
    subtitle a player can show something of. Opened without blocking (a FIFO is not waited
    on) and checked on the descriptor."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        head = os.pread(fd, CONTENT_BYTES, 0)
    except OSError:
        return False
    finally:
        os.close(fd)
    for mark in BYTE_ORDER_MARKS:
        head = head.replace(mark, b"")
    return bool(head.strip(b" \t\r\n\x00"))


def subtitle_streams(container: Any) -> list[dict[str, Any]]:
    """The subtitle streams of an open PyAV ``container``: ``{"index", "language", "forced",
    "codec"}`` each (``language`` lower case, or None when untagged)."""
    import av

    forced = int(av.stream.Disposition.forced)
    out = []
    for s in container.streams:
        if s.type != "subtitle":
            continue
        lang = s.metadata.get("language")
        out.append(
            {
                "index": s.index,
                "language": lang.lower() if isinstance(lang, str) else None,
                "forced": bool(int(s.disposition) & forced),
                "codec": getattr(s.codec_context, "name", None) if s.codec_context is not None else None,
            }
        )
    return out


def existing_subtitle(input_path: str, language: str, embedded: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """What already gives ``input_path`` subtitles in ``language``: ``{"reason":
    "subtitle_beside", "existing": <path>}`` or ``{"reason": "subtitle_embedded", "existing":
    "stream <index> (<codec>, <language>)"}``, or None. ``embedded``: :func:`subtitle_streams`."""
    codes = language_codes(language)
    for s in embedded:
        if s["language"] in codes and not s["forced"]:
            return {"reason": "subtitle_embedded", "existing": f"stream {s['index']} ({s['codec']}, {s['language']})"}
    if (path := subtitle_beside(input_path, language)) is not None:
        return {"reason": "subtitle_beside", "existing": path}
    return None


def language_rank(stream_language: Any, preferred: list[str]) -> int:
    """The place of a stream's language tag in ``preferred`` (ISO 639 codes, any form), or
    ``len(preferred)`` when it is not there or untagged."""
    if not isinstance(stream_language, str) or not preferred:
        return len(preferred)
    tag = stream_language.lower()
    for i, code in enumerate(preferred):
        if tag in language_codes(code):
            return i
    return len(preferred)
