"""Opening media with PyAV and turning its failures into the product's error codes.

Facts behind the mapping (measured, ``shared/media/README.md``): empty files, non-media and
an MP4 cut before its index raise ``av.error.InvalidDataError``; an MP4 cut very short raises
``av.error.EOFError``; a video without audio makes faster-whisper raise a bare ``IndexError``,
so the audio stream is looked up here first.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import ErrorCode, MediaError

#: FFmpeg demuxers that accept plain text files; their "media" is never what a user meant.
_TEXT_DEMUXERS = frozenset({"tty", "srt", "webvtt", "ass", "subviewer", "microdvd", "mpl2", "jacosub"})


@contextmanager
def open_media(path: str) -> Iterator[Any]:
    """``av.open(path)`` as a context manager.

    Raises :class:`MediaError` ``unsupported_media`` for a zero-length file or one that no
    demuxer accepts, and ``decode_error`` for other FFmpeg failures while opening.
    """
    import av  # heavy: loaded in the worker only

    if os.path.getsize(path) == 0:
        raise MediaError("the file is empty (0 bytes)", code=ErrorCode.UNSUPPORTED_MEDIA)
    try:
        container = av.open(path)
    except (av.error.InvalidDataError, av.error.EOFError) as e:
        raise MediaError(
            f"not a media file FFmpeg can read ({e.strerror or e})", code=ErrorCode.UNSUPPORTED_MEDIA
        ) from e
    except av.error.FFmpegError as e:
        raise MediaError(f"cannot open media ({e.strerror or e})", code=ErrorCode.DECODE_ERROR) from e
    try:
        if container.format.name in _TEXT_DEMUXERS:
            raise MediaError(
                f"not a media file (FFmpeg reads it as {container.format.name} text)", code=ErrorCode.UNSUPPORTED_MEDIA
            )
        yield container
    finally:
        container.close()


def container_duration_s(container: Any) -> float | None:
    """Duration in seconds from the container, else from the longest stream; ``None`` if unknown."""
    if container.duration is not None:
        return float(container.duration) / 1_000_000  # AV_TIME_BASE
    best = None
    for s in container.streams:
        if s.duration is not None and s.time_base is not None:
            d = float(s.duration * s.time_base)
            best = d if best is None else max(best, d)
    return best


def end_of_input(frames: Iterator[Any]) -> Iterator[Any]:
    """Decoded frames, then ``None`` once. A cut or damaged file ends the stream quietly
    (check with :func:`truncated`); other FFmpeg errors raise ``decode_error``."""
    import av

    try:
        yield from frames
    except (av.error.InvalidDataError, av.error.EOFError):
        pass
    except av.error.FFmpegError as e:
        raise MediaError(f"cannot decode: {e}", code=ErrorCode.DECODE_ERROR) from e
    yield None


def truncated(decoded_s: float, declared_s: float | None) -> None:
    """Raise ``truncated_media`` when decoding stopped well short of the declared duration
    (below 90 % and more than 1 s short; 1 s covers the last frame's own length)."""
    if declared_s and decoded_s < 0.9 * declared_s and declared_s - decoded_s > 1.0:
        raise MediaError(f"decoded {decoded_s:.1f} s of a declared {declared_s:.1f} s", code=ErrorCode.TRUNCATED_MEDIA)


def finish_output(tmp: Any, target: Any, *, overwrite: bool, decoded_s: float, declared_s: float | None) -> float:
    """Check the encode covered the input (:func:`truncated`), move ``tmp`` into place
    atomically, and return the output's duration in seconds as read back from it."""
    from .base import publish_file

    truncated(decoded_s, declared_s)
    publish_file(tmp, target, overwrite=overwrite)
    with open_media(str(target)) as check:
        return round(container_duration_s(check) or 0.0, 3)


def require_audio(container: Any) -> Any:
    """The first audio stream. Raises :class:`MediaError` ``no_audio_stream`` when there is none."""
    if not container.streams.audio:
        raise MediaError("the file has no audio stream", code=ErrorCode.NO_AUDIO_STREAM)
    return container.streams.audio[0]


def describe(path: str) -> dict[str, Any]:
    """Container and stream facts: the ``probe`` result.

    Returns ``{"container", "duration_s", "bit_rate", "size_bytes", "streams": [...]}``; each
    stream has ``index``, ``type``, ``codec``, ``bit_rate``, ``duration_s`` and, for audio,
    ``sample_rate``/``channels``/``layout``, for video ``width``/``height``/``fps``/``pix_fmt``.
    """
    with open_media(path) as c:
        streams = []
        for s in c.streams:
            cc = s.codec_context
            info: dict[str, Any] = {
                "index": s.index,
                "type": s.type,
                "codec": cc.name if cc is not None else None,
                "bit_rate": s.bit_rate or (cc.bit_rate if cc is not None else None),
                "duration_s": float(s.duration * s.time_base) if s.duration and s.time_base else None,
                "language": s.metadata.get("language"),
            }
            if s.type == "audio":
                info.update(
                    sample_rate=cc.sample_rate, channels=cc.channels, layout=cc.layout.name if cc.layout else None
                )
            elif s.type == "video":
                rate = s.average_rate or s.guessed_rate
                info.update(
                    width=cc.width, height=cc.height, fps=round(float(rate), 3) if rate else None, pix_fmt=cc.pix_fmt
                )
            streams.append(info)
        return {
            "container": c.format.name,
            "duration_s": container_duration_s(c),
            "bit_rate": c.bit_rate or None,
            "size_bytes": os.path.getsize(path),
            "streams": streams,
        }
