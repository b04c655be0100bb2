"""Opening media with PyAV and turning its failures into the product's error codes.

Facts behind the mapping (measured on real and damaged files; the codes are
those of docs/topics.md, "Error codes"): empty files, non-media and
an MP4 cut before its index raise ``av.error.InvalidDataError``; an MP4 cut very short raises
``av.error.EOFError``; a video without audio makes faster-whisper raise a bare ``IndexError``,
so the audio stream is looked up here first.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

from edge_queue.errors import ErrorCode, JobError, MediaError

#: FFmpeg demuxers of single media files: the only ones FFmpeg may use to open an input
#: (``format_whitelist``). Formats that pull in other files or URLs (HLS and DASH playlists,
#: concat lists, image sequences, SDP, tee...) and text formats are left out, so FFmpeg never
#: follows a reference out of the file, whatever the file claims to be. Names as FFmpeg's
#: ``ffmpeg -demuxers`` lists them; a demuxer with several names ("mov,mp4,m4a,...") matches
#: any of them.
SINGLE_FILE_DEMUXERS: tuple[str, ...] = (
    "aac", "ac3", "aiff", "amr", "ape", "asf", "au", "avi", "caf", "dsf", "dts", "dtshd", "dv",
    "eac3", "flac", "flv", "gsm", "iff", "loas", "matroska", "mlp", "mov", "mp3", "mpc", "mpc8",
    "mpeg", "mpegts", "mxf", "nut", "ogg", "rm", "shn", "tak", "truehd", "tta", "voc", "w64",
    "wav", "wtv", "wv",
)  # fmt: skip
_FFMPEG_OPTIONS = {"format_whitelist": ",".join(SINGLE_FILE_DEMUXERS), "protocol_whitelist": "file"}

#: The media roots inputs must stay in when they are opened (:func:`confine_inputs`); ``None``
#: until the worker process sets them.
_roots: tuple[Path, ...] | None = None
#: The input of the attempt this worker process runs, opened once (:func:`held_input`):
#: ``(path, descriptor)``; ``None`` between attempts.
_held: tuple[str, int] | None = None


def confine_inputs(media_roots: list[Path]) -> None:
    """Make every later :func:`open_media` of an input check, on the opened file itself, that
    it lies inside ``media_roots`` (called once by each worker process at its start)."""
    global _roots
    _roots = tuple(Path(os.path.realpath(r)) for r in media_roots)


def _kind_of(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


@contextmanager
def held_input(path: str) -> Iterator[int]:
    """Open an attempt's input once, for the whole attempt (the worker, around a kind's
    ``run``): checked on the descriptor as :func:`_open_input` says, and yielded. Until the block
    ends, every :func:`open_media` and :func:`input_descriptor` of ``path`` reads this very file
    (a duplicate of the descriptor), never the path again: a FIFO, a link or another file put
    at the path once the attempt started is never opened, and hashing, the choice of the track
    and decoding all read the same file. Raises as :func:`_open_input`."""
    global _held
    fd, _ = _open_input(path, confined=True)
    _held = (path, fd)
    try:
        yield fd
    finally:
        _held = None
        os.close(fd)


@contextmanager
def input_descriptor(path: str, *, confined: bool = True) -> Iterator[int]:
    """A descriptor of the input ``path`` opened and checked as :func:`open_media` opens it
    (the held input's own file during an attempt, :func:`held_input`), closed after the
    block. For reading it without FFmpeg (``os.pread``, ``os.fstat``)."""
    fd, _ = _open_input(path, confined)
    try:
        yield fd
    finally:
        os.close(fd)


def _open_input(path: str, confined: bool) -> tuple[int, int]:
    """Open ``path`` for reading as the worker sees it now: ``(descriptor, size in bytes)``;
    during an attempt whose input is ``path``, a duplicate of the descriptor opened at its
    start (:func:`held_input`), not the path again.

    The file is opened first (without blocking, so a FIFO cannot hold the worker) and checked
    after, on the descriptor: it must be a regular file and, when ``confined``, the file it
    really is (``/proc/self/fd``, whatever links led there) must lie inside the media roots. A
    link or FIFO swapped in after the submit's checks is caught here, and so is a link to a file
    whose real path is not UTF-8 text. Raises
    :class:`MediaError` ``input_not_found`` or ``input_outside_media_roots``.

    ``O_NOFOLLOW`` is not used: a link inside the media roots is a valid input (a library of
    links), and where a link leads is checked on the descriptor (its real path).
    """
    if _held is not None and path == _held[0]:
        fd = os.dup(_held[1])
        return fd, os.fstat(fd).st_size
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as e:
        raise MediaError(f"cannot open {path}: {e.strerror}", code=ErrorCode.INPUT_NOT_FOUND) from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise MediaError(f"{path} is {_kind_of(st.st_mode)}, not a regular file", code=ErrorCode.INPUT_NOT_FOUND)
        if confined and _roots is not None:
            real = Path(os.readlink(f"/proc/self/fd/{fd}"))
            if not any(real == r or real.is_relative_to(r) for r in _roots):
                # the target is not named: it is outside what the submitter may see
                raise MediaError(
                    f"{path} now leads outside media_roots (a link replaced it after the submit)",
                    code=ErrorCode.INPUT_OUTSIDE_MEDIA_ROOTS,
                )
            try:
                str(real).encode()
            except UnicodeEncodeError:  # the submit's rule (docs/topics.md, "`submit`", Inputs)
                raise MediaError(
                    f"{path} now leads to a file whose path is not UTF-8 text (a link replaced it after the submit)",
                    code=ErrorCode.INPUT_NOT_FOUND,
                ) from None
        return fd, st.st_size
    except BaseException:
        os.close(fd)
        raise


@contextmanager
def open_media(path: str, *, confined: bool = True) -> Iterator[Any]:
    """Open a media file with PyAV, as a context manager yielding the input container.

    The file is opened and checked by :func:`_open_input` (a regular file; with ``confined``,
    inside the media roots set by :func:`confine_inputs`), then FFmpeg reads that very file
    (``/proc/self/fd/<n>``) with only the demuxers of :data:`SINGLE_FILE_DEMUXERS` and the
    ``file`` protocol. ``confined=False`` is for edge-queue's own outputs.

    Raises :class:`MediaError`: ``input_not_found`` / ``input_outside_media_roots`` (above),
    ``unsupported_media`` for an empty file, one no allowed demuxer accepts (a playlist, a
    list, text), and ``decode_error`` for other FFmpeg failures while opening.
    """
    import av  # heavy: loaded in the worker only

    fd, size = _open_input(path, confined)
    try:
        if size == 0:
            raise MediaError("the file is empty (0 bytes)", code=ErrorCode.UNSUPPORTED_MEDIA)
        if (cut := wav_shortfall(fd, size)) is not None:
            raise MediaError(
                f"a WAV file cut short: its header declares {cut[0]:.1f} s of audio, the file holds {cut[1]:.1f} s",
                code=ErrorCode.TRUNCATED_MEDIA,
            )
        try:
            container = av.open(f"/proc/self/fd/{fd}", options=dict(_FFMPEG_OPTIONS))
        except (av.error.InvalidDataError, av.error.EOFError) as e:
            raise MediaError(
                f"not a media file FFmpeg can read ({e.strerror or e})", code=ErrorCode.UNSUPPORTED_MEDIA
            ) from e
        except av.error.FFmpegError as e:
            if e.errno == errno.EINVAL:  # format_whitelist refused the demuxer FFmpeg found
                raise MediaError(
                    "not a single media file: playlists, lists, image sequences and text are not opened "
                    "(edge-queue reads audio and video files only)",
                    code=ErrorCode.UNSUPPORTED_MEDIA,
                ) from e
            raise MediaError(f"cannot open media ({e.strerror or e})", code=ErrorCode.DECODE_ERROR) from e
        try:
            yield container
        finally:
            container.close()
    finally:
        os.close(fd)


def wav_shortfall(fd: int, size: int) -> tuple[float, float] | None:
    """``(declared s, present s)`` of a RIFF/WAVE file (read through ``fd``, ``size`` bytes)
    whose ``data`` chunk declares clearly more audio than the file holds (more than 10 % and
    more than 1 s missing), else ``None``. FFmpeg's WAV demuxer takes such a file's length from
    its size, so the cut goes unnoticed by the duration check of the decoders. A ``data`` size
    of 0 or 0xFFFFFFFF (a recorder that streamed the file without knowing its length) is not a
    declaration. Chunk layout: the RIFF/WAVE format (Microsoft, 1991), ``fmt `` byte rate at
    offset 8 of its chunk."""
    try:
        head = os.pread(fd, 4096, 0)
    except OSError:
        return None
    if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return None
    pos, byte_rate = 12, 0
    while pos + 8 <= len(head):
        chunk, length = head[pos : pos + 4], int.from_bytes(head[pos + 4 : pos + 8], "little")
        if chunk == b"fmt " and pos + 20 <= len(head):
            byte_rate = int.from_bytes(head[pos + 16 : pos + 20], "little")
        elif chunk == b"data":
            if not byte_rate or length in (0, 0xFFFFFFFF):
                return None
            present = max(0, size - (pos + 8))
            missing = length - present
            if missing > 0.1 * length and missing > byte_rate:
                return length / byte_rate, present / byte_rate
            return None
        pos += 8 + length + (length & 1)
    return None


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


def finish_output(
    ctx: Any, tmp: Any, target: Any, *, overwrite: bool, decoded_s: float, declared_s: float | None
) -> float:
    """Check the encode covered the input (:func:`truncated`), move ``tmp`` into place
    atomically, recorded first as the job's (:func:`.outputs.publish_set`), and return the
    output's duration in seconds as read back from it."""
    from .outputs import publish_set

    truncated(decoded_s, declared_s)
    publish_set(ctx, {target: tmp}, overwrite=overwrite)
    with open_media(str(target), confined=False) as check:
        return round(container_duration_s(check) or 0.0, 3)


@cache
def encoder_rates(codec: str) -> tuple[int, ...] | None:
    """The sample rates (Hz, ascending) the FFmpeg encoder ``codec`` takes, as PyAV reports
    them (``av.Codec(codec, "w").audio_rates``); ``None`` when it takes any rate. Imports
    PyAV: the service calls it only for an option that needs it."""
    import av

    rates = av.Codec(codec, "w").audio_rates
    return tuple(sorted(rates)) if rates else None


def pick_rate(codec: str, source_hz: int | None, default_hz: int = 48000) -> int:
    """The sample rate (Hz) to encode a source of ``source_hz`` with ``codec`` when no rate was
    asked for: the source's when the encoder takes it, else the lowest rate it takes above the
    source's (no detail is lost), else its highest (a 96 kHz source becomes 48 kHz for mp3)."""
    source = source_hz or default_hz
    rates = encoder_rates(codec)
    if rates is None or source in rates:
        return source
    return next((r for r in rates if r > source), rates[-1])


def refused_by_encoder(error: BaseException) -> bool:
    """True when an FFmpeg error means the encoder (or the converter feeding it) cannot do
    the settings it was given: invalid argument, not implemented, out of range. The same
    settings fail the same way on every attempt, so no retry can help."""
    import av

    if isinstance(
        error,
        (
            av.error.ArgumentError,
            av.error.PatchWelcomeError,
            av.error.OptionNotFoundError,
            av.error.EncoderNotFoundError,
            av.error.ExperimentalError,
            av.error.NotImplementedError,
        ),
    ):
        return True
    return isinstance(error, av.error.FFmpegError) and getattr(error, "errno", None) in (
        errno.EINVAL,
        errno.ENOSYS,
        errno.EDOM,
        errno.ERANGE,
    )


@contextmanager
def encoder_errors(settings: str) -> Iterator[None]:
    """Turn an encoder's refusal of its settings (:func:`refused_by_encoder`) inside the block
    into :class:`~edge_queue.errors.JobError` ``invalid_request`` (not retried), with a plain
    message naming ``settings`` (e.g. ``"mp3 (libmp3lame) at 96000 Hz, 2 channels"``) and
    FFmpeg's reason, never its internals. Other errors pass through unchanged (a full disk
    stays what it is)."""
    try:
        yield
    except Exception as e:
        if not refused_by_encoder(e):
            raise
        reason = getattr(e, "strerror", None) or type(e).__name__
        raise JobError(
            f"the encoder refused {settings} ({reason}); the same settings fail on every attempt",
            code=ErrorCode.INVALID_REQUEST,
        ) from e


def require_audio(container: Any, languages: Sequence[str] = ()) -> Any:
    """The audio stream a player plays (:func:`~.streams.best_audio`: the default track, not
    the first one found), or the first of ``languages`` (ISO 639 codes) by its language tag.
    Raises :class:`MediaError` ``no_audio_stream`` when there is none."""
    from .streams import best_audio

    stream = best_audio(container.streams, languages)
    if stream is None:
        raise MediaError("the file has no audio stream", code=ErrorCode.NO_AUDIO_STREAM)
    return stream


def describe(path: str) -> dict[str, Any]:
    """Container and stream facts: the ``probe`` result.

    Returns ``{"container", "duration_s", "bit_rate", "size_bytes", "streams": [...],
    "audio_stream", "video_stream", "uses"}``; each stream has ``index``, ``type``, ``role``
    (:data:`~.streams.ROLES`), ``default``, ``disposition`` (flag names), ``codec``,
    ``bit_rate``, ``duration_s``, ``language`` and, for audio,
    ``sample_rate``/``channels``/``layout``, for video ``width``/``height``/``fps``/``pix_fmt``
    (``fps`` ``None`` for a picture). ``audio_stream`` and ``video_stream`` are the indexes of
    the streams a player plays, ``uses`` the streams each media kind reads.
    """
    from .streams import disposition_names, layout

    with open_media(path) as c:
        streams = []
        for s in c.streams:
            cc = s.codec_context
            flags = disposition_names(s)
            bit_rate = getattr(s, "bit_rate", None)  # data and attachment streams have none
            info: dict[str, Any] = {
                "index": s.index,
                "type": s.type,
                "role": s.type,
                "default": "default" in flags,
                "disposition": flags,
                "codec": cc.name if cc is not None else getattr(s, "name", None),
                "bit_rate": bit_rate or (cc.bit_rate if cc is not None else None),
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
        facts = {
            "container": c.format.name,
            "duration_s": container_duration_s(c),
            "bit_rate": c.bit_rate or None,
            "size_bytes": c.size,
        }
        seen = layout(c)  # last: it may read the file's packets
    for info in streams:
        info["role"] = seen.roles[info["index"]]
        if info["type"] == "video" and info["role"] != "video":
            info["fps"] = None  # a picture has no frame rate (FFmpeg guesses its time base)
    return {**facts, "streams": streams, "audio_stream": seen.audio, "video_stream": seen.video, "uses": seen.uses()}
