"""The ``browse`` request: the folders and files of the media roots, for a file picker.

Confinement follows :func:`~edge_queue.rules.inputs.check_input`: a folder is listed only when it
resolves (symbolic links included) inside a media root, and nothing outside the roots is listed
or revealed. A symbolic link inside a listed folder is shown only when it leads to a file or
folder inside the roots (then as what it leads to); one that leads out, or nowhere, is left out,
and browsing into it is refused with ``input_outside_media_roots``.
"""

from __future__ import annotations

import bisect
import os
import stat
from collections import OrderedDict
from pathlib import Path
from typing import Any

from edge_queue.errors import ErrorCode, InputError
from edge_queue.store import iso

#: ``limit`` of a ``browse`` request: default and largest value.
DEFAULT_LIMIT, MAX_LIMIT = 200, 1000
#: Entries one request looks at most (each a look-up; links that lead out are skipped): a page
#: ends early past it, with ``next_after`` to go on.
MAX_LOOKUPS = 2000
#: Names kept, over all folders, by :func:`_sorted_names` (about 100 bytes each): the folders
#: browsed last stay read while they fit, however many, so that a user going back and forth
#: between a folder of 100,000 files and small ones reads the big one once, not at every turn.
CACHED_NAMES = 300_000
_NAMES: OrderedDict[str, tuple[int, list[str]]] = OrderedDict()
#: Names one request reads at most from a folder not read yet (about 10 ms on a 2-core box):
#: a larger folder is read over several requests, each answered ``reading`` until the last,
#: so that one user's folders, however large and however many, delay the others' requests by
#: a bounded time per request, not by the time a whole folder takes to read.
READ_PER_REQUEST = 5000
#: Folders being read at once, over all users; past it the one left longest goes (its open
#: directory closed; a later request starts it again).
MAX_READING = 8


class _Reading:
    """A folder being read in pieces: its modification time when the reading began, the open
    directory (``os.scandir``), and the sort keys read so far, in sorted runs."""

    def __init__(self, folder: str, mtime_ns: int) -> None:
        self.mtime_ns = mtime_ns
        self.entries = os.scandir(folder)
        self.keys: list[str] = []

    def advance(self, n: int) -> bool:
        """Read up to ``n`` more names; True once the folder is read to its end (then closed)."""
        run = []
        for entry in self.entries:
            name = entry.name
            if not name.startswith(".") and utf8_name(name):
                run.append(_sort_key(name))
            if len(run) >= n:
                break
        else:
            self.close()
            self.keys += sorted(run)
            return True
        self.keys += sorted(run)  # a sorted run: the final sort merges the runs (timsort)
        return False

    def close(self) -> None:
        self.entries.close()


_READING: OrderedDict[str, _Reading] = OrderedDict()


def _sort_key(name: str) -> str:
    """Entries are sorted case-insensitively, then by their exact name (a total order, so
    that ``after`` pages without gaps or repeats): one string, the case-folded name, NUL, the
    name (no name holds a NUL), which sorts as the pair would and several times faster."""
    return f"{name.casefold()}\0{name}"


def _name_of(key: str) -> str:
    return key[key.index("\0") + 1 :]


def _inside(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def browse(
    path: str | None, media_roots: list[Path], *, limit: int = DEFAULT_LIMIT, after: str | None = None
) -> dict[str, Any]:
    """One page of a folder inside ``media_roots``, or the roots themselves.

    Args:
        path: an absolute folder path inside a media root; ``None``: the media roots.
        media_roots: the configured roots (absolute paths).
        limit: entries per page, 1..:data:`MAX_LIMIT`.
        after: a name: the page starts after it (``next_after`` of the previous page).

    Returns:
        ``{"path": <the folder, normalised, or None>, "entries": [{"name", "type": "dir" |
        "file", "size": bytes or None for a folder, "mtime": RFC 3339 UTC}], "next_after":
        <name to pass as after, or None on the last page>}``. Entries are sorted by name,
        case-insensitively. Without ``path`` each entry is a root: ``name`` is its absolute
        path. Hidden names (starting with ``.``), symbolic links that lead out of the roots or
        nowhere, and anything but regular files and folders are left out.

    Raises:
        InputError: ``input_outside_media_roots`` (field ``path``) for a relative path, one with
            a ``..`` component, or one that is or resolves outside every root (checked first,
            so the answer does not reveal what exists outside); ``input_not_found`` for a
            folder that does not exist, is not a folder, or cannot be read by the service.
    """
    real_roots = [os.path.realpath(r) for r in media_roots]
    if path is None:
        roots = [(str(r), os.path.realpath(r)) for r in media_roots]
        candidates = sorted(((_sort_key(name), name, real) for name, real in roots), key=lambda c: c[0])
        if after is not None:
            candidates = [c for c in candidates if c[0] > _sort_key(after)]
        entries = [_entry(name, real, "dir") for _, name, real in candidates[:limit]]
        more = len(candidates) > limit
        return {"path": None, "entries": entries, "next_after": entries[-1]["name"] if more else None}

    where = ", ".join(str(r) for r in media_roots) or "none configured"
    if "\x00" in path or not os.path.isabs(path) or ".." in path.split("/"):
        raise InputError(
            f"path must be an absolute folder path inside media_roots ({where}), without '..': {path[:200]!r}",
            code=ErrorCode.INPUT_OUTSIDE_MEDIA_ROOTS,
            field="path",
        )
    folder = os.path.normpath(path)
    if folder.startswith("//"):
        folder = "/" + folder.lstrip("/")
    lexical_roots = [os.path.normpath(str(r)) for r in media_roots]
    resolved = os.path.realpath(folder)
    if not (_inside(folder, lexical_roots) or _inside(folder, real_roots)) or not _inside(resolved, real_roots):
        raise InputError(
            f"{path[:200]} is outside media_roots ({where})",
            code=ErrorCode.INPUT_OUTSIDE_MEDIA_ROOTS,
            field="path",
        )
    not_found = InputError(
        f"{path[:200]} does not exist, is not a folder, or is not readable by the service",
        code=ErrorCode.INPUT_NOT_FOUND,
        field="path",
    )
    if not os.path.isdir(resolved):
        raise not_found
    floor = _sort_key(after) if after is not None else None
    try:
        names = _sorted_names(resolved)
    except OSError as e:
        raise not_found from e
    if isinstance(names, int):  # still being read: ask again (docs/topics.md, "browse")
        return {"path": folder, "entries": [], "next_after": after or "", "reading": names}
    start = bisect.bisect_right(names, floor) if floor is not None else 0
    page: list[dict[str, Any]] = []
    more = False
    # Entries that are left out (links leading out, devices) cost a look-up each: take
    # candidates in order until the page is full, and look at most MAX_LOOKUPS of them, so
    # that one request costs a bounded time whatever the folder holds (the page then ends
    # early, and next_after goes on from the last name looked at).
    last = None
    for looked in range(len(names) - start):
        if len(page) == limit or looked >= MAX_LOOKUPS:
            more = True
            break
        name = last = _name_of(names[start + looked])
        entry = _listed(os.path.join(resolved, name), name, real_roots)
        if entry is not None:
            page.append(entry)
    following = (page[-1]["name"] if len(page) == limit else last) if more else None
    return {"path": folder, "entries": page, "next_after": following}


def _sorted_names(folder: str) -> list[str] | int:
    """The sort keys (:func:`_sort_key`) of the folder's names, sorted, without hidden names
    and names that are not UTF-8 (no request could name them back); or, while the folder is
    still being read (:data:`READ_PER_REQUEST` names per call), how many names are read so
    far. Kept for the folders browsed last, up to :data:`CACHED_NAMES` names in all, while
    their modification time stays the same, so that paging through, or asking again for, a
    folder of 100,000 files reads it once (20 calls, then a page from the kept names takes a
    few milliseconds). A folder changed while it is read is read again from its start."""
    mtime_ns = os.stat(folder).st_mtime_ns
    cached = _NAMES.get(folder)
    if cached is not None and cached[0] == mtime_ns:
        _NAMES.move_to_end(folder)
        return cached[1]
    reading = _READING.get(folder)
    if reading is None or reading.mtime_ns != mtime_ns:
        if reading is not None:
            reading.close()
        _READING[folder] = reading = _Reading(folder, mtime_ns)
        while len(_READING) > MAX_READING:
            _READING.popitem(last=False)[1].close()
    _READING.move_to_end(folder)
    if not reading.advance(READ_PER_REQUEST):
        return len(reading.keys)
    del _READING[folder]
    names = reading.keys
    names.sort()  # sorted runs: timsort merges them
    _NAMES.pop(folder, None)
    _NAMES[folder] = (mtime_ns, names)
    total = sum(len(v[1]) for v in _NAMES.values())
    while len(_NAMES) > 1 and total > CACHED_NAMES:
        _, (_, dropped) = _NAMES.popitem(last=False)
        total -= len(dropped)
    return names


def utf8_name(name: str) -> bool:
    """True when ``name`` (a file name from the OS, undecodable bytes kept as lone surrogates)
    is valid UTF-8, so that MQTT topics and JSON can carry it."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _listed(full: str, name: str, real_roots: list[str]) -> dict[str, Any] | None:
    """The entry for ``name`` (at ``full``), or ``None`` when it is not to be listed."""
    try:
        st = os.lstat(full)
        if stat.S_ISLNK(st.st_mode):
            target = os.path.realpath(full)
            if not _inside(target, real_roots):
                return None  # a way out of the roots is not shown
            st = os.stat(target)
    except OSError:
        return None  # vanished, or a link that leads nowhere
    if stat.S_ISDIR(st.st_mode):
        return {"name": name, "type": "dir", "size": None, "mtime": iso(st.st_mtime)}
    if stat.S_ISREG(st.st_mode):
        return {"name": name, "type": "file", "size": st.st_size, "mtime": iso(st.st_mtime)}
    return None


def _entry(name: str, real: str, kind: str) -> dict[str, Any]:
    """A media root as an entry; ``mtime`` is ``None`` when the root does not exist."""
    try:
        mtime: str | None = iso(os.stat(real).st_mtime)
    except OSError:
        mtime = None
    return {"name": name, "type": kind, "size": None, "mtime": mtime}
