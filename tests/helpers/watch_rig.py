"""The media root that the watch-folder tests (tests/test_watch.py, tests/test_watch_rules.py)
watch folders in: ``<tmp>/media`` with ``inbox`` and ``elsewhere``, its real path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture
def root(tmp_path: Path) -> Path:
    media = tmp_path / "media"
    (media / "inbox").mkdir(parents=True)
    (media / "elsewhere").mkdir()
    return Path(os.path.realpath(media))
