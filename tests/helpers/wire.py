"""The bridge as the node room sees it: a place for its handler, and publish (what was sent is kept)."""

from __future__ import annotations

import json
from typing import Any


class Wire:
    """What the node room needs of the bridge: a place for its handler, and publish."""

    def __init__(self) -> None:
        self.on_node: Any = None
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        self.sent.append((topic, json.loads(payload)))
