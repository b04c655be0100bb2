"""``<base>/ha/diagnostics`` (edge_queue/publish/ha_diagnostics.py; docs/home-assistant.md,
"Diagnostics"): no secret in it, and the last warnings bounded. Milliseconds."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from edge_queue.config.settings import Settings
from edge_queue.publish import ha_diagnostics


def test_the_diagnostics_hold_no_secret(tmp_path: Path) -> None:
    settings = Settings(
        data_dir=tmp_path,
        mqtt={"username": "edge", "password": "hunter2-secret"},
        api={"keys": {"bazarr": "k" * 32}},
    )
    body = ha_diagnostics.payload(settings.model_dump(mode="json"), {"version": "1"}, {"queued": 0}, [])
    text = json.dumps(body)
    assert "hunter2-secret" not in text and "k" * 32 not in text, text
    assert body["settings"]["mqtt"]["username"] == "edge"


def test_the_last_warnings_are_kept_bounded() -> None:
    ha_diagnostics.install()
    ha_diagnostics.install()  # once per process, however often asked
    log = logging.getLogger("edge_queue.test")
    for i in range(ha_diagnostics.RECENT_MAX + 5):
        log.warning("problem %d %s", i, "x" * 1000)
    log.info("not a problem")
    lines = ha_diagnostics.PROBLEMS.lines
    assert len(lines) == ha_diagnostics.RECENT_MAX
    assert lines[-1]["message"].startswith(f"problem {ha_diagnostics.RECENT_MAX + 4} ")
    assert all(len(x["message"]) <= ha_diagnostics.LINE_MAX for x in lines)
    assert logging.getLogger("edge_queue").handlers.count(ha_diagnostics.PROBLEMS) == 1
