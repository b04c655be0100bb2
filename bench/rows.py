"""The rows of the benchmark table (docs/benchmarks.md): each target's figures as rows of id,
what, target, measured median [min-max], reference, ratio and met, from the results its
module returns (``rows_for``), and the table itself (``table``)."""

from __future__ import annotations

import re
from typing import Any

from cells import fmt, row
from harness import Figure
from ref_rows import p1_dramatiq_rows, p2_celery_rows

#: The P3 long-file sides held to the targets: the default path and ``chunks_at_once = 2``.
OURS = ("edge-queue batched", "edge-queue batched, 2 chunks at once")
#: What they are held to: faster-whisper's batched pipeline with timestamp tokens, batches of 8.
P3_REFERENCE = "faster-whisper batched 8, timestamps"
#: English as before languages were told (tiny.en alone), beside the default that tells them.
ENGLISH_ALONE = "edge-queue batched, tiny.en alone"
#: What telling the language may add to a file's CPU seconds (docs/benchmarks.md, P9).
DETECTION_TARGET_S = 0.5


def _p3_long_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """P3's long-file rows, every side's CPU, wall, peak RSS, WER and cues beside the reference
    (:data:`P3_REFERENCE`), the targets on the rows of :data:`OURS`: CPU at most the
    reference's, peak RSS at most half of it, WER at most the reference's, cues without
    overlaps and none over 7 s (a single word longer than that aside). Wall time is reported
    beside the reference, without a target. With the :data:`ENGLISH_ALONE` side, one more row:
    what the default's telling of the language adds to English (CPU s, at most
    :data:`DETECTION_TARGET_S`)."""
    f, out = res["figures"], []
    for m in res["minutes"]:
        p = f"{m:g} min: "
        ref = {k: f[f"{p}{P3_REFERENCE}: {k}"] for k in ("cpu", "wall", "rss", "wer")}
        for side in res["sides"]:
            g = {k: f[f"{p}{side}: {k}"] for k in ("cpu", "wall", "rss", "wer")}
            ours = side in OURS
            name = f"{m:g}-min file, {side}"

            for key, label, target, limit in (
                ("cpu", "CPU s", "≤ reference", 1.0),
                ("wall", "wall s", "", 0.0),
                ("rss", "peak RSS", "≤ ½ reference", 0.5),
            ):
                ratio = g[key].median / ref[key].median if ref[key].median else float("inf")
                out.append(
                    row(
                        "P3L",
                        f"{name}: {label}",
                        target if ours else "",
                        g[key],
                        f"{P3_REFERENCE} {fmt(ref[key])}",
                        f"{ratio:.2f}×",
                        (ratio <= limit) if ours and target else None,
                    )
                )
            w = g["wer"]
            out.append(
                row(
                    "P3L",
                    f"{name}: WER",
                    "≤ reference" if ours else "",
                    w,
                    f"{P3_REFERENCE} {ref['wer'].median:.3f}",
                    f"{w.median - ref['wer'].median:+.3f}",
                    w.median <= ref["wer"].median + 1e-9 if ours else None,
                )
            )
            cues = {k: f[f"{p}{side}: {k}"] for k in ("cues", "median", "longest", "over", "overlaps")}
            out.append(
                row(
                    "P3L",
                    f"{name}: cues over 7 s",
                    "0 % (a single word aside), no overlap" if ours else "",
                    cues["over"],
                    f"{cues['cues'].median:.0f} cues, median {cues['median'].median:.1f} s, longest "
                    f"{cues['longest'].median:.1f} s, {cues['overlaps'].median:.0f} overlapping the next",
                    "",
                    (cues["over"].median == 0 and cues["overlaps"].median == 0) if ours else None,
                )
            )
            if ours and f"{p}{side}: srt lines" in f:  # stored results from before have none
                out += _srt_rule_rows(f, p, name, side)
        alone = f.get(f"{p}{ENGLISH_ALONE}: cpu")
        if alone is not None:  # stored results from before have no such side
            told = f[f"{p}{OURS[0]}: cpu"]
            extra = told.median - alone.median
            out.append(
                row(
                    "P3L",
                    f"{m:g}-min file, English: CPU s of the language told beside tiny.en alone",
                    f"≤ +{DETECTION_TARGET_S} s (what telling the language may cost)",
                    told,
                    f"{ENGLISH_ALONE} {fmt(alone)}",
                    f"{extra:+.2f} s",
                    extra <= DETECTION_TARGET_S,
                )
            )
    return out


#: The subtitle rules' targets (docs/topics.md, the srt and vtt layout): share of srt events keeping each.
SRT_TARGETS = (
    ("lines", "≤ 2 lines of ≤ 42 characters", 98.0),
    ("duration", "5/6-7 s", 98.0),
    ("speed", "≤ 20 characters/s", 95.0),
)


def _srt_rule_rows(f: dict[str, Any], p: str, name: str, side: str) -> list[dict[str, Any]]:
    """P3L's rows of the srt rules on one of edge-queue's sides: the share of events keeping
    each, against :data:`SRT_TARGETS`."""
    events = f[f"{p}{side}: srt events"].median
    return [
        row(
            "P3L",
            f"{name}: srt events keeping {label}",
            f"≥ {limit:g} %",
            f[f"{p}{side}: srt {key}"],
            f"{events:.0f} events",
            "",
            f[f"{p}{side}: srt {key}"].median >= limit,
        )
        for key, label, limit in SRT_TARGETS
    ]


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
    out += p1_dramatiq_rows(res)
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
        out += p2_celery_rows(res)
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
    elif pid == "P8":
        http, mqtt_ = f["HTTP /asr"], f["MQTT submit"]
        ratio = http.median / mqtt_.median
        what = f"{res['minutes_one']:g}-min recording, end to end: POST /asr -> srt read"
        out.append(
            row(
                "P8",
                what,
                "≤ 1.05× MQTT",
                http,
                f"MQTT submit -> srt read {fmt(mqtt_)}",
                f"{ratio:.3f}×",
                ratio <= 1.05,
            )
        )
        growth = f["burst: service RSS growth"]
        what = (
            f"{res['uploads']} Bazarr uploads at once ({res['minutes_burst']:g} min of PCM, "
            f"{res['upload_mb']:.0f} MB each), killed with SIGKILL after {res.get('killed_after_s', 0):.0f} s and "
            f"{res.get('resent_after_kill', 0)} sent again: service RSS growth (the larger of the two "
            f"processes); {res['own']}/{res['uploads']} answered with their own subtitles, "
            f"{res.get('wrong', 0)} with another's, {res.get('refused', 0)} refused, in {res['seconds']:.0f} s"
        )
        met = growth.median <= 50 and res["own"] == res["uploads"] and not res.get("wrong")
        out.append(
            row(
                "P8",
                what,
                "≤ 50 MiB, every answer its own",
                growth,
                f"growth before the kill {res.get('growth_before_kill_mb', 0):.0f} MiB, after the restart "
                f"{res.get('growth_after_restart_mb', 0):.0f} MiB",
                "",
                met,
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
