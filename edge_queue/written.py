"""Files the service's own workers wrote: what identifies each one, and reading one back.

When a job's worker writes an output it records the file's identity (its size in bytes and the
SHA-256 of its content) in the store before moving it into place (docs/topics.md, "Where
outputs go"). Whatever later reads the file (``get``), or replaces it (a later attempt of the
same job), first checks that it is still that file: a regular file, reached without following a
symbolic link anywhere below its root (a media root, or ``<data_dir>/outputs``), with the same
size and content. A share writer who put a link or another file in its place gets nothing read
and nothing overwritten.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Iterable
from typing import Any

from edge_queue.errors import ErrorCode

#: Bytes read at a time while hashing.
BLOCK = 1 << 20
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class NotTheFileWritten(Exception):
    """The file at a path is not the one the job wrote. ``code``: ``output_missing`` (nothing
    there), ``output_changed`` (a link, not a regular file, another size or content, or outside
    every root); ``why`` says which."""

    def __init__(self, path: str, code: ErrorCode, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path, self.code, self.why = path, code, why


def identity(data: bytes) -> dict[str, Any]:
    """The identity of a file holding ``data``: ``{"size": bytes, "sha256": hex digest}``."""
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def identity_of_fd(fd: int) -> dict[str, Any]:
    """:func:`identity` of the open file ``fd``, read from its start (it is not kept)."""
    digest, size = hashlib.sha256(), 0
    offset = 0
    while block := os.pread(fd, BLOCK, offset):
        digest.update(block)
        size += len(block)
        offset += len(block)
    return {"size": size, "sha256": digest.hexdigest()}


def valid_identity(value: Any) -> bool:
    """True for an identity as :func:`identity` makes it (a worker's report is checked)."""
    return (
        isinstance(value, dict)
        and type(value.get("size")) is int
        and value["size"] >= 0
        and isinstance(value.get("sha256"), str)
        and len(value["sha256"]) == 64
        and all(c in "0123456789abcdef" for c in value["sha256"])
    )


def root_of(path: str, roots: Iterable[str]) -> str | None:
    """The root that ``path`` lies strictly below, as configured or as its real path (links in
    a root itself are the administrator's, and followed), or None."""
    for root in roots:
        for form in (os.path.abspath(root), os.path.realpath(root)):
            if path.startswith(form.rstrip("/") + "/"):
                return form
    return None


def open_below(path: str, roots: Iterable[str]) -> int:
    """Open ``path`` for reading without following any symbolic link below its root: each
    folder from the root down is opened with ``O_NOFOLLOW`` relative to the one before, then
    the file itself (with ``O_NONBLOCK``: a FIFO put there does not block). Returns the file
    descriptor of a regular file. Raises :class:`NotTheFileWritten`."""
    root = root_of(path, roots)
    if root is None:
        raise NotTheFileWritten(path, ErrorCode.OUTPUT_CHANGED, "not inside a media root or the outputs folder")
    parts = path[len(root.rstrip("/")) + 1 :].split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise NotTheFileWritten(path, ErrorCode.OUTPUT_CHANGED, "not a plain path")
    fds: list[int] = []
    try:
        try:
            fds.append(os.open(root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)))
            for part in parts[:-1]:
                fds.append(os.open(part, _OPEN_DIR, dir_fd=fds[-1]))
            fd = os.open(parts[-1], _OPEN_FILE, dir_fd=fds[-1])
        except FileNotFoundError as e:
            raise NotTheFileWritten(path, ErrorCode.OUTPUT_MISSING, "it is gone") from e
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                raise NotTheFileWritten(path, ErrorCode.OUTPUT_CHANGED, "a symbolic link stands in its path") from e
            raise NotTheFileWritten(path, ErrorCode.OUTPUT_CHANGED, e.strerror or str(e)) from e
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise NotTheFileWritten(path, ErrorCode.OUTPUT_CHANGED, "not a regular file")
        return fd
    finally:
        for d in fds:
            os.close(d)


def read_written(path: str, recorded: dict[str, Any], roots: Iterable[str], max_bytes: int) -> tuple[bytes, bool]:
    """The first ``max_bytes`` of the output at ``path``, and whether there was more, when it
    is still the file recorded (``recorded``: its :func:`identity`): opened by
    :func:`open_below`, same size, same SHA-256 (the whole file is hashed, ``BLOCK`` bytes at
    a time; at most ``max_bytes`` are held). Raises :class:`NotTheFileWritten`."""
    fd = open_below(path, roots)
    try:
        if os.fstat(fd).st_size != recorded.get("size"):
            raise NotTheFileWritten(path, ErrorCode.OUTPUT_CHANGED, "its size is not the size written")
        digest, head, offset = hashlib.sha256(), bytearray(), 0
        while block := os.pread(fd, BLOCK, offset):
            digest.update(block)
            offset += len(block)
            if len(head) < max_bytes:
                head += block[: max_bytes - len(head)]
    finally:
        os.close(fd)
    if digest.hexdigest() != recorded.get("sha256") or offset != recorded.get("size"):
        raise NotTheFileWritten(path, ErrorCode.OUTPUT_CHANGED, "its content is not what the job wrote")
    return bytes(head), offset > max_bytes


def is_own(path: str, recorded: Iterable[dict[str, Any]]) -> bool:
    """True when the file at ``path`` (not followed if it is a link) is a regular file with one
    of the ``recorded`` identities: what an earlier attempt of the same job wrote. The content
    is read only when a size matches."""
    try:
        fd = os.open(path, _OPEN_FILE)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        sizes = [r for r in recorded if r.get("size") == st.st_size]
        if not stat.S_ISREG(st.st_mode) or not sizes:
            return False
        mine = identity_of_fd(fd)
    finally:
        os.close(fd)
    return any(r.get("sha256") == mine["sha256"] for r in sizes)
