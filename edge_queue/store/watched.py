"""Watched files: the version of each file a watch folder took on and what became of it
(docs/configuration.md, "[[watch]]").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import NamedTuple

from .connection import Connection
from .ids import iso, parse_iso


class BesideJob(NamedTuple):
    """A job writing beside its input: ``created`` in Unix seconds, ``state`` its state,
    ``written`` the paths its result names (empty until it succeeded)."""

    job_id: str
    input: str
    created: float
    state: str
    written: frozenset[str]


def written_paths(result: str | None) -> frozenset[str]:
    """The paths a job's stored ``result`` (JSON text) says it wrote: ``output`` (one file)
    and the values of ``outputs`` (one per format)."""
    try:
        data = json.loads(result) if result else None
    except ValueError:
        return frozenset()
    if not isinstance(data, dict):
        return frozenset()
    paths = [data.get("output")]
    outputs = data.get("outputs")
    if isinstance(outputs, dict):
        paths.extend(outputs.values())
    return frozenset(p for p in paths if isinstance(p, str))


class WatchedFiles:
    """The ``watch_files`` table, and the jobs that write beside a watched input."""

    def __init__(self, c: Connection) -> None:
        self.c = c

    def watched_files(self, folders: Sequence[str]) -> dict[str, tuple[int, int, str]]:
        """The file versions taken on under ``folders`` (absolute paths without a trailing
        ``/``): path -> ``(size, mtime_ns, digest)``."""
        out: dict[str, tuple[int, int, str]] = {}
        for folder in folders:
            # '0' sorts right after '/': the range is every path under "<folder>/"
            for path, size, mtime_ns, digest in self.c.conn.execute(
                "SELECT path, size, mtime_ns, digest FROM watch_files WHERE path >= ? AND path < ?",
                [folder + "/", folder + "0"],
            ):
                out[path] = (size, mtime_ns, digest)
        return out

    def record_watched(
        self, path: str, size: int, mtime_ns: int, digest: str, outcome: str, job_id: str | None, now: float
    ) -> None:
        """Record the version of ``path`` a watch took on and its ``outcome`` (``job``,
        ``output``, ``refused:<code>``), in the caller's transaction (the job's,
        so that a job and its record are committed together)."""
        self.c.conn.execute(
            "INSERT INTO watch_files (path, size, mtime_ns, digest, outcome, job_id, at) VALUES (?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (path) DO UPDATE SET size = excluded.size, mtime_ns = excluded.mtime_ns, "
            "digest = excluded.digest, outcome = excluded.outcome, at = excluded.at, "
            "job_id = coalesce(excluded.job_id, watch_files.job_id)",
            [path, size, mtime_ns, digest, outcome, job_id, iso(now)],
        )

    def touch_watched(self, path: str, mtime_ns: int, now: float) -> None:
        """A file taken on before was touched: same content, a new modification time."""
        self.c.conn.execute("UPDATE watch_files SET mtime_ns = ?, at = ? WHERE path = ?", [mtime_ns, iso(now), path])

    def watch_counts(self, folder: str) -> dict[str, int]:
        """How many files under ``folder`` the watch took on, by outcome (``job``, ...)."""
        counts: dict[str, int] = {}
        for outcome, n in self.c.conn.execute(
            "SELECT outcome, count(*) FROM watch_files WHERE path >= ? AND path < ? GROUP BY outcome",
            [folder + "/", folder + "0"],
        ):
            counts[outcome] = n
        return counts

    def beside_jobs(self, folder: str) -> list[BesideJob]:
        """Jobs that write their outputs beside an input in ``folder`` (option ``output:
        beside``), inputs directly in ``folder`` only, each with the paths its result says
        it wrote (``output``, and the values of ``outputs``)."""
        rows = self.c.conn.execute(
            "SELECT job_id, input, created_at, state, result FROM jobs WHERE input >= ? AND input < ? "
            "AND json_extract(options, '$.output') = 'beside'",
            [folder + "/", folder + "0"],
        )
        return [
            BesideJob(j, i, parse_iso(c), s, written_paths(r))
            for j, i, c, s, r in rows
            if "/" not in i[len(folder) + 1 :]
        ]
