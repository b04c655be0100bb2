"""``<base>/ha/diagnostics``: what a bug report needs, as the attributes of Home Assistant's
"Diagnostics" sensor, so that the device's "Download diagnostics" (Home Assistant's MQTT
integration puts every entity's state and attributes in it) carries them: the settings
without secrets, the job counts, the worker nodes, the last failed jobs and the last warnings
and errors logged (docs/home-assistant.md, "Diagnostics").
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from edge_queue.store import iso

#: Warnings and errors kept for the diagnostics (the newest).
RECENT_MAX = 20
#: Characters kept of one logged line.
LINE_MAX = 300
#: Failed jobs listed (the newest).
FAILED_MAX = 10


class RecentProblems(logging.Handler):
    """The last :data:`RECENT_MAX` warnings and errors of edge-queue's loggers."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: deque[dict[str, str]] = deque(maxlen=RECENT_MAX)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):
            message = str(record.msg)
        self.lines.append(
            {"at": iso(record.created), "level": record.levelname, "logger": record.name, "message": message[:LINE_MAX]}
        )


#: The one handler, on the ``edge_queue`` logger (:func:`install`).
PROBLEMS = RecentProblems()


def install() -> None:
    """Keep edge-queue's warnings and errors for the diagnostics (once per process)."""
    root = logging.getLogger("edge_queue")
    if PROBLEMS not in root.handlers:
        root.addHandler(PROBLEMS)


def payload(
    settings: dict[str, Any],
    info: dict[str, Any],
    counts: dict[str, int],
    failed: list[dict[str, Any]],
) -> dict[str, Any]:
    """The diagnostics object: ``generated_at`` (ISO 8601, the sensor's state), ``version``,
    ``instance_id``, ``broker_protocol``, ``settings`` (``model_dump(mode="json")`` of the
    settings: secrets show as ``**********``), ``counts`` (jobs per state), ``nodes``,
    ``conflict`` (other installations on the base topic), ``failed`` (the newest
    :data:`FAILED_MAX` failed jobs: ``job_id``, ``kind``, ``input``, ``error_code``,
    ``error_message``, ``finished_at``) and ``problems`` (the last :data:`RECENT_MAX` warnings
    and errors logged: ``at``, ``level``, ``logger``, ``message``)."""
    return {
        "generated_at": iso(time.time()),
        "version": info.get("version"),
        "instance_id": info.get("instance_id"),
        "broker_protocol": info.get("broker_protocol"),
        "settings": settings,
        "counts": counts,
        "nodes": info.get("nodes") or [],
        "conflict": info.get("conflict") or [],
        "failed": [
            {
                "job_id": j["job_id"],
                "kind": j["kind"],
                "input": j.get("input"),
                "error_code": (j.get("error") or {}).get("code"),
                "error_message": ((j.get("error") or {}).get("message") or "")[:LINE_MAX],
                "finished_at": j.get("finished_at"),
            }
            for j in failed[:FAILED_MAX]
        ],
        "problems": list(PROBLEMS.lines),
    }
