"""The house style holds: ruff (lint and format) and mypy are clean on the package."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, need

BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    need(path is not None, f"{name} not installed (pip install -e '.[test]')")
    assert path is not None
    return path


@pytest.mark.parametrize(
    "args", [["check", "edge_queue", "tests", "bench"], ["format", "--check", "edge_queue", "tests"]]
)
def test_ruff(args: list[str]) -> None:
    out = subprocess.run([_tool("ruff"), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
def test_mypy() -> None:
    out = subprocess.run([_tool("mypy"), "edge_queue"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
