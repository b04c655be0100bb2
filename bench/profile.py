"""Where the service's CPU goes under P1's load: py-spy samples of the service process,
counted by activity.

    .venv/bin/pip install py-spy     # once: the sampler (not a test or run dependency)
    .venv/bin/python bench/profile.py                    # both modes, 20,000 jobs each
    .venv/bin/python bench/profile.py --mode single --jobs 5000 --keep /tmp/prof

For each mode (``batch``: submits of 100 inputs; ``single``: one request per job), a fresh
service on a private mosquitto with the shipped delivery settings (as ``bench/run.py``) runs
``--jobs`` no-op jobs with ``synchronous=FULL`` while ``py-spy record --format raw`` samples
it at 200 Hz from the first request to the last ``succeeded`` seen, the whole run. Samples of
the main thread (the service loop) are counted once each, under the first activity of
:data:`ACTIVITIES` on the stack from its root; SQLite's share is the samples whose innermost
Python frame is a statement of the store (``edge_queue/store/``). Other threads (the queue page's HTTP
server, the start-up scan) wait in ``select`` and are left out.

Prints one Markdown table (the share of the loop's samples per activity and mode) and the
service CPU per job of the same runs (user + system time over the run, as P1 measures it;
py-spy pauses the process to read it, so this figure is higher than P1's). ``--keep DIR``
keeps the raw profiles (one line per distinct stack: frames from the root, ``;``-separated,
then the count).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
import psutil  # noqa: E402
from harness import Service, SucceededCounter  # noqa: E402

#: (activity, function names that start it), searched from the root of each sample's stack;
#: the first frame that names one of them decides.
ACTIVITIES: list[tuple[str, tuple[str, ...]]] = [
    (
        "requests: decoded, validated, stored (`jobs` and `queued` event rows, redelivery record), answered",
        ("Dispatcher.take",),
    ),
    ("claims: `UPDATE ... RETURNING` per worker and turn, `running` event rows and events", ("Scheduler.schedule",)),
    (
        "outcomes: `UPDATE ... FROM (VALUES ...)`, `end` event rows, events and retained states",
        ("Outcomes.apply_all",),
    ),
    ("`COMMIT` with its fsync, once per loop turn", ("Connection.group", "_GeneratorContextManager.__exit__")),
    ("MQTT socket: paho reading requests and PUBACKs, writing what the turn queued", ("Bridge.pump",)),
    (
        "worker pipes: hand-outs pickled and sent, outcomes read",
        ("Supervisor.poll", "Supervisor.dispatch", "Supervisor.wait_handles"),
    ),
    ("retained states of jobs that waited over 20 ms, queue and batch summaries", ("Publisher.publish_states",)),
    ("housekeeping, the clock, the loop's `select`", ()),
]
FRAME = re.compile(r"^(?P<func>[^ ]+) \((?P<file>[^:]+):(?P<line>\d+)\)$")


def classify(raw: Path) -> tuple[Counter[str], int, int]:
    """``(samples per activity, samples in SQLite statements, loop samples)`` of a py-spy raw
    profile, for the main thread's samples (those under ``Service.step``)."""
    per: Counter[str] = Counter()
    sql = total = 0
    for line in raw.read_text().splitlines():
        if not line.strip():
            continue
        stack, count_text = line.rsplit(" ", 1)
        frames = [m for m in (FRAME.match(f) for f in stack.split(";")) if m]
        funcs = [m["func"] for m in frames]
        if "Service.step" not in funcs:
            continue
        n = int(count_text)
        total += n
        for name, starts in ACTIVITIES:
            if not starts or any(f in starts for f in funcs):
                per[name] += n
                break
        if frames and "edge_queue/store/" in frames[-1]["file"]:
            sql += n
    return per, sql, total


def py_spy() -> str | None:
    """The py-spy beside this Python (the venv's), or on the PATH; None when missing."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def profile(mode: str, n: int, out: Path) -> float:
    """One profiled run; writes the raw profile to ``out``. Returns service CPU ms per job."""
    svc = Service({"EDGE_QUEUE_DURABILITY": "full"})
    try:
        svc.start()
        load = SucceededCounter(svc.base)
        time.sleep(0.3)
        load.pump(0)
        spy = subprocess.Popen(
            [py_spy() or "py-spy", "record", "-r", "200", "-f", "raw", "-o", str(out), "-p", str(svc.pid)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        time.sleep(1.0)  # py-spy attaches
        proc = psutil.Process(svc.pid)
        c0 = proc.cpu_times()
        load.submit_noops(n, mode)
        if not load.wait(n, 600):
            raise RuntimeError(f"only {len(load.succeeded)} succeeded: {svc.tail()}")
        c1 = proc.cpu_times()
        spy.send_signal(2)  # SIGINT: py-spy writes what it has and exits
        _, err = spy.communicate(timeout=60)
        if not out.exists():
            raise RuntimeError(f"py-spy wrote no profile: {err.decode(errors='replace')[-1000:]}")
        load.close()
        return (c1.user + c1.system - c0.user - c0.system) * 1000 / n
    finally:
        svc.cleanup()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["batch", "single", "both"], default="both")
    ap.add_argument("--jobs", type=int, default=20_000, help="no-op jobs per run (a multiple of 100)")
    ap.add_argument("--keep", type=Path, default=None, help="keep the raw profiles in this folder")
    a = ap.parse_args()
    if py_spy() is None:
        print("py-spy is missing: .venv/bin/pip install py-spy", file=sys.stderr)
        return 2
    modes = ["batch", "single"] if a.mode == "both" else [a.mode]
    keep = a.keep or Path(tempfile.mkdtemp(prefix="eqprofile-"))
    keep.mkdir(parents=True, exist_ok=True)
    broker = harness.Broker(harness.shipped_broker_settings())
    harness.use_port(broker.port)
    results = {}
    try:
        for mode in modes:
            raw = keep / f"{mode}.raw"
            cpu = profile(mode, a.jobs, raw)
            results[mode] = (cpu, *classify(raw))
    finally:
        broker.stop()
        if a.keep is None:
            shutil.rmtree(keep, ignore_errors=True)
    print(f"{a.jobs:,} no-op jobs per mode, synchronous=FULL; share of the service loop's samples")
    print()
    print("| " + " | ".join(modes) + " | activity |")
    print("|" + "---|" * (len(modes) + 1))
    for name, _ in ACTIVITIES:
        cells = [f"{100 * results[m][1][name] / max(results[m][3], 1):.0f} %" for m in modes]
        print("| " + " | ".join(cells) + f" | {name} |")
    print()
    for m in modes:
        cpu, _, sql, total = results[m]
        print(
            f"{m}: {total:,} loop samples; SQLite statements {100 * sql / max(total, 1):.0f} %; "
            f"service CPU {cpu:.3f} ms/job while sampled"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
