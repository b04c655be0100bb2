"""Job kinds that misbehave on purpose, loaded by the service through ``extra_kinds``; and a
share writer inside the worker processes (:func:`_swap_at_open`)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
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


class HalfCloseOptions(KindOptions):
    #: seconds to go on running after the pipe was half-closed
    seconds: float = Field(3, ge=0)


class HalfClose(Kind):
    """Shuts down the sending side of every socket its worker holds (its pipe to the service
    is a socket pair), then goes on working: the service reads an end of file from a worker
    that is still alive. A plug-in that tidies file descriptors can do this."""

    name = "test_half_close"
    Options = HalfCloseOptions
    needs_input = False

    def run(self, ctx: JobContext, input_path: str | None, options: Any) -> dict[str, Any]:
        import socket
        import stat

        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            try:
                if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                    continue
                sock = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            finally:
                sock.close()
        time.sleep(options.seconds)
        return {"slept": options.seconds}


EXTRA_KINDS = (
    '["tests.kinds_for_tests:Crash", "tests.kinds_for_tests:Hang", "tests.kinds_for_tests:Fail", '
    '"tests.kinds_for_tests:Odd", "tests.kinds_for_tests:HalfClose"]'
)


#: ``{"path", "to": "fifo" | "link-out" | "none", "target", "log"}``: in a worker process, the
#: first time anything opens ``path``, it is replaced (by a FIFO, or by a link to ``target``)
#: just before that open runs, and every open of ``path`` is logged, one line each, to ``log``.
SWAP_ENV = "EQ_TEST_INPUT_SWAP"


def _swap_at_open(event: str, args: tuple[Any, ...]) -> None:
    """An audit hook (``open`` events: ``open()``, ``os.open()``): a share writer who swaps a
    job's input at the very moment the worker first opens it."""
    if event != "open" or not args or not isinstance(args[0], (str, bytes)):
        return
    spec = json.loads(os.environ[SWAP_ENV])
    if os.fsdecode(args[0]) != spec["path"]:
        return
    if not multiprocessing.current_process().name.startswith("edge-queue-worker"):
        return  # the service's own checks at the submit
    first = not os.path.exists(spec["log"])
    with open(spec["log"], "a") as fh:
        fh.write(f"{os.getpid()} {args[1]!r}\n")
    if first and spec["to"] == "fifo":
        os.unlink(spec["path"])
        os.mkfifo(spec["path"])
    elif first and spec["to"] == "link-out":
        os.unlink(spec["path"])
        os.symlink(spec["target"], spec["path"])


if os.environ.get(SWAP_ENV):
    sys.addaudithook(_swap_at_open)
