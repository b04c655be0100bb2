"""Bad stores and data folders (``edge_queue.store.preflight``): ``edge-queue serve`` prints one
line naming the file, what is wrong and what to do, and exits 2, before it tells systemd
``READY=1`` and before ``online`` is retained on ``<base>/status``.

Each case runs the real service (``python -m edge_queue serve``) as a subprocess against a
real SQLite file damaged the way disks and people damage them, with ``NOTIFY_SOCKET`` set to
a Unix datagram socket the test reads (as systemd's would be). Permission cases run the
service as an unprivileged user (``setpriv``, when the tests run as root: root ignores mode
bits) or under a read-only bind mount in a private mount namespace (``unshare``).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import sqlite3
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_queue.config.settings import Settings
from edge_queue.store import SCHEMA_VERSION, JobSpec, Store
from edge_queue.store.preflight import boot_failure, check_data_dir

from .conftest import Broker, ServiceProcess, Watcher, need, publish, run_doctor, wait_until

DB = "edge-queue.db"
DOCTOR = "`edge-queue doctor`"
BACKUP = "`edge-queue backup`"
ROOT_USER = os.geteuid() == 0


# -- helpers ----------------------------------------------------------------------------


def make_store(path: Path, jobs: int = 300) -> Path:
    """A healthy store at ``path`` with ``jobs`` noop jobs, checkpointed (no WAL left)."""
    store = Store(path, "normal")
    for start in range(0, jobs, 100):
        store.submit([JobSpec("noop", f"in{i}", {}) for i in range(start, min(jobs, start + 100))], time.time())
    store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    return path


def unprivileged() -> tuple[list[str], int, int]:
    """The command prefix that runs a program as an unprivileged user, with its uid and gid:
    ``setpriv`` to ``nobody`` when the tests run as root, nothing otherwise."""
    if not ROOT_USER:
        return [], os.getuid(), os.getgid()
    need(shutil.which("setpriv") is not None, "setpriv not installed (util-linux)")
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        need(False, "no user 'nobody' to run the service as")
        raise
    uid, gid = nobody.pw_uid, nobody.pw_gid
    return [shutil.which("setpriv") or "setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"], uid, gid


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A folder every user can reach (pytest's ``tmp_path`` is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="eq-preflight-"))
    path.chmod(0o755)
    yield path
    for sub, dirs, _ in os.walk(path):
        for d in dirs:
            os.chmod(os.path.join(sub, d), 0o755)
    shutil.rmtree(path)


@pytest.fixture
def notify(shared_tmp: Path) -> Iterator[tuple[str, socket.socket]]:
    """A fake systemd notify socket that any user may send to: (address, socket)."""
    path = str(shared_tmp / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    os.chmod(path, 0o777)
    yield path, sock
    sock.close()


def notifications(sock: socket.socket) -> list[str]:
    """Every datagram waiting on ``sock`` (call it after the sender exited: nothing more comes)."""
    sock.setblocking(False)
    got = []
    try:
        while True:
            got.append(sock.recv(4096).decode())
    except BlockingIOError:
        pass
    return got


def retained_status(broker: Broker, base: str) -> list[bytes]:
    """What a new subscriber to ``<base>/status`` is sent: the retained message, if any.

    A marker published after the subscription arrives after any retained message, so no
    sleep is needed to know that none will come."""
    w = Watcher(broker.host, broker.port, [f"{base}/status", f"{base}/fence"])
    try:
        publish(broker, f"{base}/fence", b"x")
        wait_until(lambda: w.on(f"{base}/fence"), 10, "the fence message")
        return w.on(f"{base}/status")
    finally:
        w.close()


def serve(
    svc: ServiceProcess, data_dir: Path, notify_path: str, prefix: list[str] | None = None, command: str = "serve"
) -> str:
    """Run ``edge-queue serve`` (or ``command``) on ``data_dir`` until it exits (it must,
    within 60 s); assert exit code 2 and return its standard error."""
    env = {**svc.env, "EDGE_QUEUE_DATA_DIR": str(data_dir), "NOTIFY_SOCKET": notify_path}
    out = subprocess.run(
        [*(prefix or []), sys.executable, "-m", "edge_queue", command],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, f"exit code {out.returncode}\n{out.stderr}"
    return out.stderr


def assert_refused(svc: ServiceProcess, stderr: str, sock: socket.socket, path: Path, *needles: str) -> str:
    """One ``edge-queue: ...`` line naming ``path`` with every needle, no traceback, no
    ``READY=1``, nothing retained on ``<base>/status``. Returns the line."""
    assert "Traceback" not in stderr and "╭" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("edge-queue: ")]
    assert len(lines) == 1, stderr
    line = lines[0]
    assert str(path) in line, line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    sent = notifications(sock)
    assert not any("READY=1" in m for m in sent), sent
    assert retained_status(svc.broker, svc.base) == []
    print(line)
    return line


@pytest.fixture
def svc(mosquitto: Broker, service_factory, tmp_path: Path) -> ServiceProcess:
    media = tmp_path / "media"  # the data folders of these tests lie in tmp_path, outside the root
    media.mkdir()
    return service_factory(mosquitto, [media])


# -- the control: a healthy store is served, and the checks above would see it -----------


def test_healthy_store_is_served_with_ready_and_online(svc: ServiceProcess, notify) -> None:
    # Given a healthy store with a few hundred jobs
    notify_path, sock = notify
    make_store(svc.db)
    svc.env["NOTIFY_SOCKET"] = notify_path
    # When the service starts, then it is online, READY=1 reaches the socket, online is retained
    svc.start()
    sock.settimeout(30)
    assert "READY=1" in sock.recv(4096).decode()
    assert retained_status(svc.broker, svc.base) == [b"online"]


# -- damaged stores -----------------------------------------------------------------------


def test_garbage_in_the_middle_of_the_store(svc: ServiceProcess, notify, tmp_path: Path) -> None:
    # Given a store of 300 jobs with 4 KiB of garbage written over its page 4 (a whole page of
    # a table; page 2 is the pointer map of a store with incremental auto-vacuum)
    db = make_store(tmp_path / "d" / DB)
    with open(db, "r+b") as f:
        f.seek(12288)
        f.write(os.urandom(4096))
    # When the service starts, then quick_check refuses it
    stderr = serve(svc, db.parent, notify[0])
    assert_refused(svc, stderr, notify[1], db, "is damaged (quick_check:", DOCTOR, BACKUP)


@pytest.mark.parametrize(("content", "command"), [("random", "serve"), ("text", "serve"), ("text", "up")])
def test_file_that_is_not_sqlite(svc: ServiceProcess, notify, tmp_path: Path, content: str, command: str) -> None:
    # Given edge-queue.db holding random bytes, or text; `up` (with mosquitto answering, so
    # no embedded broker) runs the same service
    db = tmp_path / "d" / DB
    db.parent.mkdir()
    data = os.urandom(64 * 1024) if content == "random" else ("job_id,state\n" + "x,queued\n" * 500).encode()
    db.write_bytes(data)
    stderr = serve(svc, db.parent, notify[0], command=command)
    assert_refused(svc, stderr, notify[1], db, "is not an SQLite database", DOCTOR, BACKUP)


def test_truncated_store(svc: ServiceProcess, notify, tmp_path: Path) -> None:
    # Given a store cut in half
    db = make_store(tmp_path / "d" / DB)
    size = db.stat().st_size
    os.truncate(db, size // 2)
    stderr = serve(svc, db.parent, notify[0])
    assert_refused(svc, stderr, notify[1], db, f"is truncated ({size // 2} of {size} bytes)", DOCTOR, BACKUP)


def test_store_from_a_newer_edge_queue(svc: ServiceProcess, notify, tmp_path: Path) -> None:
    # Given a healthy store whose schema version is past this edge-queue's
    db = make_store(tmp_path / "d" / DB)
    with sqlite3.connect(db) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    stderr = serve(svc, db.parent, notify[0])
    assert_refused(
        svc,
        stderr,
        notify[1],
        db,
        f"database schema {SCHEMA_VERSION + 1} is newer than this edge-queue ({SCHEMA_VERSION})",
        "upgrade edge-queue",
        BACKUP,
    )


@pytest.mark.parametrize(("tables", "version"), [(["jobs"], 0), (["customers", "orders"], 0), (["moz_places"], 7)])
def test_another_programs_database_is_refused_untouched(
    svc: ServiceProcess, notify, tmp_path: Path, tables: list[str], version: int
) -> None:
    # Given a healthy SQLite file of another program, even one with a table named jobs, or
    # one with a schema version of its own
    db = tmp_path / "d" / DB
    db.parent.mkdir()
    with sqlite3.connect(db) as conn:
        for table in tables:
            conn.execute(f"CREATE TABLE {table} (x)")
            conn.execute(f"INSERT INTO {table} VALUES (1)")
        conn.execute(f"PRAGMA user_version = {version}")
    conn.close()
    before = db.read_bytes()
    # When the service starts, then it refuses the file in one line and leaves it as it was
    stderr = serve(svc, db.parent, notify[0])
    assert_refused(svc, stderr, notify[1], db, "is another program's SQLite database", tables[-1])
    assert db.read_bytes() == before
    assert sorted(p.name for p in db.parent.iterdir() if p.name.startswith(DB)) == [DB]


def test_sqlite_error_while_opening_after_the_checks(svc: ServiceProcess, notify, tmp_path: Path) -> None:
    # Given an edge-queue store whose jobs table lost a column: preflight passes, opening fails
    db = tmp_path / "d" / DB
    db.parent.mkdir()
    with sqlite3.connect(db) as conn:
        for table in ("jobs", "batches", "job_events", "idempotency_keys"):
            conn.execute(f"CREATE TABLE {table} (x)")
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    conn.close()
    check_data_dir(Settings(data_dir=db.parent))
    # When the service opens it, then the sqlite3 error becomes the one line
    stderr = serve(svc, db.parent, notify[0])
    assert_refused(svc, stderr, notify[1], db, "could not be opened (no such column:", DOCTOR, BACKUP)


# -- folders and files the service cannot use ----------------------------------------------


def test_read_only_data_dir_for_an_unprivileged_user(svc: ServiceProcess, notify, shared_tmp: Path) -> None:
    # Given the service's own data_dir with a healthy store, mode 0555, and the service run
    # as an unprivileged user (root would write it anyway)
    prefix, uid, gid = unprivileged()
    data_dir = shared_tmp / "data"
    db = make_store(data_dir / DB)
    for p in (data_dir, db):
        os.chown(p, uid, gid)
    data_dir.chmod(0o555)
    stderr = serve(svc, data_dir, notify[0], prefix)
    assert_refused(svc, stderr, notify[1], data_dir, "is not writable (Permission denied)", "fix its permissions")


def test_read_only_mount(svc: ServiceProcess, notify, shared_tmp: Path) -> None:
    # Given a data_dir bind-mounted read-only (a private mount namespace, so only the service
    # sees it): EROFS, which refuses root as well
    need(ROOT_USER and shutil.which("unshare") is not None, "needs root and unshare for a private read-only mount")
    data_dir = shared_tmp / "data"
    make_store(data_dir / DB)
    mount = 'd=$1; shift; mount --bind "$d" "$d" && mount -o remount,bind,ro "$d" && exec "$@"'
    prefix = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh", str(data_dir)]
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=30)
    need(probe.returncode == 0, f"cannot make a read-only bind mount here: {probe.stderr.strip()}")
    stderr = serve(svc, data_dir, notify[0], prefix)
    assert_refused(svc, stderr, notify[1], data_dir, "is on a read-only file system", "ReadWritePaths=")


def test_data_dir_is_a_file(svc: ServiceProcess, notify, tmp_path: Path) -> None:
    data_dir = tmp_path / "data-file"
    data_dir.write_text("not a folder\n")
    stderr = serve(svc, data_dir, notify[0])
    assert_refused(svc, stderr, notify[1], data_dir, "is not a folder (it is a file)")


def test_store_is_a_folder(svc: ServiceProcess, notify, tmp_path: Path) -> None:
    db = tmp_path / "d" / DB
    db.mkdir(parents=True)
    stderr = serve(svc, db.parent, notify[0])
    assert_refused(svc, stderr, notify[1], db, "is not a file (it is a folder)", "move it away", BACKUP)


def test_unreadable_store(svc: ServiceProcess, notify, shared_tmp: Path) -> None:
    # Given a data_dir the service's user owns, holding a store it may not read (mode 000;
    # as root: owned by root, and the service runs as an unprivileged user)
    prefix, uid, gid = unprivileged()
    data_dir = shared_tmp / "data"
    db = make_store(data_dir / DB)
    os.chown(data_dir, uid, gid)
    db.chmod(0)
    assert not stat.S_IMODE(db.stat().st_mode)
    stderr = serve(svc, data_dir, notify[0], prefix)
    assert_refused(svc, stderr, notify[1], db, "cannot open the store", "(Permission denied)", "fix its permissions")


# -- errors raised by the service's own opening, after the checks -------------------------


def test_boot_failure_covers_errors_of_boot_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a service whose checks are skipped, and a folder where its lock file should be
    import edge_queue.service as service

    monkeypatch.setattr(service, "check_data_dir", lambda settings: None)
    settings = Settings(data_dir=tmp_path / "d")
    (settings.data_dir / "edge-queue.lock").mkdir(parents=True)
    svc = service.Service(settings)
    try:
        with pytest.raises(OSError) as raised:
            svc.boot(connect_timeout_s=1)
    finally:
        svc.close()
    # Then the OSError that escaped boot becomes one line naming the file
    failure = boot_failure(settings, raised.value)
    assert failure is not None and str(settings.data_dir / "edge-queue.lock") in failure.message
    # ... but the same kind of error raised anywhere else is left alone (a bug, not a bad store)
    try:
        raise sqlite3.DatabaseError("database disk image is malformed")
    except sqlite3.DatabaseError as e:
        assert boot_failure(settings, e) is None


# -- a file system without working locks (issue 52 row 10) --------------------------------

NO_LOCKS = "without working file locks"


@pytest.fixture(params=["nfs", "posix"])
def no_locks_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A folder on a real mounted file system whose locks fail with ENOLCK (tests/nolock_fs.py,
    FUSE): ``nfs``, every lock fails (an NFS mount without a lock manager); ``posix``, only the
    POSIX record locks SQLite takes fail, ``flock`` is granted (a local ``flock``, some SMB)."""
    need(os.path.exists("/dev/fuse") and shutil.which("fusermount3") is not None, "no FUSE (/dev/fuse, fuse3)")
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as e:
        need(False, f"mfusepy or libfuse 3 missing: {e}")
    source, mountpoint = tmp_path / "disk", tmp_path / "mnt"
    source.mkdir()
    mountpoint.mkdir()
    mode = [] if request.param == "nfs" else ["posix"]
    fs = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("nolock_fs.py")), str(source), str(mountpoint), *mode],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert fs.stderr is not None
    try:
        wait_until(lambda: os.path.ismount(mountpoint) or fs.poll() is not None, 10, "the FUSE mount")
        if not os.path.ismount(mountpoint):
            fs.kill()
            _, err = fs.communicate(timeout=10)
            need(False, f"FUSE mount refused here: {err.decode(errors='replace').strip()}")
        yield mountpoint
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)
        try:
            fs.wait(10)
        except subprocess.TimeoutExpired:
            fs.kill()
            fs.wait(10)
        fs.stderr.close()


def assert_no_locks_line(line: str) -> None:
    assert NO_LOCKS in line and "No locks available" in line and "local disk" in line, line
    # the store is not damaged: never the advice to restore a backup or start an empty one
    assert "backup" not in line and "empty store" not in line and "damaged" not in line, line


def test_new_store_on_a_file_system_without_locks(svc: ServiceProcess, notify, no_locks_dir: Path) -> None:
    # Given data_dir on a mounted file system whose locks fail (before: a 79-line traceback
    # from flock, or after 6 s "could not be opened (database is locked)" with the advice to
    # restore a backup or start with an empty store)
    data_dir = no_locks_dir / "data"
    stderr = serve(svc, data_dir, notify[0])
    # Then one line says the file system has no working locks, and to use a local disk
    line = assert_refused(svc, stderr, notify[1], data_dir, NO_LOCKS)
    assert_no_locks_line(line)


def test_existing_store_on_a_file_system_without_locks_is_left_alone(
    svc: ServiceProcess, notify, tmp_path: Path, no_locks_dir: Path
) -> None:
    # Given a healthy store of 300 jobs copied onto a file system without locks
    local = make_store(tmp_path / "local" / DB)
    data_dir = no_locks_dir / "data"
    data_dir.mkdir()
    shutil.copyfile(local, data_dir / DB)
    before = (data_dir / DB).read_bytes()
    # When the service starts, then the one line names the file system, not the store
    line = assert_refused(svc, serve(svc, data_dir, notify[0]), notify[1], data_dir, NO_LOCKS)
    assert_no_locks_line(line)
    assert (data_dir / DB).read_bytes() == before


def test_doctor_on_a_file_system_without_locks(svc: ServiceProcess, no_locks_dir: Path) -> None:
    # Given data_dir on a file system without locks and no store yet (before: doctor said
    # "ok data_dir ... writable" and "ok database ... does not exist yet")
    data_dir = no_locks_dir / "data"
    out = run_doctor({**svc.env, "EDGE_QUEUE_DATA_DIR": str(data_dir)})
    # Then doctor fails on data_dir with the service's line, and checks no store there
    assert out.returncode != 0, out.stdout
    lines = [line for line in out.stdout.splitlines() if "data_dir" in line]
    assert len(lines) == 1 and lines[0].startswith("FAIL"), out.stdout
    assert_no_locks_line(lines[0])
    assert "database" not in out.stdout, out.stdout


def test_store_held_by_another_program_is_not_called_damaged(svc: ServiceProcess, notify, tmp_path: Path) -> None:
    # Given a healthy store on a local disk that another program holds in an exclusive
    # transaction (a sqlite3 shell's BEGIN EXCLUSIVE; before: "is damaged (database is
    # locked)" with the advice to restore a backup or start with an empty store)
    db = make_store(tmp_path / "d" / DB)
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("PRAGMA journal_mode=DELETE")
    holder.execute("BEGIN EXCLUSIVE")
    try:
        line = assert_refused(svc, serve(svc, db.parent, notify[0]), notify[1], db, "is locked by another program")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert "backup" not in line and "empty store" not in line and "damaged (" not in line, line
