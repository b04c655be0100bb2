"""The worker's job context, for running a kind in the test's own process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edge_queue.config.settings import Settings


class Ctx:
    """The worker's job context, for running the kind in this process."""

    def __init__(self, settings: Settings, output_dir: Path) -> None:
        self.job_id, self.attempt, self.settings, self.output_dir = "t", 1, settings, output_dir
        self.kept: list[dict[str, Any]] = []
        self.chunks: list[tuple[int, dict[str, Any]]] = []
        self.written: dict[str, dict[str, Any]] = {}
        self.claimed: dict[str, dict[str, Any]] = {}
        #: the kind's calls of claim_outputs (each a round trip to the service, a commit)
        self.claims = 0

    def claim_outputs(self, files: dict[str, dict[str, Any]]) -> None:
        self.claims += 1
        self.claimed.update(files)

    def progress(self, percent: float, stage: str | None = None, eta_s: float | None = None) -> None:
        pass

    def checkpoint(self) -> None:
        pass

    def keep_chunk(self, index: int, data: dict[str, Any]) -> None:
        self.chunks.append((index, data))
