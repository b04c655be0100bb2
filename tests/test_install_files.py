"""The install files (docs/install.md) name only real settings: every ``EDGE_QUEUE_*`` variable
of the Containerfiles, compose.yaml and the Unraid template is a configuration key the service
takes, compose.yaml is valid YAML with the services the docs name, and the Unraid template is
the XML Community Applications reads. The images themselves: tests/test_container.py."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from edge_queue.config.settings import Settings, load_settings

from .conftest import ROOT, free_port
from .helpers.docs_text import read, section

FILES = [
    "container/Containerfile",
    "container/Containerfile.cuda",
    "compose.yaml",
    "compose.external-broker.yaml",
    "container/unraid/edge-queue.xml",
    "container/compose.env.example",
    "addon/edge-queue/run.py",
    "docs/install.md",
]


def known(variable: str) -> bool:
    """True when ``EDGE_QUEUE_A__B`` names the key ``a.b`` of the settings."""
    parts = variable.removeprefix("EDGE_QUEUE_").lower().split("__")
    model: object = Settings
    for part in parts:
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            return False
        model = fields[part].annotation
    return True


@pytest.mark.parametrize("path", FILES)
def test_every_variable_is_a_configuration_key(path: str) -> None:
    text = (ROOT / path).read_text()
    variables = set(re.findall(r"\bEDGE_QUEUE_[A-Z0-9_]+", text)) - {"EDGE_QUEUE_CONFIG"}
    # compose.env.example's own variables (interpolated into compose.yaml) are not the service's
    variables -= {"EDGE_QUEUE_MQTT_PASSWORD", "EDGE_QUEUE_NODE_USER", "EDGE_QUEUE_NODE_PASSWORD", "EDGE_QUEUE_BASE"}
    unknown = sorted(v for v in variables if not known(v))
    assert unknown == [], f"{path} names variables that are no configuration key: {unknown}"


def test_the_settings_install_md_gives_as_a_file_and_as_variables_are_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given docs/install.md's "Where each setting goes": one example as a configuration file, and
    # the same as compose.yaml's environment
    text = section(read("install.md"), re.compile(r"^### Where each setting goes"))
    (toml,) = re.findall(r"```toml\n(.*?)```", text, re.DOTALL)
    (compose,) = re.findall(r"```yaml\n(.*?)```", text, re.DOTALL)
    variables = yaml.safe_load(compose)["environment"]
    assert variables and all(known(v) for v in variables), variables
    for var in list(os.environ):
        if var.upper().startswith("EDGE_QUEUE_"):
            monkeypatch.delenv(var)
    (tmp_path / "config.toml").write_text(toml)
    # When the service reads either
    from_file = load_settings(tmp_path / "config.toml").model_dump(mode="json")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    from_variables = load_settings(None).model_dump(mode="json")
    # Then both set the same keys, away from their defaults
    assert from_file == from_variables
    assert from_file["api"]["anonymous_user"] == "bazarr" and from_file["access"]["users"] == ["bazarr"]


def test_compose_file() -> None:
    doc = yaml.safe_load((ROOT / "compose.yaml").read_text())
    assert set(doc["services"]) == {"mosquitto", "edge-queue", "worker"}
    hub = doc["services"]["edge-queue"]
    assert hub["stop_grace_period"] == "30s" and hub["command"] == ["serve"]
    assert doc["services"]["worker"]["profiles"] == ["worker"]


def test_compose_for_a_broker_already_running_has_no_broker_of_its_own() -> None:
    doc = yaml.safe_load((ROOT / "compose.external-broker.yaml").read_text())
    assert set(doc["services"]) == {"edge-queue"}
    hub = doc["services"]["edge-queue"]
    assert hub["environment"]["EDGE_QUEUE_MQTT__HOST"].startswith("${MQTT_HOST:?")
    assert hub["stop_grace_period"] == "30s" and hub["build"]["dockerfile"] == "container/Containerfile"


def _compose_up(project: Path, env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """container/compose-up.sh of a copy of the project, its compose command a script that
    records how it was called (``ps -q``: nothing is up)."""
    calls = project / "calls"
    fake = project / "fake-compose"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    fake.chmod(0o755)
    done = subprocess.run(
        [str(project / "container" / "compose-up.sh"), *args],
        env={**os.environ, **env, "COMPOSE": str(fake)}, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    return done, calls.read_text() if calls.exists() else ""


@pytest.mark.parametrize("file", ["compose.yaml", "compose.external-broker.yaml"])
def test_compose_up_names_a_taken_port_before_starting_anything(tmp_path: Path, file: str) -> None:
    project = tmp_path / "project"
    (project / "container").mkdir(parents=True)
    shutil.copy(ROOT / "container" / "compose-up.sh", project / "container")
    shutil.copy(ROOT / file, project)
    # Given a box where something listens on the port .env gives the page (and, for
    # compose.yaml, on the broker's: a broker already runs there, as on most NAS)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(16)
    port = taken.getsockname()[1]
    mqtt = port if file == "compose.yaml" else free_port()
    (project / ".env").write_text(
        f"MQTT_PORT={mqtt}\nMQTT_WEBSOCKET_PORT={free_port()}\nPAGE_PORT={port}\nAPI_PORT={free_port()}\n"
    )
    try:
        # When compose-up.sh is run
        started = time.monotonic()
        done, calls = _compose_up(project, {}, "-f", file)
    finally:
        taken.close()
    # Then it says at once which port is taken and which setting moves it, and starts nothing
    assert done.returncode == 1 and time.monotonic() - started < 10, done.stderr
    assert f"port {port} on this box is in use (PAGE_PORT)" in done.stderr, done.stderr
    assert ("compose.external-broker.yaml" in done.stderr) == (file == "compose.yaml"), done.stderr
    assert "up" not in calls.split(), calls
    # and with the port free (moved in .env), it brings the project up
    done, calls = _compose_up(project, {}, "-f", file, "--profile", "worker")
    assert done.returncode == 0, done.stderr
    assert calls.splitlines()[-1] == f"-f {file} --profile worker up -d", calls


def test_unraid_template() -> None:
    root = ET.parse(ROOT / "container" / "unraid" / "edge-queue.xml").getroot()
    assert root.tag == "Container" and root.findtext("Repository", "").startswith("edge-queue:")
    targets = {c.get("Target") for c in root.iter("Config")}
    assert {"8099", "/data", "/media", "EDGE_QUEUE_MQTT__HOST"} <= targets


def test_add_on_options_and_schema() -> None:
    config = yaml.safe_load((ROOT / "addon" / "edge-queue" / "config.yaml").read_text())
    assert set(config["options"]) == set(config["schema"])
    assert config["ingress"] is True and config["ingress_port"] == 8099
    assert "mqtt:want" in config["services"] and {"share:rw", "media:rw"} <= set(config["map"])
    documented = (ROOT / "docs" / "install.md").read_text()
    for option in config["options"]:
        assert f"`{option}`" in documented, f"the add-on's option {option} is not in docs/install.md"


def test_the_health_check_answers_healthy_without_a_refusal_in_the_log(
    mosquitto, service_factory, tmp_path: Path
) -> None:
    # Given a hub with its queue page and its HTTP API (which asks a key of every caller)
    media = tmp_path / "media"
    media.mkdir()
    page, api = free_port(), free_port()
    env = {
        "EDGE_QUEUE_HTTP__ENABLED": "true",
        "EDGE_QUEUE_HTTP__HOST": "127.0.0.1",
        "EDGE_QUEUE_HTTP__PORT": str(page),
        "EDGE_QUEUE_API__ENABLED": "true",
        "EDGE_QUEUE_API__HOST": "127.0.0.1",
        "EDGE_QUEUE_API__PORT": str(api),
        "EDGE_QUEUE_API__KEYS": '{"bazarr": "3f7c9a1e5b2d4c6e8f0a1b2c3d4e5f60"}',
    }
    svc = service_factory(mosquitto, [media], env).start()
    # When the container's health check runs, as often as Docker runs it
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, str(ROOT / "container" / "healthcheck.py")],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=30,
        )
        # Then it is healthy
        assert done.returncode == 0, done.stdout + done.stderr
    # and leaves no refused call in the log (a line every 30 s, for ever)
    assert "refused" not in svc.log(), svc.log()
    # and with the page off, it asks the API, which answers (a 401 counts)
    done = subprocess.run(
        [sys.executable, str(ROOT / "container" / "healthcheck.py")],
        env={**os.environ, **env, "EDGE_QUEUE_HTTP__PORT": str(free_port())},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stdout + done.stderr
