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


EXTRA_KINDS = '["tests.kinds_for_tests:Crash", "tests.kinds_for_tests:Hang", "tests.kinds_for_tests:Fail"]'
