"""``noop``: does nothing, or sleeps ``sleep_s`` (at most 60 s) checking for cancellation."""

from __future__ import annotations

import time
from typing import Any

from pydantic import Field

from .base import JobContext, Kind, KindOptions


class NoopOptions(KindOptions):
    sleep_s: float = Field(0.0, ge=0, le=60, description="seconds to sleep, checking for cancel")


class Noop(Kind):
    """For health checks, tests and benchmarks. Result: ``{"slept_s": float}``."""

    name = "noop"
    Options = NoopOptions
    needs_input = False
    description = "does nothing; sleeps sleep_s seconds when asked"

    def run(self, ctx: JobContext, input_path: str | None, options: Any) -> dict[str, Any]:
        deadline = time.monotonic() + options.sleep_s
        while (left := deadline - time.monotonic()) > 0:
            ctx.checkpoint()
            time.sleep(min(left, 0.05))
            done = options.sleep_s - max(deadline - time.monotonic(), 0)
            ctx.progress(100 * done / options.sleep_s, "sleeping", max(deadline - time.monotonic(), 0))
        ctx.checkpoint()
        return {"slept_s": options.sleep_s}
