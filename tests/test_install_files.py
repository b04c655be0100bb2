"""The install files (docs/install.md) name only real settings: every ``EDGE_QUEUE_*`` variable
of the Containerfiles, compose.yaml and the Unraid template is a configuration key the service
takes, compose.yaml is valid YAML with the services the docs name, and the Unraid template is
the XML Community Applications reads. The images themselves: tests/test_container.py."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest
import yaml

from edge_queue.config import Settings

from .conftest import ROOT

FILES = [
    "container/Containerfile",
    "container/Containerfile.cuda",
    "compose.yaml",
    "container/unraid/edge-queue.xml",
    "container/compose.env.example",
    "addon/edge-queue/run.py",
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


def test_compose_file() -> None:
    doc = yaml.safe_load((ROOT / "compose.yaml").read_text())
    assert set(doc["services"]) == {"mosquitto", "edge-queue", "worker"}
    hub = doc["services"]["edge-queue"]
    assert hub["stop_grace_period"] == "30s" and hub["command"] == ["serve"]
    assert doc["services"]["worker"]["profiles"] == ["worker"]


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
