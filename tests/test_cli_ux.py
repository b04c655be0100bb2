"""The command line as its user expects it (issue 34, item 15): a version, help for a bare
command, help that names values instead of showing type tags, a doctor coloured on a terminal,
and ``submit --wait`` saying when the queue is paused. Real subprocesses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from edge_queue.cli import main as cli

from .conftest import ServiceProcess, publish, wait_until

#: Typer's type tags, which --help must not show.
TYPE_TAG = re.compile(r"<(bool|str|int|float|path|list\[|int range|float range)")


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edge_queue", *args],
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


def command_paths() -> list[list[str]]:
    """Every command and group of the command line, as argument lists (``[]`` is the root)."""
    found: list[list[str]] = []

    def walk(cmd: object, path: list[str]) -> None:
        found.append(path)
        for name, sub in (getattr(cmd, "commands", None) or {}).items():
            walk(sub, [*path, name])

    walk(typer.main.get_command(cli.app), [])
    return found


def test_version_and_a_bare_command_show_what_they_should() -> None:
    version = run("--version")
    assert version.returncode == 0 and re.fullmatch(r"edge-queue \S+\n", version.stdout), version
    for bare in ([], ["config"]):
        out = run(*bare)
        assert out.returncode == 0, out
        assert "Usage: edge-queue" in out.stdout and "Commands" in out.stdout, out.stdout


@pytest.mark.slow
def test_help_names_values_and_shows_no_type_tags() -> None:
    paths = command_paths()
    assert len(paths) >= 12, paths
    for path in paths:
        out = run(*path, "--help")
        assert out.returncode == 0, (path, out.stderr)
        assert not TYPE_TAG.search(out.stdout), (path, out.stdout)
    submit = run("submit", "--help").stdout
    for shown in ("--kind", "KIND", "KEY=VALUE", "SECONDS", "FILE"):
        assert shown in submit, submit


@pytest.mark.slow
def test_doctor_is_coloured_on_a_terminal_only(mosquitto, tmp_path: Path) -> None:
    svc = ServiceProcess(mosquitto, tmp_path, [tmp_path])  # not started: its status check warns
    # On a terminal (a pseudo-terminal): every mark coloured
    primary, secondary = os.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "edge_queue", "doctor", "--skip-model"],
        env=svc.env,
        stdout=secondary,
        stderr=subprocess.DEVNULL,
    )
    os.close(secondary)
    chunks = []
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # EIO: the other end closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(primary)
    assert proc.wait(timeout=60) in (0, 1)
    shown = b"".join(chunks).decode()
    marks = re.findall(r"^(\x1b\[[0-9;\[m\x1b]*)(ok|warn|FAIL)\x1b\[0m ", shown, re.M)
    assert len(marks) == len(shown.strip().splitlines()), shown
    assert {m[1] for m in marks} == {"ok", "warn"} and all(m[0].startswith(("\x1b[32m", "\x1b[33m")) for m in marks), (
        marks
    )
    # In a pipe: none
    piped = subprocess.run(
        [sys.executable, "-m", "edge_queue", "doctor", "--skip-model"], env=svc.env, capture_output=True, text=True
    )
    assert "\x1b" not in piped.stdout and re.search(
        r"^ok {4}broker: .*\n^ok {4}grants: .*\n^warn  service: ", piped.stdout, re.M
    ), piped.stdout


def test_submit_wait_says_the_queue_is_paused(mosquitto, service_factory, tmp_path: Path) -> None:
    # Given a paused queue
    svc = service_factory(mosquitto, [tmp_path]).start()
    w = svc.watcher("queue")
    publish(mosquitto, f"{svc.base}/request/pause", '{"paused": true}')
    w.wait_json(f"{svc.base}/queue", lambda q: q["paused"] is True)
    w.close()
    # When a job is submitted and waited on
    out = subprocess.run(
        [sys.executable, "-m", "edge_queue", "submit", "-k", "noop", "x", "--wait", "--timeout", "3"],
        env={**svc.env, "EDGE_QUEUE_LOG_LEVEL": "WARNING", "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    # Then it says why the job does not start, while waiting and at the timeout
    assert out.returncode == 1, out
    assert "queued (the queue is paused: resume it to start)" in out.stderr, out.stderr
    assert out.stderr.rstrip().endswith("still not finished; the queue is paused: resume it to start"), out.stderr
    wait_until(lambda: svc.stop() == 0, 30, "the service stopped")


def test_first_job_says_where_mosquitto_pub_comes_from() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    first_job = readme.split("## First job", 1)[1].split("\n## ", 1)[0]
    assert "mosquitto_pub" in first_job and "apt-get install mosquitto-clients" in first_job, first_job


def test_the_commands_entry_takes_ctrl_c_before_it_imports_anything_more() -> None:
    # The entry module sets its SIGINT handler first thing (before, it imported typing first,
    # and a Ctrl-C landing there in CI gave a KeyboardInterrupt traceback through launch.py)
    probe = (
        "import sys, signal; before = set(sys.modules); import edge_queue.cli.launch; "
        "print(signal.getsignal(signal.SIGINT).__module__ == 'edge_queue.cli.launch', "
        "sorted(set(sys.modules) - before - {'edge_queue', 'edge_queue.cli', 'edge_queue.cli.launch'}))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "True []", out.stdout


def test_version_imports_nothing_after_the_command_line() -> None:
    # a Ctrl-C lands as a KeyboardInterrupt once the command line is imported: `--version` must
    # not import more of the package then (before: it imported the service's announcer, and a
    # Ctrl-C inside pydantic-core's validator building came out as a SchemaError traceback)
    code = (
        "import sys; from edge_queue.cli.launch import main; import edge_queue.cli.main; "
        "before = set(sys.modules); sys.argv = ['edge-queue', '--version']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in set(sys.modules) - before if m.startswith('edge_queue')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "[]", out.stdout


def test_ctrl_c_while_the_command_starts_ends_it_quietly() -> None:
    # Ctrl-C within the first moments of a command, while Python still imports it (before: a
    # KeyboardInterrupt traceback from inside the imports)
    import signal
    import time

    command = str(Path(sys.executable).parent / "edge-queue")
    codes = []
    for delay in (0.08, 0.12, 0.16, 0.2, 0.25, 0.3, 0.4, 0.5):
        proc = subprocess.Popen([command, "--version"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(delay)  # the moment of the Ctrl-C itself
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        if ("Traceback" in err or "init_import_site" in err) and "/edge_queue/" not in err:
            # it landed before any of edge-queue ran (a loaded box): in Python's own start-up, or
            # in the console script's import of the entry point, whose frames are not ours
            continue
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, (delay, err)
        codes.append(proc.returncode)
    # an interrupted command ends with 130 (or of SIGINT itself: shells report both as 130); some
    # tries landed in the imports
    assert set(codes) <= {0, 130, -signal.SIGINT} and 130 in codes, codes
