"""The README's test command (README.md, "Run the tests"), which ``.ci/run`` runs: both parts of
the suite always run, and the command fails when either failed.

The command is run as written, by bash, in a folder whose ``python3``, ``.venv/bin/pip`` and
``.venv/bin/pytest`` are scripts that record their arguments and end with a chosen status:
interactively (``bash -c``) and as ``.ci/run`` runs it (under ``set -euo pipefail``).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from .conftest import ROOT

FAKE = """#!/bin/sh
echo "$(basename "$0") $*" >> "{log}"
case "$*" in *"{fail}"*) exit 1;; esac
exit 0
"""


def readme_command() -> str:
    """The fenced command under "Run the tests" that installs and runs the whole suite."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Run the tests", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```sh\n(.*?)\n```", section, re.DOTALL)
    whole = [c for c in commands if "python3 -m venv" in c]
    assert len(whole) == 1, commands
    return whole[0]


def run(command: str, tmp_path: Path, fail: str, strict: bool) -> tuple[int, list[str]]:
    """Runs ``command`` with fake tools; the pytest run whose arguments contain ``fail`` fails.
    Returns the exit status and the recorded calls of pytest."""
    log = tmp_path / "calls.log"
    log.unlink(missing_ok=True)
    bin_dir = tmp_path / "bin"
    venv_bin = tmp_path / ".venv" / "bin"
    for folder, name in ((bin_dir, "python3"), (venv_bin, "pip"), (venv_bin, "pytest")):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(FAKE.format(log=log, fail=fail or "\x00never"), encoding="utf-8")
        (folder / name).chmod(0o755)
    script = ("set -euo pipefail\n" if strict else "") + command + "\n"
    done = subprocess.run(
        ["bash", "-c", script],
        cwd=tmp_path,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    calls = log.read_text(encoding="utf-8").splitlines() if log.exists() else []
    return done.returncode, [c for c in calls if c.startswith("pytest ")]


def test_ci_runs_the_readme_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert readme_command() in ci.splitlines()


@pytest.mark.parametrize("strict", [False, True], ids=["shell", "ci"])
@pytest.mark.parametrize(
    ("fail", "status"),
    [("", 0), ("not serial", 1), ("-m serial", 1)],
    ids=["all pass", "parallel part fails", "serial part fails"],
)
def test_both_parts_run_and_either_failure_fails_the_command(
    tmp_path: Path, fail: str, status: int, strict: bool
) -> None:
    code, calls = run(readme_command(), tmp_path, fail, strict)
    assert calls == ["pytest -n 4 --dist worksteal -m not serial --durations=25", "pytest -m serial --durations=25"]
    assert (code != 0) == bool(status), (code, calls)
