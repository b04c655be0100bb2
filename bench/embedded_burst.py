"""A burst of QoS 1 submits through the embedded broker: docs/operations.md, "Load and
back-pressure", and docs/benchmarks.md, "The embedded broker under a burst".

    .venv/bin/python bench/embedded_burst.py [--submits 50000]

A real ``edge-queue up`` (service and embedded amqtt broker in one process, ``log_level``
INFO) on a free port; one client publishes ``--submits`` QoS 1 ``noop`` submits as fast as it
can; a subscriber of ``<base>/#`` counts every response, every event and each job's last
retained state, compared at the end with the job store (sqlite3). The run is the one of
``tests/test_embedded_load.py`` (10,000 there, marked slow). Writes
bench/results/embedded-burst-<submits>-<date>.json: answers and events lost or doubled, final
states missed, the last message's time, the process's peak memory, and the log lines (all,
the broker's at WARNING or above with tracebacks, PUBACK timeouts, late PUBACKs).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from datetime import datetime
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

import provenance  # noqa: E402

from tests.test_embedded_load import burst  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--submits", type=int, default=50_000)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds to wait for everything to arrive")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="eq-embedded-burst-") as tmp:
        figures = burst(Path(tmp), a.submits, a.timeout)
    out = BENCH / "results" / f"embedded-burst-{a.submits}-{datetime.now():%Y-%m-%d}.json"
    out.write_text(json.dumps({"code": provenance.code_state(), "figures": figures}, indent=1) + "\n")
    print(json.dumps(figures, indent=1))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
