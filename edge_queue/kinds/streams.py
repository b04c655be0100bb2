"""What each stream of a media file is, and which ones a player would play.

A file carries more than its content. Cover art (ID3 ``APIC`` in mp3, ``covr`` in mp4 and m4a,
a ``PICTURE`` block in flac, a ``cover.jpg`` attachment in Matroska) reaches PyAV as a video
stream of one picture flagged ``attached_pic``; a picture may also sit in a plain video track
of one frame; cameras add timecode (``tmcd``) data tracks, drones KLV timed metadata; a film
may have several audio tracks of which one is the default, and commentary or audio
description beside it.

The kinds use what a player plays, by FFmpeg's rules (``av_find_best_stream`` in
libavformat/avformat.c and the stream selection of ``ffmpeg`` in fftools/ffmpeg_mux_init.c):
for audio, the track flagged ``default``, else one that is not commentary or description,
else the first; for video, never an attached picture, and among the real videos the default,
else the first. A video track of one frame is a picture here too (ffmpeg would make it a
one-frame video; a player shows it as the cover).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: Every role a stream can have in ``probe``'s result (docs/topics.md, "`probe`").
ROLES = ("audio", "video", "cover", "thumbnail", "still", "subtitle", "data", "metadata", "attachment")
#: FFmpeg's codecs of timed metadata carried in data streams: KLV (SMPTE 336M, drones and
#: surveillance) and ID3 tags timed with the media (HLS, MPEG-TS).
METADATA_CODECS = frozenset({"klv", "timed_id3"})
#: Dispositions of an audio track that is not the programme itself: commentary, audio
#: description, the tracks for hearing- or visually-impaired viewers.
ASIDE = ("comment", "descriptions", "hearing_impaired", "visual_impaired")


def disposition_names(stream: Any) -> list[str]:
    """The names of the disposition flags set on ``stream`` (FFmpeg's names, as PyAV's
    ``av.stream.Disposition`` has them: ``default``, ``attached_pic``, ``comment``...)."""
    import av

    flags = int(stream.disposition)
    return [name for name, flag in av.stream.Disposition.__members__.items() if int(flag) and flags & int(flag)]


def role(stream: Any, frames: int | None) -> str:
    """What ``stream`` is (one of :data:`ROLES`). ``frames``: how many frames a video stream
    holds, as far as known (the container's count, or packets counted up to 2; ``None`` when
    unknown): a video of one frame is a ``still``."""
    names = disposition_names(stream)
    if stream.type == "video":
        if "attached_pic" in names:
            return "cover"
        if "timed_thumbnails" in names:
            return "thumbnail"
        if "still_image" in names or (frames is not None and frames <= 1):
            return "still"
        return "video"
    if stream.type == "data":
        name = getattr(stream, "name", None)
        return "metadata" if "metadata" in names or name in METADATA_CODECS else "data"
    return str(stream.type)


def best_audio(streams: Sequence[Any], languages: Sequence[str] = ()) -> Any | None:
    """The audio stream a player plays among ``streams`` (``None`` without audio): a track
    that can be decoded (it declares channels and a sample rate) before one that cannot; then,
    with ``languages`` (ISO 639 codes, most wanted first), the track whose language tag comes
    first in them (:func:`~.library.language_rank`); then the ``default`` one; then one that is
    not :data:`ASIDE`; then the first."""
    from .library import language_rank

    audio = [s for s in streams if s.type == "audio"]
    if not audio:
        return None
    wanted = list(languages)

    def rank(s: Any) -> tuple[bool, int, bool, bool, int]:
        names = disposition_names(s)
        cc = s.codec_context
        decodable = cc is not None and bool(cc.channels) and bool(cc.sample_rate)
        by_language = language_rank(s.metadata.get("language"), wanted)
        return (not decodable, by_language, "default" not in names, any(n in names for n in ASIDE), s.index)

    return min(audio, key=rank)


def count_frames(container: Any, streams: list[Any], most: int = 2) -> dict[int, int]:
    """Packets (frames) of each of ``streams``, counted up to ``most``: stream index -> count.
    Reads the container's packets from where it stands, in one pass, and stops as soon as each
    stream has ``most``: a real video is told after its first packets, a picture track at the
    end of the file (demuxing only, nothing is decoded). A damaged file ends the count where it
    breaks."""
    import av

    counts = {s.index: 0 for s in streams}
    if not streams:
        return counts
    try:
        for packet in container.demux(*streams):
            if packet.size and packet.stream.index in counts:
                counts[packet.stream.index] += 1
                if all(n >= most for n in counts.values()):
                    break
    except av.error.FFmpegError:
        pass  # what counted so far is what the file holds
    return counts


@dataclass(frozen=True, slots=True)
class Layout:
    """The streams of a file as the kinds see them: each one's role (by index), the audio and
    the video stream a player plays (indexes; ``None`` when there is none)."""

    roles: tuple[str, ...]
    audio: int | None
    video: int | None

    def uses(self) -> dict[str, list[int]]:
        """The streams each built-in media kind reads: kind -> stream indexes."""
        audio = [] if self.audio is None else [self.audio]
        video = [] if self.video is None else [self.video]
        return {"transcribe": audio, "extract_audio": audio, "transcode": video + audio}


def layout(container: Any) -> Layout:
    """Each stream's role and the streams a player plays (:class:`Layout`). A video stream
    whose frame count the container does not declare (Matroska, MPEG-TS) is counted with
    :func:`count_frames`, which moves the container's read position: decode from a container
    opened anew."""
    streams = list(container.streams)
    known = {s.index: s.frames for s in streams if s.type == "video" and s.frames}
    unknown = [s for s in streams if s.type == "video" and not s.frames and not _flagged_picture(s)]
    known.update(count_frames(container, unknown))
    roles = tuple(role(s, known.get(s.index)) for s in streams)
    audio = best_audio(streams)
    videos = [s for s in streams if roles[s.index] == "video"]
    video = min(videos, key=lambda s: ("default" not in disposition_names(s), s.index)) if videos else None
    return Layout(roles, None if audio is None else audio.index, None if video is None else video.index)


def _flagged_picture(stream: Any) -> bool:
    return bool({"attached_pic", "timed_thumbnails", "still_image"} & set(disposition_names(stream)))
