"""The ``edge-queue`` command's entry point (``[project.scripts]``; ``python -m edge_queue``).

A Ctrl-C while Python still imports the command line, before the command has set up its own
handling, ends the command quietly with exit code 130, as a shell expects of an interrupted
command, instead of a traceback. During the imports SIGINT only sets a flag, read once they are
done: a ``KeyboardInterrupt`` raised inside a library's native code can come out as another
error (pydantic-core building a model's serializer turned one into a ``SchemaError``).
"""

from __future__ import annotations

import signal
import sys
from typing import Any

#: The exit code of a command ended by Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 130


def main() -> None:
    """Run the ``edge-queue`` command line (:func:`edge_queue.cli.main`)."""
    interrupted: list[int] = []

    def note(signum: int, frame: Any) -> None:
        interrupted.append(signum)

    try:
        previous = signal.signal(signal.SIGINT, note)
    except ValueError:  # not the main thread (embedded): no handler to lend
        previous = None
    try:
        from .cli import main as cli_main
    except KeyboardInterrupt:  # a Ctrl-C before the handler above was in place
        interrupted.append(signal.SIGINT)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    try:
        if interrupted:
            raise KeyboardInterrupt
        cli_main()
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        raise SystemExit(EXIT_INTERRUPTED) from None
