"""When a watched file is complete (docs/operations.md, "Watch folders"): the files seen that may
still be written wait as candidates (:class:`Candidates`), each handed over (:class:`Ready`) once
its size and modification time stood still for its watch's ``settle_s`` (longer while a writer
holds it open), and only when that version is not one taken on before (``known``).

Plain data of the watcher thread (:class:`~edge_queue.watch.watcher.FolderWatcher`): it
decides what is a candidate; these rules decide when a candidate is complete.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from edge_queue.config.settings import WatchSettings

from .files import FolderStems, file_digest

log = logging.getLogger(__name__)

#: A file that inotify saw written and not yet closed (``IN_CLOSE_WRITE``) waits for the close,
#: or for this many times ``settle_s`` without a change (at least :data:`OPEN_WRITER_MIN_S`
#: seconds): a writer that pauses while it holds the file open (a stalled network copy) is not
#: taken for finished, and one that never closes it is not waited for forever.
OPEN_WRITER_FACTOR = 12
OPEN_WRITER_MIN_S = 60.0


@dataclass(frozen=True, slots=True)
class Ready:
    """A complete file handed over by the watcher: one version of it (size in bytes,
    modification time in ns, content digest). ``touched``: the same content as the version
    taken on before, with a new modification time (no job). ``same_stem``: another file in its
    folder shares its stem (it may be an output written beside that one)."""

    index: int
    path: str
    size: int
    mtime_ns: int
    digest: str
    touched: bool = False
    same_stem: bool = False


@dataclass(slots=True)
class Candidate:
    """A file of the watch ``index`` waiting to be complete, as last seen (bytes, ns)."""

    index: int
    size: int
    mtime_ns: int
    since: float  # monotonic time its size or modification time last changed
    writing: bool = False  # inotify saw it written and not closed since


class Candidates:
    """The candidates by path, of the watches ``watches`` (by index), against ``known`` (path ->
    ``(size, mtime_ns, digest)``, the versions already taken on, updated as files are handed
    over)."""

    def __init__(self, watches: list[WatchSettings], known: dict[str, tuple[int, int, str]]) -> None:
        self.watches = watches
        self.known = dict(known)
        self.waiting: dict[str, Candidate] = {}

    def consider(self, index: int, path: str, st: os.stat_result, mono: float, *, event: bool) -> None:
        """The regular file ``path`` of the watch ``index`` (``st``: its ``lstat``) becomes a
        candidate, or stays one as of ``mono``; ``event``: an event announced it, else a scan
        found it (a version taken on before, or one already waiting unchanged, is then left)."""
        known = self.known.get(path)
        old = self.waiting.get(path)
        if old is None and not event and known is not None and known[:2] == (st.st_size, st.st_mtime_ns):
            return  # taken on before, unchanged
        if old is not None and (old.size, old.mtime_ns) == (st.st_size, st.st_mtime_ns) and not event:
            return
        writing = old.writing if old is not None else False
        self.waiting[path] = Candidate(index, st.st_size, st.st_mtime_ns, mono, writing)

    def forget(self, index: int) -> None:
        """The watch ``index`` went (its folder missing or leading elsewhere): none of its files waits."""
        self.waiting = {p: c for p, c in self.waiting.items() if c.index != index}

    def distrust_writers(self, index: int) -> None:
        """inotify's events of the watch ``index`` were lost, a close among them perhaps: none
        of its files waits as held open by a writer."""
        for held in self.waiting.values():
            if held.index == index:
                held.writing = False

    def settle_s(self, c: Candidate) -> float:
        """How long ``c`` must stand still: ``settle_s``, longer while a writer holds it open."""
        settle = self.watches[c.index].settle_s
        return max(settle * OPEN_WRITER_FACTOR, OPEN_WRITER_MIN_S) if c.writing else settle

    def waits_s(self, mono: float) -> list[float]:
        """Seconds from ``mono`` until each candidate may be complete (negative: due)."""
        return [c.since + self.settle_s(c) - mono for c in self.waiting.values()]

    def settled(self, mono: float) -> Iterator[Ready]:
        """The candidates that stood still for their watch's ``settle_s`` as of ``mono``, each
        yielded as it is found complete (its content digest read), and taken on in ``known``."""
        stems = FolderStems()  # each folder listed once per pass, not once per file
        for path, c in list(self.waiting.items()):
            if mono - c.since < self.settle_s(c):
                continue
            try:
                st = os.stat(path)
            except OSError:
                del self.waiting[path]
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
                del self.waiting[path]  # an empty file is not a recording yet: its writes bring it back
                continue
            if (st.st_size, st.st_mtime_ns) != (c.size, c.mtime_ns):
                c.size, c.mtime_ns, c.since = st.st_size, st.st_mtime_ns, mono
                continue
            del self.waiting[path]
            known = self.known.get(path)
            if known is not None and known[:2] == (c.size, c.mtime_ns):
                continue
            try:
                digest = file_digest(path, c.size)
            except OSError as e:
                log.warning("watch %s: cannot read %s: %s", self.watches[c.index].path, path, e)
                continue
            touched = known is not None and known[0] == c.size and known[2] == digest
            self.known[path] = (c.size, c.mtime_ns, digest)
            yield Ready(c.index, path, c.size, c.mtime_ns, digest, touched, not touched and stems.shares_stem(path))
