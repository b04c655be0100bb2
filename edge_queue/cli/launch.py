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

#: The exit code of a command ended by Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 130
#: SIGINTs received while the command line is imported (only this module, the command's entry,
#: sets the handler, first thing: a Ctrl-C that came while ``typing`` was imported here gave a
#: traceback).
_INTERRUPTED: list[int] = []


def _note(signum: int, frame: object) -> None:
    _INTERRUPTED.append(signum)


try:
    _PREVIOUS = signal.signal(signal.SIGINT, _note)
except ValueError:  # not the main thread (embedded): no handler to lend
    _PREVIOUS = None


def main() -> None:
    """Run the ``edge-queue`` command line (:func:`edge_queue.cli.main.main`)."""
    interrupted, previous = _INTERRUPTED, _PREVIOUS
    try:
        from .main import main as cli_main
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
