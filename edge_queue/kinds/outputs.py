"""A job's output files, written as one set: every file aside first, then all moved into place.

:func:`publish_set` is how a kind puts finished files where they go (docs/topics.md, "Where
outputs go"):

1. each file is complete under a temporary name in its folder (``.<name>.<8 hex>.part``, the
   8 hex digits from the job id: a later attempt of the same job removes what a killed one left);
2. nothing is moved while any destination holds a file someone else made (``output_exists``,
   unless ``overwrite``); a file an earlier attempt of the same job wrote (the store's record,
   ``ctx.written``, same size and SHA-256) is not someone else's, and is replaced;
3. the identities of the new files are recorded in the store and committed
   (``ctx.claim_outputs``) before any of them is moved;
4. all are moved into place one after another, then the folders are synced.

A run killed before step 4 leaves no output; one killed during it leaves files the job's next
attempt recognises as its own and replaces.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from edge_queue.errors import ErrorCode, JobError
from edge_queue.written import identity_of_fd, is_own

from .base import JobContext


def part_path(path: Path, job_id: str) -> Path:
    """The temporary name of ``path`` for ``job_id`` (:data:`~.base.MAX_NAME_BYTES` leaves room)."""
    tag = hashlib.sha1(job_id.encode()).hexdigest()[:8]
    return path.parent / f".{path.name}.{tag}.part"


def write_part(path: Path, job_id: str, data: bytes) -> Path:
    """Write ``data`` to :func:`part_path` (a leftover of the same job's earlier attempt, or a
    link put there, is removed first; never followed) and sync it. Returns the part's path."""
    tmp = part_path(path, job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return tmp


def someone_elses(path: Path, ctx: JobContext, overwrite: bool) -> bool:
    """True when ``path`` holds a file (or a link) the job may not replace: not ``overwrite``,
    and not what an earlier attempt of this job wrote there."""
    if overwrite or not os.path.lexists(path):
        return False
    recorded = (getattr(ctx, "written", None) or {}).get(str(path))
    return recorded is None or not is_own(str(path), [recorded])


def publish_set(ctx: JobContext, parts: dict[Path, Path], *, overwrite: bool) -> None:
    """Move the finished temporary files ``parts`` (destination -> temporary file, same
    folder) into place as one set, as the module says. Raises :class:`JobError`
    ``output_exists`` (no file moved, the parts removed) for a destination that holds someone
    else's file. The parts are removed on any failure."""
    try:
        check_free(ctx, list(parts), overwrite)
        files = {}
        for dest, tmp in parts.items():
            fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                files[str(dest)] = identity_of_fd(fd)
            finally:
                os.close(fd)
        ctx.claim_outputs(files)
        check_free(ctx, list(parts), overwrite)  # again: a share writer may have been quick
        for dest, tmp in parts.items():
            if overwrite or os.path.lexists(dest):  # ours (checked above) or overwrite: replaced
                os.replace(tmp, dest)
                continue
            try:
                os.link(tmp, dest)  # someone else's file made meanwhile is never replaced
            except FileExistsError as e:
                if someone_elses(dest, ctx, overwrite):
                    raise JobError(f"{dest} exists (set overwrite to replace it)", code=ErrorCode.OUTPUT_EXISTS) from e
                os.replace(tmp, dest)
        for folder in {dest.parent for dest in parts}:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    finally:
        for tmp in parts.values():
            tmp.unlink(missing_ok=True)


def writable_problem(folder: Path) -> str | None:
    """Why no file can be made in ``folder`` (the file system's reason: ``Read-only file
    system``, ``Permission denied``, ``Operation not permitted`` for an immutable folder), or
    None. Tried for real, with a temporary file (``.<name>.part``, which watch folders
    ignore) made and removed at once: permission bits alone do not bind root, a read-only mount
    or an immutable folder do."""
    probe = folder / f".edge-queue-writable.{os.getpid()}.{os.urandom(4).hex()}.part"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    try:
        probe.unlink()
    except OSError as e:
        return f"a file made there cannot be removed ({e.strerror or e})"
    return None


def check_writable(folder: Path) -> None:
    """Raise :class:`JobError` ``output_not_writable`` when no file can be made in ``folder``
    (:func:`writable_problem`): checked before the work, so a job whose outputs go where the
    service cannot write fails before it decodes anything."""
    if (why := writable_problem(folder)) is not None:
        raise JobError(f"cannot write {folder}: {why}", code=ErrorCode.OUTPUT_NOT_WRITABLE)


def check_free(ctx: JobContext, paths: list[Path], overwrite: bool) -> None:
    """Raise :class:`JobError` ``output_exists`` for the first of ``paths`` that holds someone
    else's file (:func:`someone_elses`): checked before the work, so a job whose outputs cannot
    be written fails at once instead of after it."""
    for path in paths:
        if someone_elses(path, ctx, overwrite):
            raise JobError(f"{path} exists (set overwrite to replace it)", code=ErrorCode.OUTPUT_EXISTS)


def write_outputs(ctx: JobContext, documents: dict[Path, bytes], *, overwrite: bool) -> None:
    """Write ``documents`` (destination -> content) as one set (:func:`publish_set`). Raises
    as :func:`publish_set` does, and ``OSError`` from writing."""
    parts: dict[Path, Path] = {}
    try:
        for dest, data in documents.items():
            parts[dest] = write_part(dest, ctx.job_id, data)
    except BaseException:
        for tmp in parts.values():
            tmp.unlink(missing_ok=True)
        raise
    publish_set(ctx, parts, overwrite=overwrite)
