"""What a job kind is: an options model and a ``run`` that reports through a :class:`JobContext`.

Kinds run inside worker processes. They never import MQTT or the store: they read their
input, write their outputs under ``ctx.output_dir``, call ``ctx.progress`` and
``ctx.checkpoint`` and return a JSON-able result summary, or raise a
:class:`~edge_queue.errors.JobError` whose code says what went wrong.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from edge_queue.errors import ErrorCode, JobError

if TYPE_CHECKING:
    from edge_queue.config.settings import Settings


class KindOptions(BaseModel):
    """Base of every kind's options: unknown options are an ``invalid_request`` at submit."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class JobContext(Protocol):
    """The worker's side of a running job, handed to :meth:`Kind.run`."""

    job_id: str
    attempt: int
    output_dir: Path
    settings: Settings

    def progress(self, percent: float, stage: str | None = None, eta_s: float | None = None) -> None:
        """Report progress, 0-100 percent; ``eta_s`` seconds left when known."""

    def checkpoint(self) -> None:
        """Raise :class:`~edge_queue.errors.JobCancelled` when a cancel was asked for."""

    #: What earlier attempts of this job kept with :meth:`keep_chunk`, in index order (the
    #: ``data`` objects; empty on a first attempt or when none were kept).
    kept: list[dict[str, Any]]

    def keep_chunk(self, index: int, data: dict[str, Any]) -> None:
        """Have the service keep chunk ``index`` (from 0) of this attempt's work: ``data`` is a
        JSON object, committed to the store before any later progress of the job is published,
        and handed to the job's next attempt as :attr:`kept` (docs/topics.md, "Long jobs
        resume"). Send the chunks in order, each once."""

    #: The files earlier attempts of this job wrote, as the store recorded them: path ->
    #: ``{"size", "sha256", "attempt"}`` (empty on a first attempt). A later attempt replaces
    #: these, and only these, without ``overwrite`` (:mod:`.outputs`).
    written: dict[str, dict[str, Any]]

    def claim_outputs(self, files: dict[str, dict[str, Any]]) -> None:
        """Have the service record ``files`` (path -> :func:`edge_queue.written.identity`) as
        this attempt's outputs, and wait until the record is committed, before they are moved
        into place. Raises :class:`~edge_queue.errors.JobError` when the service refuses (the
        attempt is no longer the job's), :class:`~edge_queue.errors.JobCancelled` on a cancel."""


class Kind:
    """A job kind. Subclasses set ``name``, ``Options``, ``needs_input`` and implement ``run``."""

    name: ClassVar[str]
    Options: ClassVar[type[KindOptions]] = KindOptions
    #: The shape of the kind's result, checked when a worker node reports it (docs/nodes.md,
    #: "What the hub takes from a node"); None: any JSON object within the bounds of
    #: :func:`~edge_queue.rules.results.result_problem`.
    Result: ClassVar[type[BaseModel] | None] = None
    #: True when ``input`` must be an existing file inside ``media_roots``.
    needs_input: ClassVar[bool] = True
    description: ClassVar[str] = ""

    def run(self, ctx: JobContext, input_path: str | None, options: Any) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def check_options(cls, options: Any, settings: Settings) -> None:
        """Checks of the options against the configuration, at submit. Raises
        :class:`~edge_queue.errors.RequestError` naming the field."""

    @classmethod
    def schema(cls) -> dict[str, Any]:
        """JSON Schema of the options, as published on ``<base>/info``."""
        return cls.Options.model_json_schema()


class OutputOptions(KindOptions):
    """Where a kind that writes files puts them."""

    output: Literal["data_dir", "beside"] = Field(
        "data_dir", description="data_dir: <data_dir>/outputs/<job_id>/; beside: next to the input"
    )
    overwrite: bool = Field(False, description="replace existing files (beside only); else output_exists")


#: Output file names are at most this many bytes: 255 (``NAME_MAX`` of Linux file systems)
#: less what the temporary name of an output adds (``.<name>.<8 random>.part``).
MAX_NAME_BYTES = 240


def output_stem(input_path: str, longest_suffix: str) -> str:
    """The stem of ``input_path`` for output names ending in suffixes up to ``longest_suffix``
    (``".und.json"``, say). Unchanged when ``stem + longest_suffix`` fits :data:`MAX_NAME_BYTES`;
    else cut on a character boundary and followed by ``~`` and the first 8 hex digits of the
    SHA-1 of the whole stem, so the same input always gets the same names and two long names
    that differ only at their ends still differ. Output names are built from this stem and
    fixed suffixes only, never from client text."""
    stem = Path(input_path).stem
    raw = os.fsencode(stem)
    if len(raw) + len(os.fsencode(longest_suffix)) <= MAX_NAME_BYTES:
        return stem
    digest = hashlib.sha1(raw).hexdigest()[:8]
    cut = raw[: MAX_NAME_BYTES - len(os.fsencode(longest_suffix)) - 1 - len(digest)]
    while cut and cut[-1] & 0xC0 == 0x80:  # a UTF-8 continuation byte: drop the partial character
        cut = cut[:-1]
    if cut and cut[-1] >= 0xC0:
        cut = cut[:-1]
    return f"{os.fsdecode(cut)}~{digest}"


def publish_file(tmp: Path, path: Path, *, overwrite: bool) -> Path:
    """Move a finished temporary file into place atomically; ``output_exists`` when ``path``
    exists and ``overwrite`` is false (checked by a hard link, so two writers cannot both win)."""
    try:
        if overwrite:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
            os.unlink(tmp)
    except FileExistsError as e:
        tmp.unlink(missing_ok=True)
        raise JobError(f"{path} exists (set overwrite to replace it)", code=ErrorCode.OUTPUT_EXISTS) from e
    return path


def process_umask() -> int:
    """The process's file mode creation mask, read without changing it (``Umask:`` of
    ``/proc/self/status``, Linux 4.7+; elsewhere set and restored at once)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def temp_path(path: Path) -> Path:
    """A temporary file name beside ``path`` (same filesystem, so the rename is atomic).

    The file gets the mode any new file of the process gets (``0666`` less the umask), not
    the ``0600`` of :func:`tempfile.mkstemp`: an output beside a recording is then readable by
    whoever the umask lets read it (a media server's user with ``UMask=0022``;
    docs/operations.md, "Sandbox")."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        os.fchmod(fd, 0o666 & ~process_umask())
    finally:
        os.close(fd)
    return Path(tmp)


def write_atomic(path: Path, data: bytes | str, *, overwrite: bool = True) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same folder, then rename.

    Readers see the old file or the whole new one, never a partial file. With
    ``overwrite=False`` an existing ``path`` raises :class:`JobError` ``output_exists``.
    """
    raw = data.encode() if isinstance(data, str) else data
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        return publish_file(tmp, path, overwrite=overwrite)
    finally:
        tmp.unlink(missing_ok=True)
