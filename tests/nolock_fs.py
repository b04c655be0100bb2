"""A real file system whose file locks fail, as on an NFS mount without a lock manager
(``nolock`` absent, no ``rpc.statd``/``lockd``) or an SMB mount without byte-range locks:
every ``fcntl`` lock and every ``flock`` is answered ``ENOLCK`` ("No locks available"), while
reads, writes, ``fsync`` and shared ``mmap`` work.

It is a FUSE pass-through (mfusepy on libfuse 3) over a folder of the local disk, run as a
process of its own: ``python tests/nolock_fs.py SOURCE MOUNTPOINT [posix]`` stays in the
foreground until unmounted (``fusermount3 -u MOUNTPOINT``). With ``posix``, only POSIX record
locks (SQLite's) fail and every ``flock`` is granted, as a process alone sees an NFS mount
whose ``flock`` is local (``local_lock=flock``) or an SMB mount without byte-range locks.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any

import mfusepy as fuse


class NoLocks(fuse.Operations):
    """Pass-through to ``root``, with every lock refused (``flock`` granted when
    ``flock_granted``: one process's view of a local ``flock``)."""

    use_ns = True

    def __init__(self, root: str, flock_granted: bool = False) -> None:
        self.root = root
        self.flock_granted = flock_granted

    def _full(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    # -- the locks: what a file system without a lock manager answers ------------------

    def lock(self, path: str, fh: int, cmd: int, lock: Any) -> int:
        return -errno.ENOLCK

    def flock(self, path: str, fh: int, op: int) -> int:
        return 0 if self.flock_granted else -errno.ENOLCK

    # -- everything else passes through ---------------------------------------------------

    def access(self, path: str, amode: int) -> int:
        if not os.access(self._full(path), amode):
            raise fuse.FuseOSError(errno.EACCES)
        return 0

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        st = os.lstat(self._full(path))
        keys = ("st_gid", "st_mode", "st_nlink", "st_size", "st_uid")
        times = {key: getattr(st, key + "_ns") for key in ("st_atime", "st_ctime", "st_mtime")}
        return {key: getattr(st, key) for key in keys} | times

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *os.listdir(self._full(path))]

    def chmod(self, path: str, mode: int) -> int:
        os.chmod(self._full(path), mode)
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        os.chown(self._full(path), uid, gid)
        return 0

    def mkdir(self, path: str, mode: int) -> int:
        os.mkdir(self._full(path), mode)
        return 0

    def rmdir(self, path: str) -> int:
        os.rmdir(self._full(path))
        return 0

    def unlink(self, path: str) -> int:
        os.unlink(self._full(path))
        return 0

    def rename(self, old: str, new: str) -> int:
        os.rename(self._full(old), self._full(new))
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        os.utime(self._full(path), ns=times)
        return 0

    def statfs(self, path: str) -> dict[str, Any]:
        sv = os.statvfs(self._full(path))
        keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag", "f_frsize")
        return {key: getattr(sv, key) for key in keys} | {"f_namemax": sv.f_namemax}

    def open(self, path: str, flags: int) -> int:
        return os.open(self._full(path), flags)

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        return os.open(self._full(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return os.pread(fh, size, offset)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        return os.pwrite(fh, data, offset)

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        if fh is None:
            os.truncate(self._full(path), length)
        else:
            os.ftruncate(fh, length)
        return 0

    def flush(self, path: str, fh: int) -> int:
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        os.fsync(fh)
        return 0

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0


class _Fuse(fuse.FUSE):
    """mfusepy's FUSE with libfuse's ``flock`` operation wired (mfusepy leaves it out), so the
    kernel sends ``flock`` to the file system instead of emulating it locally."""

    def flock(self, path: bytes | None, fip: Any, op: int) -> int:
        return int(self.operations.flock(path.decode() if path else "", 0, op))


def main() -> None:
    source, mountpoint = sys.argv[1], sys.argv[2]
    _Fuse(NoLocks(source, sys.argv[3:] == ["posix"]), mountpoint, foreground=True, nothreads=True, allow_other=True)


if __name__ == "__main__":
    main()
