"""Path maps: a folder as the hub names it and the same folder as a worker node sees it
(docs/nodes.md, "Files"), in the manner of Tdarr's path translators.

Plain functions over plain data: a path is mapped by the longest matching ``hub`` prefix
(to this machine) or ``local`` prefix (back to the hub), whole path components only, so
``/srv/media`` never matches ``/srv/media2``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import PurePosixPath

#: One map entry: (the hub's folder, this machine's folder), both absolute.
Entry = tuple[str, str]


def _under(path: PurePosixPath, folder: PurePosixPath) -> PurePosixPath | None:
    """``path`` relative to ``folder`` when it is ``folder`` or inside it, else None."""
    try:
        return path.relative_to(folder)
    except ValueError:
        return None


def _translate(path: str, pairs: Sequence[tuple[str, str]]) -> str:
    p = PurePosixPath(path)
    best: tuple[int, str] | None = None
    for src, dst in pairs:
        rel = _under(p, PurePosixPath(src))
        if rel is not None and (best is None or len(PurePosixPath(src).parts) > best[0]):
            best = (len(PurePosixPath(src).parts), str(PurePosixPath(dst) / rel) if str(rel) != "." else dst)
    return best[1] if best is not None else path


def to_local(path: str, entries: Sequence[Entry]) -> str:
    """The hub's ``path`` as this machine sees it (unchanged when no entry covers it)."""
    return _translate(path, entries)


def to_hub(path: str, entries: Sequence[Entry]) -> str:
    """This machine's ``path`` as the hub names it (unchanged when no entry covers it)."""
    return _translate(path, [(local, hub) for hub, local in entries])


def map_result(value: object, entries: Sequence[Entry]) -> object:
    """A job's result with every absolute path string under a ``local`` folder given back in
    the hub's terms (``to_hub``); other values unchanged. Lists and dicts are walked."""
    if isinstance(value, str):
        return to_hub(value, entries) if value.startswith("/") else value
    if isinstance(value, list):
        return [map_result(v, entries) for v in value]
    if isinstance(value, dict):
        return {k: map_result(v, entries) for k, v in value.items()}
    return value
