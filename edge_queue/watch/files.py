"""What a file in a watch folder is, by its name and content (docs/configuration.md,
"[[watch]]"): names that are never inputs, the content identity of a version, the file system
it is on, and whether another file beside it shares its stem. Plain functions over names and
files; no thread, no store.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
from collections import Counter
from pathlib import Path

#: Files up to this size (bytes) are identified by the SHA-256 of their whole content; larger
#: ones by the SHA-256 of their size and four 1 MiB blocks (start, thirds, end), so that a
#: recording of gigabytes is not read twice.
FULL_DIGEST_BYTES = 64 * 2**20
SAMPLE_BYTES = 2**20
#: Names that are never inputs: temporary and partial files of copy tools, browsers, office
#: suites and edge-queue's own atomic writes (``.<name>.<random>.part``).
TEMP_PATTERNS = ("*.part", "*.partial", "*.tmp", "*.temp", "*.crdownload", "*.download", "*.!qb", ".~*", "~$*")
#: Suffixes of edge-queue's own outputs (transcripts of ``transcribe``, ``<stem>.web.mp4`` of
#: ``transcode``): never inputs of a watch, whatever its ``include``. ``extract_audio``'s
#: ``<stem>.<format>`` beside the input is told apart by the store
#: (:meth:`edge_queue.watch.folders.WatchFolders._own_output`).
OUTPUT_SUFFIXES = (".srt", ".vtt", ".txt", ".tsv", ".json", ".web.mp4")
#: File system types whose changes made on other machines give no inotify events
#: (``/proc/self/mountinfo``): ``mode = "auto"`` polls them.
NETWORK_FS = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "afs", "ceph", "glusterfs", "lustre", "davfs", "ncpfs", "fuse.sshfs"}
)
NETWORK_FS_PREFIXES = ("fuse.sshfs", "fuse.rclone", "fuse.s3fs", "fuse.gcsfuse", "fuse.glusterfs", "fuse.davfs")


def skip_reason(name: str, include: list[str], exclude: list[str]) -> str | None:
    """Why a file named ``name`` is not an input of a watch with these patterns (``hidden``,
    ``temporary``, ``output``, ``not included``, ``excluded``), or ``None`` when it is one.
    Patterns are ``fnmatch`` patterns, matched case-insensitively against the name."""
    low = name.lower()
    if low.startswith("."):
        return "hidden"
    if any(fnmatch.fnmatchcase(low, p) for p in TEMP_PATTERNS):
        return "temporary"
    if low.endswith(OUTPUT_SUFFIXES):
        return "output"
    if not any(fnmatch.fnmatchcase(low, p.lower()) for p in include):
        return "not included"
    if any(fnmatch.fnmatchcase(low, p.lower()) for p in exclude):
        return "excluded"
    return None


def file_system_type(path: str) -> str | None:
    """The type of the file system holding ``path`` (``ext4``, ``nfs4``, ``cifs``...), from the
    longest mount point of ``/proc/self/mountinfo`` above it; ``None`` when unknown."""
    best, kind = "", None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                left, _, right = line.partition(" - ")
                fields, rest = left.split(), right.split()
                if len(fields) < 5 or not rest:
                    continue
                mount = fields[4].replace("\\040", " ")
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, rest[0]
    except OSError:
        return None
    return kind


def is_network_fs(fs_type: str | None) -> bool:
    return fs_type is not None and (fs_type in NETWORK_FS or fs_type.startswith(NETWORK_FS_PREFIXES))


def file_digest(path: str, size: int) -> str:
    """The content identity of a file of ``size`` bytes: ``sha256:<hex>`` of the whole file up
    to :data:`FULL_DIGEST_BYTES`, else ``sampled:<hex>`` of its size and four
    :data:`SAMPLE_BYTES` blocks. Raises ``OSError`` when the file cannot be read."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        if size <= FULL_DIGEST_BYTES:
            while chunk := fh.read(2**20):
                h.update(chunk)
            return "sha256:" + h.hexdigest()
        h.update(size.to_bytes(8, "big"))
        for offset in (0, size // 3, 2 * size // 3, size - SAMPLE_BYTES):
            fh.seek(offset)
            h.update(fh.read(SAMPLE_BYTES))
    return "sampled:" + h.hexdigest()


def in_watch(root: str, recursive: bool, path: str) -> bool:
    """``path`` is a file a watch of the folder ``root`` covers: directly in it, or (with
    ``recursive``) in a sub-folder that is not hidden."""
    if not path.startswith(root.rstrip("/") + "/"):
        return False
    rel = path[len(root.rstrip("/")) + 1 :].split("/")
    if len(rel) > 1 and not recursive:
        return False
    return not any(part.startswith(".") for part in rel[:-1])


def resolves_inside(root: str, folder: str) -> bool:
    """``folder`` (named under the watch folder ``root``, a real path) still resolves inside
    ``root``: False when a symbolic link was put in its place or a parent's, which may lead
    out of the media roots."""
    real = os.path.realpath(folder)
    return real == root or real.startswith(root.rstrip("/") + "/")


class FolderStems:
    """The stems of the files of each folder asked about, each folder listed once (one pass
    over the ready files): 10,000 files dropped at once cost one listing, not 10,000."""

    def __init__(self) -> None:
        self.folders: dict[str, Counter[str]] = {}

    def shares_stem(self, path: str) -> bool:
        """Another file in ``path``'s folder has a name that ``path``'s name starts with, up to
        a dot (``talk.mp4`` beside ``talk.wav``): ``path`` may be an output written beside it."""
        folder, name = os.path.split(path)
        stems = self.folders.get(folder)
        if stems is None:
            try:
                stems = Counter(Path(n).stem for n in os.listdir(folder))
            except OSError:
                stems = Counter()
            self.folders[folder] = stems
        own = Path(name).stem
        for i, ch in enumerate(name):
            if ch == "." and i > 0:
                prefix = name[:i]
                if stems[prefix] > (1 if prefix == own else 0):
                    return True
        return False
