"""Log lines that text from clients and files cannot forge (docs/operations.md, "Logs").

A transaction, an idempotency key, an option value, a file name or an error message from FFmpeg
may hold a newline followed by something that looks like a log record of its own. Every record
is therefore written as one line: control characters (C0, DEL, C1), the Unicode line and
paragraph separators, the bidirectional controls (``\\u202e`` would show a name reversed) and
lone surrogates in its message are written as Python escapes (``\\n``, ``\\x1b``,
``\\u2028``, ``\\udcff``). A traceback, which spans lines by nature, has
every line after the first prefixed with ``  | ``, so no line of it can pass for a record.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager

#: What may not appear raw in a log line: control characters, line and paragraph separators,
#: lone surrogates, and the bidirectional controls (U+061C, U+200E/F, U+202A-E, U+2066-9) that
#: make a line display other than it reads.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")
#: Prefix of the lines after the first of a multi-line record (a traceback).
CONTINUATION = "  | "


def escape(text: str) -> str:
    """``text`` with every character of :data:`_UNSAFE` written as its Python escape."""
    return _UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


class OneLineFormatter(logging.Formatter):
    """A :class:`logging.Formatter` whose records each start exactly one line (see the module)."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        safe = escape(message)
        if safe != message:
            record.msg, record.args = safe, None
        text = super().format(record)
        if "\n" in text or _UNSAFE.search(text):
            first, *rest = text.split("\n")
            text = "\n".join([escape(first), *(CONTINUATION + escape(line) for line in rest)])
        return text


def clip(text: str, n: int = 200) -> str:
    """Text from a client or the file system, for a log line: one line (escaped), at most
    ``n`` characters."""
    return text[:n].encode("unicode_escape").decode("ascii")


class TurnLog(logging.Filter):
    """Holds the log records of a turn's group commit until it is committed.

    The lines a turn logs (``job ... succeeded``, ``attempt 1 failed ...; retry in 4.2 s``)
    describe changes that exist only once the turn is committed. When the commit fails (a full
    disk) the turn runs again, and without this each try would log its lines again: hundreds
    of lines, each with another random retry delay, for one change made once. Records of the
    ``edge_queue`` loggers made inside :meth:`held` are logged when it ends without an
    exception, dropped when it ends with a store error (the failed commit is logged once, by
    its caller), and logged for any other exception.

    It filters every handler of the root logger (:meth:`attach`); :meth:`detach` removes it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.holding = False
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if self.holding and record.name.startswith("edge_queue"):
            self.records.append(record)
            return False
        return True

    @classmethod
    def attach(cls) -> TurnLog:
        """A new one, filtering every handler of the root logger."""
        held = cls()
        for handler in logging.getLogger().handlers:
            handler.addFilter(held)
        return held

    def detach(self) -> None:
        self.release(keep=True)
        for handler in logging.getLogger().handlers:
            handler.removeFilter(self)

    @contextmanager
    def held(self, dropped: tuple[type[BaseException], ...]) -> Iterator[None]:
        """Hold the records made inside; drop them when the block raises one of ``dropped``."""
        self.holding = True
        try:
            yield
        except dropped:
            self.release(keep=False)
            raise
        except BaseException:
            self.release(keep=True)
            raise
        self.release(keep=True)

    def release(self, *, keep: bool) -> None:
        self.holding = False
        records, self.records = self.records, []
        if keep:
            for record in records:
                logging.getLogger(record.name).handle(record)
