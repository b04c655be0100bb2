"""The figures a test measured, printed on one line for the run's log (docs cite them)."""

from __future__ import annotations

import json
from typing import Any


def figures(**kw: Any) -> None:
    print("figures:", json.dumps(kw))
