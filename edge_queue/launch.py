"""The ``edge-queue`` command's entry point (``[project.scripts]``; ``python -m edge_queue``).

It imports the command line inside a ``try``: a Ctrl-C while Python still imports it, before
the command has set up its own handling, ends the command quietly with exit code 130, as a
shell expects of an interrupted command, instead of a ``KeyboardInterrupt`` traceback.
"""

from __future__ import annotations

import sys

#: The exit code of a command ended by Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 130


def main() -> None:
    """Run the ``edge-queue`` command line (:func:`edge_queue.cli.main`)."""
    try:
        from .cli import main as cli_main

        cli_main()
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        raise SystemExit(EXIT_INTERRUPTED) from None
