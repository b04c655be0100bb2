"""What the store keeps about itself and the installation: numbers the service keeps
(``store_meta``), the installation's id, the client id's secret, integrity and backups.
"""

from __future__ import annotations

import secrets
import sqlite3
import time
from pathlib import Path

from .connection import Connection
from .ids import iso
from .rows import SET_META


class Meta:
    """The ``store_meta`` and ``instance`` tables."""

    def __init__(self, c: Connection) -> None:
        self.c = c

    def meta(self, key: str) -> int | None:
        """A number the service keeps in the store (``paused``), or None when unset."""
        row = self.c.conn.execute("SELECT value FROM store_meta WHERE key = ?", [key]).fetchone()
        return None if row is None else int(row[0])

    def set_meta(self, key: str, value: int) -> None:
        """Set a number the service keeps in the store (one statement: atomic by itself,
        so inside :meth:`.Connection.group` it needs no savepoint of its own; there it is
        written with the group's deferred rows, before any other statement reads the store)."""
        self._upsert(key, value)

    def meta_text(self, key: str) -> str | None:
        """A text the service keeps in the store (``base_topic``), or None when unset."""
        row = self.c.conn.execute("SELECT value FROM store_meta WHERE key = ?", [key]).fetchone()
        return None if row is None else str(row[0])

    def set_meta_text(self, key: str, value: str) -> None:
        """Set a text the service keeps in the store (one statement, like :meth:`set_meta`:
        inside :meth:`.Connection.group` it joins the group's transaction, deferred as there)."""
        self._upsert(key, value)

    def _upsert(self, key: str, value: int | str) -> None:
        if self.c.group_depth == 1:
            # with the group's deferred rows: a value set per request (Home Assistant's last
            # submit) is one statement per turn, and the turn's submits stay one executemany
            self.c.deferred_meta[key] = value
            return
        if self.c.group_depth:  # in a savepoint: undone with it
            self.c.conn.execute(SET_META, [key, value])
            return
        with self.c.immediate():
            self.c.conn.execute(SET_META, [key, value])

    def instance_id(self) -> str:
        """The installation's id: 12 hex digits made with the store, the same for its whole life
        (restarts, upgrades); a new ``data_dir`` makes a new one (docs/topics.md, ``info``)."""
        row = self.c.conn.execute("SELECT instance_id FROM instance LIMIT 1").fetchone()
        if row is not None:
            return str(row[0])
        made = secrets.token_hex(6)
        with self.c.immediate():
            self.c.conn.execute(
                "INSERT INTO instance (instance_id, created_at) VALUES (?, ?)", [made, iso(time.time())]
            )
        return made

    def client_id_secret(self) -> str:
        """16 hex digits made at random with the store and never published: the end of the
        service's default MQTT client id (docs/configuration.md, ``mqtt.client_id``), so that no
        other client can guess the id and take over its session."""
        value = self.meta("client_id_secret")
        if value is None:
            value = secrets.randbits(63)
            self.set_meta("client_id_secret", value)
        return f"{value:016x}"

    def integrity_check(self) -> str:
        """``PRAGMA integrity_check``: ``"ok"`` for a healthy file."""
        return str(self.c.conn.execute("PRAGMA integrity_check").fetchone()[0])


def backup(src: Path | str, dest: Path | str) -> None:
    """Copy the database ``src`` to ``dest`` with SQLite's online backup API: consistent
    while the service keeps writing; ``src`` is opened read-only and not migrated.
    Raises ``FileExistsError`` when ``dest`` exists, ``FileNotFoundError`` when its folder
    does not, ``sqlite3.Error`` when ``src`` is not a readable database."""
    dest = Path(dest)
    if dest.exists():
        raise FileExistsError(f"{dest} exists")
    if not dest.parent.is_dir():
        raise FileNotFoundError(f"folder {dest.parent} does not exist")
    source = sqlite3.connect(f"file:{src}?mode=ro", uri=True, timeout=30)
    try:
        with sqlite3.connect(str(dest)) as target:
            source.backup(target)
        target.close()
    finally:
        source.close()
