"""Job kinds that misbehave on purpose, loaded by the service through ``extra_kinds``."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from pydantic import Field

from edge_queue.errors import ErrorCode, JobError
from edge_queue.kinds.base import JobContext, Kind, KindOptions


class Crash(Kind):
    """Kills its own worker process with SIGKILL, every time: a poison job."""

    name = "test_crash"
    needs_input = False

    def run(self, ctx: JobContext, input_path: str | None, options: Any) -> dict[str, Any]:
        os.kill(os.getpid(), signal.SIGKILL)
        return {}


class HangOptions(KindOptions):
    seconds: float = Field(3600, ge=0)


class Hang(Kind):
    """Sleeps without ever reaching a checkpoint: only ending the process stops it."""

    name = "test_hang"
    Options = HangOptions
    needs_input = False

    def run(self, ctx: JobContext, input_path: str | None, options: Any) -> dict[str, Any]:
        time.sleep(options.seconds)
        return {"slept": options.seconds}


class FailOptions(KindOptions):
    code: str = "internal_error"
    #: raise a plain exception with this message instead (an unexpected error, as a library's)
    raise_message: str | None = None


class Fail(Kind):
    """Fails with the given error code."""

    name = "test_fail"
    Options = FailOptions
    needs_input = False

    def run(self, ctx: JobContext, input_path: str | None, options: Any) -> dict[str, Any]:
        if options.raise_message is not None:
            raise RuntimeError(options.raise_message)
        raise JobError("failing on purpose", code=ErrorCode(options.code))


class OddOptions(KindOptions):
    #: "numpy": numpy numbers (JSON once converted); "set": a set (never JSON)
    returns: str = "numpy"
    #: keep a chunk holding the same value first
    keep: bool = True


class Odd(Kind):
    """Returns, and keeps as a chunk, values that are not plain JSON."""

    name = "test_odd"
    Options = OddOptions
    needs_input = False

    def run(self, ctx: JobContext, input_path: str | None, options: Any) -> dict[str, Any]:
        import numpy as np

        value: Any = (
            {"x": np.float64(0.5), "n": np.int64(3), "a": np.arange(3)} if options.returns == "numpy" else {1, 2}
        )
        if options.keep:
            ctx.keep_chunk(0, {"value": value})
        return {"value": value}


EXTRA_KINDS = (
    '["tests.kinds_for_tests:Crash", "tests.kinds_for_tests:Hang", "tests.kinds_for_tests:Fail", '
    '"tests.kinds_for_tests:Odd"]'
)
