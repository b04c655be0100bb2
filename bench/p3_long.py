"""P3, long files: one recording of 10 (and 60) minutes made from the shared speech clips,
transcribed by edge-queue's default path (and with ``chunks_at_once = 2``) and by faster-whisper
itself: the reference, its batched pipeline with batches of 8 and timestamp tokens
(``without_timestamps=False``, its like-for-like mode for subtitles), and beside it the same
pipeline on its defaults and the sequential decoder; each in a process of its own
(bench/ref/long_child.py), alternated run by run: wall and CPU seconds, peak RSS, WER against
the clips' reference transcripts, and the cues each makes (count, median and longest duration,
share over 7 s, overlaps with the next); for edge-queue's sides, the share of its srt's events
that keep each subtitle rule (edge_queue/kinds/cue_layout.py: lines, duration, reading speed,
gap).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import wave
from pathlib import Path
from typing import Any

from harness import BENCH, Figure, speech

CHILD = str(BENCH / "ref" / "long_child.py")
#: The clips and their reference transcripts (../shared/media/README.md).
REFERENCE = {
    "jfk.flac": "And so my fellow Americans, ask not what your country can do for you, ask what "
    "you can do for your country.",
    "librivox-0870.wav": "and mister john dashwood had then leisure to consider how much there might "
    "be prudently in his power to do for them",
    "librivox-0890.wav": "unless to be rather cold hearted and rather selfish is to be ill disposed",
    "librivox-0930.wav": "he might even have been made amiable himself",
}
GAP_S = 0.6

#: name -> (variant, extra arguments of long_child.py)
SIDES: dict[str, tuple[str, list[str]]] = {
    "edge-queue batched": ("eq", []),
    "edge-queue batched, 2 chunks at once": ("eq", ["chunks_at_once=2", "cpu_threads=1"]),
    # English as it was before languages were told: tiny.en alone, no detection (what English
    # cost before; the default's difference from it is detection's cost on a real file)
    "edge-queue batched, tiny.en alone": ("eq", ["model=tiny.en"]),
    "faster-whisper batched 8, timestamps": ("fw-batched", ["batch_size=8", "timestamps=1"]),
    "faster-whisper batched 8": ("fw-batched", ["batch_size=8"]),
    "faster-whisper sequential": ("fw", []),
}
#: The side the targets compare with.
REFERENCE_SIDE = "faster-whisper batched 8, timestamps"
#: The longest cue subtitle guidance allows (s).
CUE_MAX_S = 7.0


def cue_stats(segments: list[dict[str, Any]]) -> dict[str, float]:
    """``cues``, ``median`` and ``longest`` duration (s), ``over`` (the share over
    :data:`CUE_MAX_S`, %), ``overlaps`` (cues that end after the next one starts)."""
    import statistics

    lengths = [s["end"] - s["start"] for s in segments] or [0.0]
    overlaps = sum(1 for a, b in zip(segments, segments[1:], strict=False) if a["end"] > b["start"] + 1e-6)
    return {
        "cues": float(len(segments)),
        "median": statistics.median(lengths),
        "longest": max(lengths),
        "over": 100.0 * sum(1 for x in lengths if x > CUE_MAX_S + 1e-6) / max(len(segments), 1),
        "overlaps": float(overlaps),
    }


#: The srt rule shares P3L reports for edge-queue's sides (figure names).
RULE_KEYS = ("srt lines", "srt duration", "srt speed", "srt gap", "srt events")


def srt_rules(events: list[dict[str, Any]]) -> dict[str, float]:
    """The share (%) of the srt's ``events`` keeping each rule of
    :func:`edge_queue.kinds.cue_layout.kept` (English: Latin rules), and their count."""
    from edge_queue.kinds.cue_layout import LATIN, kept

    return {f"srt {k}": v for k, v in kept(events, LATIN).items()} | {"srt events": float(len(events))}


def build(seconds: float, folder: Path) -> tuple[Path, str]:
    """A 16 kHz mono WAV of at least ``seconds``: the four clips in turn, 0.6 s of silence
    between them; and its reference transcript."""
    import numpy as np
    from faster_whisper import decode_audio

    names = list(REFERENCE)
    clips = [decode_audio(str(speech(n))) for n in names]
    gap = np.zeros(int(GAP_S * 16000), dtype=np.float32)
    parts, text, total, i = [], [], 0.0, 0
    while total < seconds:
        parts += [clips[i % 4], gap]
        text.append(REFERENCE[names[i % 4]])
        total += clips[i % 4].shape[0] / 16000 + GAP_S
        i += 1
    path = folder / f"long-{int(seconds)}s.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((np.clip(np.concatenate(parts), -1, 1) * 32767).astype("<i2").tobytes())
    return path, " ".join(text)


def words(text: str) -> list[str]:
    keep = "".join(c.lower() if c.isalnum() or c in " '" else " " for c in text)
    return keep.split()


def wer(reference: str, hypothesis: str) -> float:
    """Word error rate: word-level Levenshtein distance / reference length."""
    ref, hyp = words(reference), words(hypothesis)
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1] / max(len(ref), 1)


def one(side: str, path: Path) -> dict[str, Any]:
    variant, extra = SIDES[side]
    out = subprocess.run(
        [sys.executable, CHILD, variant, str(path), *extra], capture_output=True, text=True, timeout=7200
    )
    if out.returncode != 0:
        raise RuntimeError(f"{side}: {out.stderr[-1500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(runs: int, minutes: list[float], folder: Path, log: Any) -> dict[str, Any]:
    """Each side on each file, ``runs`` times (once for files over 20 minutes), alternated.
    Figures per ``<minutes> min: <side>: <measure>``: wall s, CPU s, peak RSS MiB, WER."""
    figures: dict[str, Figure] = {}
    for m in minutes:
        path, reference = build(60 * m, folder)
        runs_m = runs if m <= 20 else 1
        keys = ("wall", "cpu", "rss", "wer", "cues", "median", "longest", "over", "overlaps", *RULE_KEYS)
        got: dict[str, dict[str, list[float]]] = {s: {k: [] for k in keys} for s in SIDES}
        names = list(SIDES)
        for r in range(runs_m):
            for side in names if r % 2 == 0 else names[::-1]:
                res = one(side, path)
                g = got[side]
                g["wall"].append(res["wall_s"])
                g["cpu"].append(res["cpu_s"])
                g["rss"].append(res["peak_rss_mib"])
                g["wer"].append(wer(reference, res["text"]))
                for k, v in cue_stats(res["segments"]).items():
                    g[k].append(v)
                if "events" in res:
                    for k, v in srt_rules(res["events"]).items():
                        g[k].append(v)
                log(
                    f"P3 long {m:g} min run {r + 1}/{runs_m} {side}: wall {res['wall_s']:.1f} s, "
                    f"CPU {res['cpu_s']:.1f} s, peak {res['peak_rss_mib']:.0f} MiB, WER {g['wer'][-1]:.3f}, "
                    f"{g['cues'][-1]:.0f} cues, longest {g['longest'][-1]:.1f} s, {g['over'][-1]:.1f} % over 7 s, "
                    f"{g['overlaps'][-1]:.0f} overlaps"
                )
        for side, g in got.items():
            figures[f"{m:g} min: {side}: wall"] = Figure(g["wall"], "s")
            figures[f"{m:g} min: {side}: cpu"] = Figure(g["cpu"], "s")
            figures[f"{m:g} min: {side}: rss"] = Figure(g["rss"], "MiB")
            figures[f"{m:g} min: {side}: wer"] = Figure(g["wer"], "")
            for k, unit in (("cues", ""), ("median", "s"), ("longest", "s"), ("over", "%"), ("overlaps", "")):
                figures[f"{m:g} min: {side}: {k}"] = Figure(g[k], unit)
            for k in RULE_KEYS:
                if g[k]:
                    figures[f"{m:g} min: {side}: {k}"] = Figure(g[k], "%")
    return {"figures": figures, "minutes": minutes, "sides": list(SIDES)}


#: P3C: how many threads each of several transcriptions running at once should take.
CONCURRENT_THREADS = (1, 2)


def concurrent(runs: int, seconds: float, folder: Path, log: Any, at_once: int = 2) -> dict[str, Any]:
    """P3C: ``at_once`` edge-queue transcriptions (the default batched settings) of the same
    ``seconds``-long file started together, each in a process of its own, with ``cpu_threads``
    1 and 2, alternated run by run. Figures per ``threads <n>: <measure>``: wall s until the
    last ends, CPU s of all, the largest peak RSS MiB, and the worst WER."""
    path, reference = build(seconds, folder)
    got: dict[int, dict[str, list[float]]] = {
        t: {"wall": [], "cpu": [], "rss": [], "wer": []} for t in CONCURRENT_THREADS
    }
    for r in range(runs):
        for threads in CONCURRENT_THREADS if r % 2 == 0 else CONCURRENT_THREADS[::-1]:
            t0 = time.monotonic()
            procs = [
                subprocess.Popen(
                    [sys.executable, CHILD, "eq", str(path), f"cpu_threads={threads}"],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
                for _ in range(at_once)
            ]
            outs = [json.loads(p.communicate(timeout=7200)[0].strip().splitlines()[-1]) for p in procs]
            wall = time.monotonic() - t0
            g = got[threads]
            g["wall"].append(wall)
            g["cpu"].append(sum(o["cpu_s"] for o in outs))
            g["rss"].append(max(o["peak_rss_mib"] for o in outs))
            g["wer"].append(max(wer(reference, o["text"]) for o in outs))
            log(
                f"P3C run {r + 1}/{runs}: {at_once} at once, cpu_threads {threads}: wall {wall:.1f} s, "
                f"CPU {g['cpu'][-1]:.1f} s, peak {g['rss'][-1]:.0f} MiB, WER {g['wer'][-1]:.3f}"
            )
    figures = {}
    for threads, g in got.items():
        figures[f"threads {threads}: wall"] = Figure(g["wall"], "s")
        figures[f"threads {threads}: cpu"] = Figure(g["cpu"], "s")
        figures[f"threads {threads}: rss"] = Figure(g["rss"], "MiB")
        figures[f"threads {threads}: wer"] = Figure(g["wer"], "")
    return {"figures": figures, "at_once": at_once, "minutes": seconds / 60}
