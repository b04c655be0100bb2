"""The reference environment, bench/.venv-ref: the queues edge-queue is compared with, installed
from PyPI at pinned versions, apart from the project's venv (never in it). P1 runs Huey and
Dramatiq in it, P2 Celery (bench/ref/*_drain.py, bench/ref/celery_latency.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from harness import BENCH

REF_VENV = BENCH / ".venv-ref"
#: The reference versions, pinned so that the reference sides measure the same code everywhere
#: (the current releases when they were added). redis-py is pinned too: Dramatiq's RedisBroker
#: and Celery's (kombu's) Redis transport both talk through it.
PINS = {
    "huey": "huey==3.5.4",
    "dramatiq": "dramatiq[redis]==2.2.1",
    "celery": "celery[redis]==5.7.0",
    "redis": "redis==8.2.0",
}


def ref_versions(py: Path) -> dict[str, str] | None:
    """The version of each package of :data:`PINS` in the interpreter ``py`` (``{"huey":
    "3.5.4", ...}``), or None when ``py`` is missing or one of them does not import."""
    if not py.exists():
        return None
    names = list(PINS)
    code = f"import json, {', '.join(names)}; print(json.dumps({{n: __import__(n).__version__ for n in {names!r}}}))"
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        return None
    got: dict[str, str] = json.loads(out.stdout)
    return got


def ensure_ref_venv(log: Any) -> Path:
    """bench/.venv-ref's Python, with every package of :data:`PINS` at its pinned version,
    created on first use. A venv left half-made by an interrupted creation is made again; one
    whose versions differ from the pins (made before a pin was added or moved) is brought to
    them with pip. Raises RuntimeError when a package still does not import after that."""
    py = REF_VENV / "bin" / "python"
    wanted = {n: pin.split("==")[1] for n, pin in PINS.items()}
    have = ref_versions(py)
    if have == wanted:
        return py
    if not py.exists() or subprocess.run([str(py), "-m", "pip", "--version"], capture_output=True).returncode:
        log(f"creating {REF_VENV} (the reference sides of P1 and P2)")
        shutil.rmtree(REF_VENV, ignore_errors=True)
        # With pip (the venv module runs ensurepip itself); -m pip, so no script path matters.
        subprocess.run([sys.executable, "-m", "venv", str(REF_VENV)], check=True)
    log(f"installing {', '.join(PINS.values())} in {REF_VENV}")
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *PINS.values()],
        check=True,
        timeout=900,
    )
    have = ref_versions(py)
    if have != wanted:
        raise RuntimeError(f"{REF_VENV}: {have} after pip install, not the pins {wanted}")
    return py
