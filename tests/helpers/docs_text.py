"""The documentation's text, for tests: a page of docs/, and the section under a heading."""

from __future__ import annotations

import re

from ..conftest import ROOT

DOCS = ROOT / "docs"


def read(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def section(text: str, heading: re.Pattern[str]) -> str:
    """The text under the first heading matching ``heading``, up to the next heading of the
    same or a higher level."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(#+)\s", line)
        if m and heading.search(line):
            level = len(m.group(1))
            end = next(
                (
                    j
                    for j in range(i + 1, len(lines))
                    if (n := re.match(r"^(#+)\s", lines[j])) and len(n.group(1)) <= level
                ),
                len(lines),
            )
            return "\n".join(lines[i:end])
    raise AssertionError(f"no heading matching {heading.pattern!r}")
