"""docs/home-assistant.md as its tests read it: its YAML blocks by what they are, the names its
examples use, the blueprint, Home Assistant's configuration for the blocks, its notifications."""

from __future__ import annotations

import re
from typing import Any

from ..conftest import ROOT

DOC = ROOT / "docs" / "home-assistant.md"
#: What the page's examples name, and the reader replaces with their own.
DOC_BASE, DOC_EVENT, DOC_JOB, DOC_CLIP = (
    "edge-queue/",
    "event.edge_queue_nas_job_finished",
    "0mx1jjxvpdif6c43",
    "/srv/media/doorbell/latest.mp4",
)
#: Home Assistant's configuration for the page's blocks: the files a stock configuration.yaml
#: includes, and the phone.
EXTRA_YAML = """\
automation: !include automations.yaml
script: !include scripts.yaml
mqtt: !include edge_queue_mqtt.yaml
notify:
  - platform: group
    name: mobile_app_my_phone
    services:
      - action: persistent_notification
"""


def blocks() -> dict[str, str]:
    """The page's YAML blocks by what they are; a block of another shape fails here (a new
    example needs its check in this module)."""
    found: dict[str, str] = {}
    for block in re.findall(r"```yaml\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S):
        first = block.splitlines()[0]
        what = next(
            (
                name
                for name, start in [
                    ("ui_automation", "alias: "),
                    ("sensors", "mqtt:"),
                    ("script", "edge_queue_transcribe_doorbell:"),
                    ("card", "type: button"),
                    ("script_use", "- id: edge_queue_transcribe_voicemail"),
                    ("automations", "- id: "),
                    ("logbook", "logbook:"),
                ]
                if first.startswith(start)
            ),
            None,
        )
        assert what is not None and what not in found, (
            f"a YAML block of docs/home-assistant.md this test does not know: {block}"
        )
        found[what] = block
    return found


def notifications(h: Any, inst: dict[str, Any]) -> list[dict[str, Any]]:
    """The persistent notifications of this run of Home Assistant (any other one, such as an
    invalid configuration's, counts too)."""
    return list(h.ws_call(inst, "persistent_notification/get"))


BLUEPRINT = ROOT / "docs" / "blueprints" / "notify_job_finished.yaml"
