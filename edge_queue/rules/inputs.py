"""Inputs of jobs: a path from a client, resolved and confined to the media roots, checked to
be one regular file that is not a playlist (docs/topics.md, "`submit`").
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from edge_queue.errors import ErrorCode, InputError

#: The variable edge-queue's own images set (container/Containerfile, the add-on's Dockerfile):
#: the service sees the container's paths. (``/.dockerenv`` is no such mark: a development box
#: that is itself a container has it, and sees its own paths.)
CONTAINER_MARK = "EDGE_QUEUE_IN_CONTAINER"


def roots_text(media_roots: list[Path]) -> str:
    """The media roots as one short text for messages: ``/srv/media, /mnt/rec`` or ``none
    configured``."""
    return ", ".join(str(r) for r in media_roots) or "none configured"


def in_container() -> bool:
    """True in edge-queue's own image (:data:`CONTAINER_MARK` set to ``1``): the service sees
    the container's paths, not the box's."""
    return os.environ.get(CONTAINER_MARK) == "1"


def outside_hint(media_roots: list[Path]) -> str:
    """What to do about a path outside ``media_roots``: in a container, send the path as the
    container sees it (a folder of the box is mounted at a media root); elsewhere, the
    configuration sets the roots."""
    if in_container():
        first = str(media_roots[0]) if media_roots else "/media"
        return (
            "edge-queue runs in a container and sees the container's paths: send the path as the container "
            f"sees it (a file of the folder mounted at {first} is {first.rstrip('/')}/...), not the box's"
        )
    return "the service's configuration sets them (media_roots, or --media-root of edge-queue up/serve)"


def check_input(raw: str, media_roots: list[Path], data_dir: Path | None = None) -> str:
    """Resolve ``raw`` (symlinks, ``..``) and confine it to ``media_roots`` (docs/topics.md, "`submit`").

    ``data_dir``: the service's own folder, whose files are never inputs even inside a media
    root (the store, its journal and lock), but for ``<data_dir>/outputs`` (what jobs wrote,
    which every user may read with ``get`` anyway; a transcode's output may be probed).

    Returns the resolved absolute path. Raises :class:`InputError` with
    ``input_outside_media_roots`` (relative path, outside every root, or inside ``data_dir`` but
    not its ``outputs``; checked first, so the answer does not reveal which files exist outside
    the roots) or ``input_not_found``
    (missing, not a regular file, a real path that is not UTF-8 text, or any other error of
    the file system: a name too long, a folder the service may not enter).
    """
    where = roots_text(media_roots)
    if "\x00" in raw or not os.path.isabs(raw):
        raise InputError(
            f"input must be an absolute path inside media_roots ({where}): {raw[:200]!r}",
            code=ErrorCode.INPUT_OUTSIDE_MEDIA_ROOTS,
            field="input",
        )
    resolved = Path(os.path.realpath(raw))
    roots = [Path(os.path.realpath(r)) for r in media_roots]
    if not any(resolved == r or resolved.is_relative_to(r) for r in roots):
        raise InputError(
            f"{raw[:200]} is outside media_roots ({where}); {outside_hint(media_roots)}",
            code=ErrorCode.INPUT_OUTSIDE_MEDIA_ROOTS,
            field="input",
        )
    if data_dir is not None:
        own, outputs = Path(os.path.realpath(data_dir)), Path(os.path.realpath(data_dir / "outputs"))
        if (resolved == own or resolved.is_relative_to(own)) and not resolved.is_relative_to(outputs):
            raise InputError(
                f"{raw[:200]} is inside edge-queue's own data_dir, whose files (the store, its journal and lock) "
                "are never inputs",
                code=ErrorCode.INPUT_OUTSIDE_MEDIA_ROOTS,
                field="input",
            )
    try:
        str(resolved).encode()
    except UnicodeEncodeError:
        # a link to a file or folder whose name is not UTF-8: the store, the job object and
        # MQTT carry text only (docs/topics.md, "`submit`")
        raise InputError(
            f"{raw[:200]} leads to a file whose path is not UTF-8 text; rename the file or folder "
            "(or link to it under a UTF-8 name: links are followed to the real path)",
            code=ErrorCode.INPUT_NOT_FOUND,
            field="input",
        ) from None
    try:
        is_file = stat.S_ISREG(os.stat(resolved).st_mode)
    except OSError as e:  # missing, a name too long, a folder the service may not enter, ...
        reason = f" ({os.strerror(e.errno).lower()})" if e.errno else ""
        raise InputError(
            f"{raw[:200]} does not exist, is not a file, or is not readable by the service{reason}",
            code=ErrorCode.INPUT_NOT_FOUND,
            field="input",
        ) from None
    if not is_file:
        raise InputError(
            f"{raw[:200]} does not exist, is not a file, or is not readable by the service",
            code=ErrorCode.INPUT_NOT_FOUND,
            field="input",
        )
    if (what := refers_to_other_files(resolved)) is not None:
        raise InputError(
            f"{raw[:200]} is {what}, which refers to other files: edge-queue opens single audio and video files only",
            code=ErrorCode.UNSUPPORTED_MEDIA,
            field="input",
        )
    return str(resolved)


#: Suffixes of playlists and lists that name other files or URLs (docs/topics.md, "`submit`").
_LIST_SUFFIXES = {
    ".m3u": "a playlist",
    ".m3u8": "an HLS playlist",
    ".pls": "a playlist",
    ".xspf": "a playlist",
    ".asx": "a playlist",
    ".wpl": "a playlist",
    ".mpd": "a DASH manifest",
    ".ffconcat": "an FFmpeg concat list",
    ".concat": "an FFmpeg concat list",
    ".sdp": "an SDP session description",
}
#: How such files start, whatever their name.
_LIST_MAGIC = (
    (b"#EXTM3U", "an HLS or M3U playlist"),
    (b"ffconcat version", "an FFmpeg concat list"),
    (b"[playlist]", "a playlist"),
    (b"v=0", "an SDP session description"),
)


def refers_to_other_files(path: Path) -> str | None:
    """What ``path`` is when it is a playlist, list or manifest that names other files or URLs
    (by its suffix, or by its first bytes), else ``None``. The worker's FFmpeg cannot open such
    files anyway (:data:`~edge_queue.kinds.media.SINGLE_FILE_DEMUXERS`); this refuses them at
    submit with a clear message."""
    if (what := _LIST_SUFFIXES.get(path.suffix.lower())) is not None:
        return what
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None  # the worker reports what it finds
    try:
        head = os.read(fd, 512).lstrip(b"\xef\xbb\xbf \t\r\n")
    except OSError:
        return None
    finally:
        os.close(fd)
    for magic, what in _LIST_MAGIC:
        if head.startswith(magic):
            return what
    if head.startswith(b"<") and (b"<MPD" in head or b"<smil" in head.lower()):
        return "an XML manifest"
    return None
