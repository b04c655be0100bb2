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

from .conftest import ROOT, need
from .helpers.docs_text import read, section
from .helpers.ports import free_port

FILES = [
    "container/Containerfile",
    "container/Containerfile.cuda",
    "compose.yaml",
    "compose.external-broker.yaml",
    "container/unraid/edge-queue.xml",
    "container/compose.env.example",
    "addon/edge-queue/Dockerfile",
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
    variables = set(re.findall(r"\bEDGE_QUEUE_[A-Z0-9_]+", text)) - {"EDGE_QUEUE_CONFIG", "EDGE_QUEUE_IN_CONTAINER"}
    # compose.env.example's own variables (interpolated into compose.yaml) are not the service's
    variables -= {"EDGE_QUEUE_MQTT_PASSWORD", "EDGE_QUEUE_NODE_USER", "EDGE_QUEUE_NODE_PASSWORD", "EDGE_QUEUE_BASE"}
    variables -= {"EDGE_QUEUE_IMAGE", "EDGE_QUEUE_BASE_IMAGE"}
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


def _version() -> str:
    return re.search(r'^version = "(.*)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)[1]  # type: ignore[index]


def test_compose_file() -> None:
    doc = yaml.safe_load((ROOT / "compose.yaml").read_text())
    assert set(doc["services"]) == {"mosquitto", "edge-queue", "worker"}
    hub = doc["services"]["edge-queue"]
    assert hub["stop_grace_period"] == "30s" and hub["command"] == ["serve"]
    assert doc["services"]["worker"]["profiles"] == ["worker"]


@pytest.mark.parametrize("file", ["compose.yaml", "compose.external-broker.yaml"])
def test_compose_builds_the_image_of_build_sh(file: str) -> None:
    doc = yaml.safe_load((ROOT / file).read_text())
    for name, service in doc["services"].items():
        # every image compose builds, built with host networking (a box with no bridge, as
        # build.sh builds) and the base image option
        if "build" in service:
            assert service["build"]["network"] == "host", name
            assert service["build"]["args"]["BASE"].startswith("${EDGE_QUEUE_BASE_IMAGE:-"), name
        # edge-queue's image under build.sh's tag (edge-queue:<version>), so an image it built is used
        if name in ("edge-queue", "worker"):
            assert service["image"] == f"${{EDGE_QUEUE_IMAGE:-edge-queue:{_version()}}}", name
        # and /media read-only unless .env says rw (docs/install.md: read-only is enough)
        for volume in service.get("volumes", []):
            if volume.endswith(":/media") or ":/media:" in volume:
                assert volume.endswith(":/media:${MEDIA_ACCESS:-ro}"), (name, volume)


def test_compose_for_a_broker_already_running_has_no_broker_of_its_own() -> None:
    doc = yaml.safe_load((ROOT / "compose.external-broker.yaml").read_text())
    assert set(doc["services"]) == {"edge-queue"}
    hub = doc["services"]["edge-queue"]
    # the box's network: a broker on this box is 127.0.0.1, even one that listens on the
    # loopback only; the page and the API on the box's ports (docker-compose 1.29 refuses
    # ports: with network_mode: host)
    assert hub["network_mode"] == "host" and "ports" not in hub
    env = hub["environment"]
    assert env["EDGE_QUEUE_MQTT__HOST"] == "${MQTT_HOST:-127.0.0.1}"
    assert env["EDGE_QUEUE_HTTP__PORT"] == "${PAGE_PORT:-8099}" and env["EDGE_QUEUE_API__PORT"] == "${API_PORT:-9000}"
    assert hub["stop_grace_period"] == "30s" and hub["build"]["dockerfile"] == "container/Containerfile"


def _env_lines(text: str) -> list[str]:
    """compose.env.example's settings, the commented ones (``#NAME=value``) too."""
    return [line.lstrip("#") for line in text.splitlines() if re.match(r"#?[A-Z][A-Z0-9_]*=", line)]


def test_every_line_of_the_env_example_is_a_setting_as_it_stands() -> None:
    # an env file has no comments after a value: uncommenting a line must give the value alone
    lines = _env_lines((ROOT / "container" / "compose.env.example").read_text())
    assert "MQTT_USERNAME=edge-queue" in lines and "MQTT_HOST=127.0.0.1" in lines, lines
    for line in lines:
        name, value = line.split("=", 1)
        if name != "MQTT_USERS":  # pairs separated by spaces
            assert re.fullmatch(r"[^\s#'\"]*", value), line


@pytest.mark.parametrize(("username", "expected"), [(None, "edge-queue"), ("", ""), ("ha", "ha")])
def test_the_external_broker_login_may_be_left_empty(tmp_path: Path, username: str | None, expected: str) -> None:
    compose = shutil.which("docker-compose")
    need(compose is not None, "docker-compose is not installed (apt-get install docker-compose)")
    # Given .env from compose.env.example, its external broker's lines uncommented, and
    # MQTT_USERNAME unset, set empty (a broker without logins) or set
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(ROOT / "compose.external-broker.yaml", project)
    lines = [line for line in _env_lines((ROOT / "container" / "compose.env.example").read_text())]
    lines = [line for line in lines if not line.startswith("MQTT_USERNAME=")]
    if username is not None:
        lines.append(f"MQTT_USERNAME={username}")
    (project / ".env").write_text("\n".join(lines) + "\n")
    # When docker-compose reads the file
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MQTT_", "EDGE_QUEUE_"))}
    done = subprocess.run(
        [str(compose), "-f", "compose.external-broker.yaml", "config"],
        cwd=project, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    # Then the service's user is the one given, empty too (edge-queue then logs in without one)
    assert done.returncode == 0, done.stderr
    hub = yaml.safe_load(done.stdout)["services"]["edge-queue"]
    assert (hub["environment"].get("EDGE_QUEUE_MQTT__USERNAME") or "") == expected, hub["environment"]
    assert hub["environment"]["EDGE_QUEUE_MQTT__HOST"] == "127.0.0.1"
    assert hub["volumes"][-1].endswith(":/media:ro"), hub["volumes"]


def _compose_project(tmp_path: Path, file: str) -> Path:
    """A copy of the project's compose files, compose-up.sh, pyproject.toml (the version) and
    build.sh, with a media folder."""
    project = tmp_path / "project"
    (project / "container").mkdir(parents=True)
    (project / "media").mkdir()
    for name in ("compose-up.sh", "build.sh"):
        shutil.copy(ROOT / "container" / name, project / "container")
    shutil.copy(ROOT / file, project)
    shutil.copy(ROOT / "pyproject.toml", project)
    return project


def _compose_up(project: Path, env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """container/compose-up.sh of a copy of the project, its compose command and its container
    engine scripts that record how they were called (``ps -q``: nothing is up; ``image
    inspect``: the image is there once the engine's ``build`` has run, or ``built`` exists)."""
    calls = project / "calls"
    fake = project / "fake-compose"
    fake.write_text(f'#!/bin/sh\necho "$* COMPOSE_HTTP_TIMEOUT=$COMPOSE_HTTP_TIMEOUT" >> {calls}\n')
    fake.chmod(0o755)
    engine = project / "fake-engine"
    engine.write_text(
        f'#!/bin/sh\necho "engine $*" >> {calls}\n'
        f'case "$1" in image) [ -e {project}/built ] ;; build) touch {project}/built ;; esac\n'
    )
    engine.chmod(0o755)
    done = subprocess.run(
        [str(project / "container" / "compose-up.sh"), *args],
        env={**os.environ, "ENGINE": str(engine), **env, "COMPOSE": str(fake)},
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    return done, calls.read_text() if calls.exists() else ""


@pytest.mark.parametrize("file", ["compose.yaml", "compose.external-broker.yaml"])
def test_compose_up_names_a_taken_port_before_starting_anything(tmp_path: Path, file: str) -> None:
    project = _compose_project(tmp_path, file)
    (project / "built").touch()
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
    assert calls.splitlines()[-1] == f"-f {file} --profile worker up -d COMPOSE_HTTP_TIMEOUT=300", calls


def test_compose_up_builds_the_image_of_build_sh_keeps_every_file_and_checks_media_dir(tmp_path: Path) -> None:
    project = _compose_project(tmp_path, "compose.yaml")
    shutil.copy(ROOT / "compose.external-broker.yaml", project)
    (project / "override.yaml").write_text("services: {}\n")
    ports = "".join(f"{n}={free_port()}\n" for n in ("MQTT_PORT", "MQTT_WEBSOCKET_PORT", "PAGE_PORT", "API_PORT"))
    # Given a MEDIA_DIR that is not there (Docker would mount a new empty folder as /media)
    (project / ".env").write_text(ports + "MEDIA_DIR=./recordings\n")
    done, calls = _compose_up(project, {}, "-f", "compose.external-broker.yaml", "-f", "override.yaml")
    # Then nothing starts, and the message names it and its setting
    assert done.returncode == 1 and "MEDIA_DIR ./recordings is not a folder" in done.stderr, done.stderr
    assert "up" not in calls.split() and "build" not in calls, calls
    # Given the folder there, and no image yet
    (project / "recordings").mkdir()
    done, calls = _compose_up(
        project, {"PIP_CERT": "/nonexistent"}, "-f", "compose.external-broker.yaml", "-f", "override.yaml"
    )
    # Then build.sh builds it under the tag compose names, with host networking, and every -f
    # reaches compose, in order
    assert done.returncode == 0, done.stderr
    (build,) = [line for line in calls.splitlines() if line.startswith("engine build")]
    assert f"-t edge-queue:{_version()} ." in build and "--network host" in build, build
    assert calls.splitlines()[-1].startswith("-f compose.external-broker.yaml -f override.yaml up -d"), calls
    # and once built, it is not built again
    done, calls = _compose_up(project, {}, "-f", "compose.external-broker.yaml")
    assert done.returncode == 0 and calls.count("engine build") == 1, calls


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
