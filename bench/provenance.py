"""What a benchmark run records beside its figures: the machine (CPU, cores, memory, kernel, broker,
file system, load when the run began), the commit measured, and the versions of the packages
compared."""

from __future__ import annotations

import os
import platform
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mosq = "unknown"
    try:
        out = subprocess.run(["mosquitto", "-h"], capture_output=True, text=True, timeout=5)
        mosq = (out.stdout or out.stderr).splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        pass
    return {
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "mosquitto": mosq,
        "data_dir_fs": _fs_of(Path(tempfile.gettempdir())),
        # what else the machine was doing when the run began: 1, 5 and 15-minute load averages
        "load_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def _fs_of(path: Path) -> str:
    best = ("", "?")
    for p in psutil.disk_partitions(all=True):
        if str(path).startswith(p.mountpoint) and len(p.mountpoint) > len(best[0]):
            best = (p.mountpoint, p.fstype)
    return f"{path} on {best[0]} ({best[1]})"


def code_state() -> dict[str, Any]:
    """The commit measured, and which files of the package differ from it."""

    def git(*args: str) -> str:
        try:
            out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout
            return out.rstrip("\n")  # not strip(): porcelain lines start with a space
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "commit": git("rev-parse", "HEAD"),
        "modified": git("status", "--porcelain", "--", "edge_queue").splitlines(),
    }


def versions(names: Iterable[str]) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for n in names:
        try:
            out[n] = version(n)
        except PackageNotFoundError:
            out[n] = "not installed"
    return out
