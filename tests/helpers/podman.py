"""podman as the container tests run it here: the runc runtime, cgroupfs, and ulimits no higher
than the host's (runc cannot raise them here); containers on the host's network, removed after
the test (the ``containers`` fixture)."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator

import pytest

PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]
#: ulimits no higher than the host's (runc cannot raise them here)
LIMITS = ["--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"]


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``podman <args>`` (with :data:`PODMAN`'s options), its output as text; raises
    ``CalledProcessError`` when ``check`` and it fails."""
    return subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout, check=check)


@pytest.fixture
def containers() -> Iterator[list[str]]:
    """The names of the containers a test started (:func:`run_container`), removed after it."""
    names: list[str] = []
    yield names
    for name in names:
        podman("rm", "-f", "-t", "0", name, check=False, timeout=60)


def run_container(image: str, names: list[str], *args: str, env: dict[str, str], command: list[str]) -> str:
    """Start ``image`` detached on the host's network with ``env`` and the further ``podman run``
    ``args`` (mounts, say), its name added to ``names``; the name."""
    name = f"eqtest-{uuid.uuid4().hex[:8]}"
    names.append(name)
    flags = [f"--env={k}={v}" for k, v in env.items()]
    podman("run", "-d", "--name", name, "--network", "host", *LIMITS, *flags, *args, image, *command)
    return name
