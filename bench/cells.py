"""One row of the benchmark table (docs/benchmarks.md) and how a figure is written in it:
median [min-max] unit."""

from __future__ import annotations

from typing import Any

from harness import Figure


def fmt(f: Figure) -> str:
    def n(x: float) -> str:
        if abs(x) >= 100:
            return f"{x:,.0f}"
        return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}" if abs(x) >= 0.1 or x == 0 else f"{x:.3f}"

    return f"{n(f.median)} [{n(min(f.runs))}-{n(max(f.runs))}] {f.unit}"


def row(
    pid: str, what: str, target: str, fig: Figure | None, reference: str, ratio: str, met: bool | None
) -> dict[str, Any]:
    return {
        "id": pid,
        "what": what,
        "target": target,
        "measured": fmt(fig) if fig else "-",
        "reference": reference,
        "ratio": ratio,
        "met": met,
        "figure": fig.as_dict() if fig else None,
    }
