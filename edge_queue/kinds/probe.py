"""``probe``: container, duration, bit rate and every stream, read with PyAV."""

from __future__ import annotations

from typing import Any

from .base import JobContext, Kind, KindOptions
from .media import describe


class Probe(Kind):
    """Result: see :func:`edge_queue.kinds.media.describe`. Bad files fail ``unsupported_media``."""

    name = "probe"
    Options = KindOptions
    description = "container and stream facts (duration, codecs, streams)"

    def run(self, ctx: JobContext, input_path: str | None, options: Any) -> dict[str, Any]:
        assert input_path is not None
        ctx.progress(0, "probing")
        return describe(input_path)
