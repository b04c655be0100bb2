"""What a job kind is: an options model and a ``run`` that reports through a :class:`JobContext`.

Kinds run inside worker processes. They never import MQTT or the store: they read their
input, write their outputs under ``ctx.output_dir``, call ``ctx.progress`` and
``ctx.checkpoint`` and return a JSON-able result summary, or raise a
:class:`~edge_queue.errors.JobError` whose code says what went wrong.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from ..config import Settings


class KindOptions(BaseModel):
    """Base of every kind's options: unknown options are an ``invalid_request`` at submit."""

    model_config = ConfigDict(extra="forbid", frozen=True)


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


class Kind:
    """A job kind. Subclasses set ``name``, ``Options``, ``needs_input`` and implement ``run``."""

    name: ClassVar[str]
    Options: ClassVar[type[KindOptions]] = KindOptions
    #: True when ``input`` must be an existing file inside ``media_roots``.
    needs_input: ClassVar[bool] = True
    description: ClassVar[str] = ""

    def run(self, ctx: JobContext, input_path: str | None, options: Any) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def schema(cls) -> dict[str, Any]:
        """JSON Schema of the options, as published on ``<base>/info``."""
        return cls.Options.model_json_schema()


def write_atomic(path: Path, data: bytes | str, *, overwrite: bool = True) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same folder, then rename.

    Readers see the old file or the whole new one, never a partial file. With
    ``overwrite=False`` an existing ``path`` raises ``FileExistsError`` (checked by a hard
    link, so two writers cannot both win).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
            os.unlink(tmp)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
