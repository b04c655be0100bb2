"""Start-up checks of ``data_dir`` and the store, before anything is announced.

``Service.boot`` calls :func:`check_data_dir` first: a damaged, foreign, truncated, newer or
unreachable store, or a ``data_dir`` the service cannot write, must end the start with one
line that names the file, says what is wrong and what to do, and exit code 2 (via
:class:`~edge_queue.errors.ConfigError`), before systemd hears ``READY=1`` and before
``online`` is published. Without it, SQLite opens a damaged file happily and the service fails
later, in the middle of serving, with a traceback (and systemd restarts it in a loop).

The checks read. They write only a probe file in ``data_dir`` (created and removed), and
``data_dir`` itself when it is missing, as the service would next. The store is opened
read-only (``mode=ro``), so nothing is checkpointed or migrated into a damaged file (SQLite
may create the ``-shm`` index of a ``-wal`` file left by a crash, as any reader does).

Cost: ``PRAGMA quick_check`` reads every page of the store once (it skips what
``integrity_check`` adds: that every index matches its table). On a 100,000-job store
(48 MiB, ``bench/prefill.py``) the whole check takes about 60 ms with the file in the page
cache and 0.6-0.8 s from a cold disk (a 2-CPU VM); ``integrity_check`` took 250 ms warm.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import stat
import tempfile
import traceback
from pathlib import Path

from edge_queue.config.settings import Settings
from edge_queue.errors import ConfigError

from . import SCHEMA_VERSION

#: The first 16 bytes of every SQLite 3 database file (fileformat2.html, "The Database Header").
SQLITE_MAGIC = b"SQLite format 3\x00"
#: Length of the SQLite database header, in bytes.
HEADER_BYTES = 100
#: The tables of every edge-queue store (schema 1 and later).
STORE_TABLES = frozenset({"jobs", "batches", "job_events", "idempotency_keys"})
#: At most this many characters of a ``quick_check`` report go into the one line.
MAX_DETAIL_CHARS = 200

RESTORE = (
    "run `edge-queue doctor`, then restore a backup made with `edge-queue backup` "
    "(docs/operations.md, Backup and restore), or move it and its -wal and -shm files away to start with an empty store"
)
FIX_PERMISSIONS = "fix its permissions so the service's user can read and write it (sudo chown edge-queue: {path})"
LOCAL_DISK = (
    "the store (SQLite) needs them to keep its files whole; set data_dir to a folder on a local disk "
    "(docs/configuration.md, data_dir), then run `edge-queue doctor`"
)


class DataDirError(ConfigError):
    """``data_dir`` or one of the service's files in it cannot be used as it is.

    Attributes:
        path: the folder or file at fault.
        message: one line: the path, what is wrong, what to do.
    """

    def __init__(self, path: Path, message: str) -> None:
        super().__init__(" ".join(message.split()))  # one line, whatever SQLite said
        self.path = path


class StoreDamaged(DataDirError):
    """The store ``<data_dir>/edge-queue.db`` is not a usable edge-queue database: not SQLite,
    truncated, damaged, written by a newer edge-queue, or SQLite failed to open it."""


def check_data_dir(settings: Settings) -> None:
    """Check ``settings.data_dir`` and the store in it before the service opens them.

    Creates ``data_dir`` when it is missing (as the service would). Checks, in order:
    ``data_dir`` is a folder the process can create files in (a real probe file, so a
    read-only mount or a missing ``ReadWritePaths=`` is caught too, also for root); each of
    ``edge-queue.lock``, ``edge-queue.db``, ``edge-queue.db-wal`` and ``edge-queue.db-shm``
    that exists is a regular file the process can open for reading and writing; ``outputs``,
    when it exists, is a folder; and a non-empty store has the SQLite header, is not shorter
    than its header says (unless a write-ahead log may hold the rest), passes
    ``PRAGMA quick_check`` and has a schema (``user_version``) no newer than this edge-queue's.
    A missing or empty store is fine: the service creates it.

    Args:
        settings: the configuration; only ``data_dir`` (and the paths derived from it) is read.

    Raises:
        DataDirError: a :class:`~edge_queue.errors.ConfigError` (exit code 2) for a folder or
            file the process cannot use; its ``message`` is one line naming the path.
        StoreDamaged: a :class:`DataDirError` for a store that is not a usable database.
    """
    data_dir = settings.data_dir
    _check_folder(data_dir)
    db = settings.db_path
    for path, what in (
        (data_dir / "edge-queue.lock", "the lock file"),
        (db, "the store"),
        (Path(f"{db}-wal"), "the store's write-ahead log"),
        (Path(f"{db}-shm"), "the store's shared-memory file"),
    ):
        _check_file(path, what)
    outputs = settings.outputs_dir
    if outputs.exists() and not outputs.is_dir():
        raise DataDirError(outputs, f"{outputs} is not a folder: move it away (job outputs are written there)")
    if db.exists() and db.stat().st_size > 0:
        _check_store(db)


def boot_failure(settings: Settings, exc: BaseException) -> DataDirError | None:
    """The one-line error for an exception that escaped ``Service.boot`` while it opened the
    store or its files, or ``None`` when ``exc`` is something else.

    ``Service.boot`` runs before ``READY=1`` and ``online``; a ``sqlite3.DatabaseError`` it
    raises (in ``Store.__init__`` or ``Store.migrate``, after :func:`check_data_dir` passed:
    a SQLite file of another program, a file damaged since the check) or an ``OSError`` on a
    file inside ``data_dir`` is a store or folder problem, not a bug. Errors raised later, by
    the running service, are not turned into this.

    Args:
        settings: the configuration the service ran with.
        exc: the exception, with its traceback.
    """
    if not _raised_in_boot(exc):
        return None
    db = settings.db_path
    if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
        # not damage: a file system without locks, or another program holding the store's lock
        try:
            problem = lock_problem(settings.data_dir)
        except OSError:
            problem = None
        if problem is not None:
            return DataDirError(settings.data_dir, problem)
        return locked_by_another(db, exc)
    if isinstance(exc, sqlite3.DatabaseError):
        return StoreDamaged(db, f"the store {db} could not be opened ({exc}): {RESTORE}")
    if isinstance(exc, OSError) and exc.filename is not None:
        path = Path(os.fsdecode(exc.filename))
        if path == settings.data_dir or settings.data_dir in path.parents:
            reason = exc.strerror or str(exc)
            return DataDirError(path, f"cannot use {path} ({reason}): {FIX_PERMISSIONS.format(path=path)}")
    return None


# -- the checks ---------------------------------------------------------------------------


def _reason(e: OSError) -> str:
    return e.strerror or str(e)


def _kind(path: Path) -> str:
    """``"a file"``, ``"a folder"``, ``"a broken symbolic link"`` ... for a message."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "a broken symbolic link" if path.is_symlink() else "missing"
    except OSError as e:
        return f"unreadable: {_reason(e)}"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISREG(mode):
        return "a file"
    return "a special file"


def _check_folder(data_dir: Path) -> None:
    if (data_dir.exists() or data_dir.is_symlink()) and not data_dir.is_dir():
        raise DataDirError(
            data_dir,
            f"data_dir {data_dir} is not a folder (it is {_kind(data_dir)}): set data_dir to a folder, "
            "or move what is there away",
        )
    try:
        if not data_dir.exists():
            data_dir.mkdir(parents=True, mode=0o700)  # the store holds every transcript
    except OSError as e:
        raise DataDirError(
            data_dir,
            f"cannot create data_dir {data_dir} ({_reason(e)}): create it for the service's user "
            f"(sudo install -d -o edge-queue -g edge-queue {data_dir}) or set data_dir to a writable folder; "
            "then run `edge-queue doctor`",
        ) from e
    try:
        fd, probe = tempfile.mkstemp(prefix=".edge-queue-probe-", dir=data_dir)
    except OSError as e:
        if e.errno == errno.EROFS:
            raise DataDirError(
                data_dir,
                f"data_dir {data_dir} is on a read-only file system: under systemd, list it in ReadWritePaths= "
                "(the unit's ProtectSystem=strict makes everything else read-only), or mount it read-write; "
                "then run `edge-queue doctor`",
            ) from e
        raise DataDirError(
            data_dir,
            f"data_dir {data_dir} is not writable ({_reason(e)}): fix its permissions so the service's user can "
            f"write it (sudo chown -R edge-queue: {data_dir}), or set data_dir to a writable folder; "
            "then run `edge-queue doctor`",
        ) from e
    try:
        problem = _lock_problem(fd, data_dir)
    finally:
        os.close(fd)
        try:
            os.unlink(probe)
        except OSError:
            pass
    if problem is not None:
        raise DataDirError(data_dir, problem)


def lock_problem(data_dir: Path) -> str | None:
    """One line saying that ``data_dir``'s file system has no working file locks (an NFS
    mount without a lock manager, an SMB mount without byte-range locks), or ``None`` when a
    POSIX lock and a ``flock`` on a new file in it both work. ``edge-queue doctor`` uses it;
    :func:`check_data_dir` runs the same probe. Raises ``OSError`` when no file can be created
    in ``data_dir``."""
    fd, probe = tempfile.mkstemp(prefix=".edge-queue-probe-", dir=data_dir)
    try:
        return _lock_problem(fd, data_dir)
    finally:
        os.close(fd)
        os.unlink(probe)


def _lock_problem(fd: int, data_dir: Path) -> str | None:
    """Lock ``fd``, a new file of ``data_dir`` nothing else holds, as SQLite (POSIX record
    locks) and the service (``flock`` on ``edge-queue.lock``) do. Any error is the file
    system's: no other process can hold a lock on a file just created."""
    import fcntl

    for take, drop in (
        (lambda: fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB), lambda: fcntl.lockf(fd, fcntl.LOCK_UN)),
        (lambda: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB), lambda: fcntl.flock(fd, fcntl.LOCK_UN)),
    ):
        try:
            take()
            drop()
        except OSError as e:
            return no_locks(data_dir, _reason(e))
    return None


def no_locks(data_dir: Path, reason: str) -> str:
    """The one line for a ``data_dir`` whose file system refuses file locks."""
    return (
        f"data_dir {data_dir} is on a file system without working file locks ({reason}; an NFS mount without a "
        f"lock manager, or an SMB mount without byte-range locks): {LOCAL_DISK}"
    )


def _check_file(path: Path, what: str) -> None:
    if not (path.exists() or path.is_symlink()):
        return
    if not path.is_file():
        advice = (
            "move it away, then restore a backup made with `edge-queue backup` (docs/operations.md, Backup and "
            "restore) or let the service create an empty store; `edge-queue doctor` checks it"
            if what == "the store"
            else "move it away"
        )
        error = StoreDamaged if what == "the store" else DataDirError
        raise error(path, f"{what} {path} is not a file (it is {_kind(path)}): {advice}")
    try:
        with open(path, "r+b"):
            pass
    except OSError as e:
        raise DataDirError(
            path,
            f"cannot open {what} {path} for reading and writing ({_reason(e)}): "
            f"{FIX_PERMISSIONS.format(path=path)}; then run `edge-queue doctor`",
        ) from e


def _check_store(db: Path) -> None:
    size = db.stat().st_size
    with open(db, "rb") as f:
        header = f.read(HEADER_BYTES)
    if not header.startswith(SQLITE_MAGIC[: len(header)]):
        raise StoreDamaged(
            db, f"the store {db} is not an SQLite database (it does not start with the SQLite header): {RESTORE}"
        )
    if len(header) < HEADER_BYTES:
        raise StoreDamaged(db, f"the store {db} is truncated ({size} bytes, shorter than the SQLite header): {RESTORE}")
    raw_page = int.from_bytes(header[16:18], "big")
    page_size = 65536 if raw_page == 1 else raw_page
    if page_size < 512 or page_size & (page_size - 1):
        raise StoreDamaged(db, f"the store {db} is damaged (its header gives a page size of {raw_page}): {RESTORE}")
    wal = Path(f"{db}-wal")
    # With a write-ahead log, the header and the pages the file lacks may be in the log.
    if not (wal.exists() and wal.stat().st_size > 0):
        pages = int.from_bytes(header[28:32], "big")
        # The header's page count is valid when its change counter equals "version-valid-for".
        if pages and header[24:28] == header[92:96] and size < pages * page_size:
            raise StoreDamaged(db, f"the store {db} is truncated ({size} of {pages * page_size} bytes): {RESTORE}")
        if size % page_size:
            raise StoreDamaged(
                db,
                f"the store {db} is truncated ({size} bytes, not a whole number of {page_size}-byte pages): {RESTORE}",
            )
    try:
        conn = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error as e:
        raise StoreDamaged(db, f"the store {db} cannot be opened ({e}): {RESTORE}") from e
    try:
        problems = [str(row[0]) for row in conn.execute("PRAGMA quick_check")]
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        tables = {
            str(row[0])
            for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")
        }
    except sqlite3.OperationalError as e:
        if "locked" in str(e):
            raise locked_by_another(db, e) from e
        raise StoreDamaged(db, f"the store {db} is damaged ({e}): {RESTORE}") from e
    except sqlite3.DatabaseError as e:
        raise StoreDamaged(db, f"the store {db} is damaged ({e}): {RESTORE}") from e
    finally:
        conn.close()
    if problems != ["ok"]:
        detail = "; ".join(" ".join(p.replace("*** in database main ***", "").split()) for p in problems)
        if len(detail) > MAX_DETAIL_CHARS:
            detail = detail[: MAX_DETAIL_CHARS - 1] + "…"
        raise StoreDamaged(db, f"the store {db} is damaged (quick_check: {detail}): {RESTORE}")
    if version == 0 and tables:
        # edge-queue creates its schema and sets user_version in one transaction: tables
        # without a version are another program's.
        raise StoreDamaged(
            db,
            f"the store {db} is another program's SQLite database (tables {_names(tables)}, no edge-queue schema "
            "version): point data_dir at edge-queue's own folder, or move the file away to start with an empty store",
        )
    if 0 < version <= SCHEMA_VERSION and not STORE_TABLES <= tables:
        raise StoreDamaged(
            db,
            f"the store {db} lacks the table(s) {_names(STORE_TABLES - tables)} of an edge-queue store: {RESTORE}",
        )
    if version > SCHEMA_VERSION and not STORE_TABLES & tables:
        raise StoreDamaged(
            db,
            f"the store {db} is another program's SQLite database (tables {_names(tables)}, schema version "
            f"{version}): point data_dir at edge-queue's own folder, or move the file away to start with "
            "an empty store",
        )
    if version > SCHEMA_VERSION:
        raise StoreDamaged(
            db,
            f"the store {db}: database schema {version} is newer than this edge-queue ({SCHEMA_VERSION}): "
            "upgrade edge-queue, or restore a backup made with `edge-queue backup` by this version "
            "(docs/operations.md, Upgrade)",
        )


def locked_by_another(db: Path, exc: sqlite3.Error) -> DataDirError:
    """The one line for a store another program holds locked (SQLite's ``database is locked``
    on a file system whose locks work): not damage, so never the advice to restore it."""
    return DataDirError(
        db,
        f"the store {db} is locked by another program ({exc}): end it (a sqlite3 shell, a copy tool), then "
        "start the service again; the store is not damaged",
    )


def _names(tables: set[str] | frozenset[str]) -> str:
    listed = ", ".join(sorted(tables)[:5])
    return listed + (f" and {len(tables) - 5} more" if len(tables) > 5 else "")


def _raised_in_boot(exc: BaseException) -> bool:
    """True when ``exc``'s traceback runs through ``Service.boot`` (before ``READY=1``)."""
    return any(
        frame.f_code.co_name == "boot" and frame.f_globals.get("__name__") == "edge_queue.service"
        for frame, _ in traceback.walk_tb(exc.__traceback__)
    )


def private_store_files(settings: Settings) -> bool:
    """Create ``data_dir`` (mode 0700: the store holds every transcript) and the store file
    (0600) if missing, and take group and other permissions off the store and its ``-wal``
    and ``-shm`` files whatever the umask (SQLite gives those the mode of the database file).
    Returns True when the store is new (missing or empty)."""
    settings.data_dir.mkdir(parents=True, mode=0o700, exist_ok=True)
    db = settings.db_path
    try:
        os.close(os.open(db, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        pass
    for path in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
        if path.exists() and path.stat().st_mode & 0o077:
            os.chmod(path, 0o600)
    return db.stat().st_size == 0
