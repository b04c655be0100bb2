"""Giving disk space back after large deletes (kept chunks of ended jobs, purges): SQLite keeps
the pages of deleted rows in the file as free pages, so a store that once held 400 MiB keeps
400 MiB however little it holds (docs/operations.md, "The disk is full").

The store is created with ``auto_vacuum = INCREMENTAL`` (SQLite, "PRAGMA auto_vacuum": it can
be set only before the first table, or with a ``VACUUM`` after it), and the service returns
free pages a bounded number at a time (``PRAGMA incremental_vacuum(N)``), outside its turns'
transactions; the file shrinks at the next checkpoint of the write-ahead log. A store made by
an earlier edge-queue (``auto_vacuum = NONE``) is converted once, with a ``VACUUM``, when the
service opens it and the disk has room for a copy.
"""

from __future__ import annotations

import logging
import shutil
import sqlite3
import time

from .connection import Connection

log = logging.getLogger(__name__)

#: ``PRAGMA auto_vacuum`` value of incremental mode.
INCREMENTAL = 2
#: Free pages given back at most per call (4 KiB pages: 4 MiB); the pause it costs is in
#: docs/operations.md, "The disk is full".
GIVE_BACK_PAGES = 1024
#: Fewer free pages than this (4 MiB) are left in the file: the next rows reuse them.
KEEP_FREE_PAGES = 1024


def incremental(c: Connection) -> bool:
    """Whether the store's file is in incremental auto-vacuum mode."""
    (mode,) = c.raw.execute("PRAGMA auto_vacuum").fetchone()
    return bool(mode == INCREMENTAL)


def convert(c: Connection) -> bool:
    """Turn a store of ``auto_vacuum = NONE`` into incremental mode with one ``VACUUM`` (the
    whole file rewritten: a pause at boot, logged with its length), when the disk holding it
    has free space for two copies (the rewritten file, and its pages in the write-ahead log).
    True when the store is (now) incremental; False, logged, when it stays as it was."""
    if incremental(c):
        return True
    size = c.path.stat().st_size
    free = shutil.disk_usage(c.path.parent).free
    if free < 2 * size:
        log.warning(
            "the store (%d MiB) keeps the space of deleted rows until it is converted, which needs %d MiB free "
            "(%d MiB are): it is tried again at the next start",
            size >> 20,
            (2 * size) >> 20,
            free >> 20,
        )
        return False
    began = time.monotonic()
    try:
        c.raw.execute("PRAGMA auto_vacuum = INCREMENTAL")
        c.raw.execute("PRAGMA temp_store = FILE")  # the copy on disk, not in memory
        c.raw.execute("VACUUM")
    except sqlite3.Error as e:
        log.warning("the store could not be converted to give back the space of deleted rows: %s", e)
        return False
    finally:
        c.raw.execute("PRAGMA temp_store = MEMORY")
    log.info(
        "the store (%d MiB) was converted to give back the space of deleted rows, in %.1f s",
        c.path.stat().st_size >> 20,
        time.monotonic() - began,
    )
    return incremental(c)


def give_back(c: Connection, max_pages: int = GIVE_BACK_PAGES) -> int:
    """Return up to ``max_pages`` free pages to the file system when more than
    :data:`KEEP_FREE_PAGES` are free (outside a transaction; the file shrinks at the next
    checkpoint of the write-ahead log). Returns the pages given back (0: nothing to do, or a
    store not in incremental mode)."""
    if c.group_depth or c.raw.in_transaction:
        return 0
    (free,) = c.raw.execute("PRAGMA freelist_count").fetchone()
    if free <= KEEP_FREE_PAGES or not incremental(c):
        return 0
    pages = min(max_pages, free)
    # executescript: sqlite3's execute() steps a statement once, and incremental_vacuum frees
    # one page per step (measured: 1 page of 2,048 asked for)
    c.raw.executescript(f"PRAGMA incremental_vacuum({int(pages)})")
    (left,) = c.raw.execute("PRAGMA freelist_count").fetchone()
    return int(free - left)
