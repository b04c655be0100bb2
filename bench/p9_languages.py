"""P9: languages, in one command (docs/topics.md, "Languages"):

    .venv/bin/python bench/p9_languages.py [--runs N] [--minutes M] [--out FILE]

- **Detection cost per file**: the bundled base (int8, 2 threads) telling the language of the
  shared English clips, of Spanish, Italian, French, German and Dutch speech made with
  espeak-ng, of 10 s of silence, white noise and beeping tones, and of 60 s of pink and white
  noise made with sox loud enough that Silero passes part of it as speech: CPU-s of
  :func:`edge_queue.kinds.languages.detect` (VAD included; ``time.process_time`` and
  ``getrusage``), the passes it took, the language and the model's probability, what the
  speech gate read (Silero's sure share, the model's no-speech probability); base's load and
  first join. ``--detection-only`` measures this alone, into bench/results/p9-detection.json.
- **English before and after**: the P3L 10-minute file (the shared clips in turn,
  bench/p3_long.py) transcribed by edge-queue's kind in a process of its own
  (bench/ref/long_child.py), today's default (base tells the language, tiny.en transcribes,
  both models loaded) against tiny.en alone (``transcribe.model = "tiny.en"``: no language
  told), alternated run by run: CPU s, wall s, peak RSS, WER, cues.
- **Non-speech**: the cues the default makes of silence, noise and tones (target 0).

Figures are written to ``--out`` (default bench/results/p9-languages.json) and printed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import wave
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import BENCH, speech  # noqa: E402
from p3_long import CHILD, REFERENCE, build, cue_stats, wer  # noqa: E402

SPOKEN = {
    "es": "Buenos días. Hoy vamos a hablar del tiempo en Madrid. Mañana hará sol y calor por la tarde.",
    "it": "Buongiorno a tutti. Oggi parliamo del tempo a Roma. Domani ci sarà il sole e farà caldo.",
    "fr": "Bonjour à tous. Aujourd'hui nous parlons du temps à Paris. Demain il fera beau et chaud.",
    "de": "Guten Tag. Heute sprechen wir über das Wetter in Berlin. Morgen scheint die Sonne.",
    "nl": "Goedemiddag. Vandaag praten we over het weer in Amsterdam. Morgen schijnt de zon.",
}
SIDES = {"default (base tells, tiny.en transcribes)": [], "tiny.en alone": ["model=tiny.en"]}


def write_wav(path: Path, audio: Any) -> Path:
    import numpy as np

    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes())
    return path


def media(folder: Path) -> dict[str, Path]:
    """The clips: the shared English ones, espeak-ng speech, silence, noise and tones."""
    import numpy as np

    out = {name: speech(name) for name in REFERENCE}
    for code, text in SPOKEN.items():
        out[f"espeak-{code}"] = folder / f"{code}.wav"
        subprocess.run(["espeak-ng", "-v", code, "-w", str(out[f"espeak-{code}"]), text], check=True)
    t = np.arange(160_000) / 16000
    out["silence"] = write_wav(folder / "silence.wav", np.zeros(160_000))
    out["noise"] = write_wav(folder / "noise.wav", np.random.default_rng(0).standard_normal(160_000) * 0.1)
    out["tones"] = write_wav(folder / "tones.wav", 0.3 * np.sin(2 * np.pi * 440 * t) * (np.sin(2 * np.pi * 2 * t) > 0))
    for name, synth, volume in (
        ("pink", "pinknoise", "0.5"),
        ("pink", "pinknoise", "0.8"),
        ("white", "whitenoise", "0.4"),
    ):
        path = folder / f"{name}-60s-{volume}.wav"
        subprocess.run(
            ["sox", "-n", "-r", "16000", "-c", "1", "-b", "16", str(path), "synth", "60", synth, "vol", volume],
            check=True,
            capture_output=True,
        )
        out[path.stem] = path
    return out


def detection(clips: dict[str, Path], folder: Path) -> dict[str, Any]:
    from faster_whisper import decode_audio

    from edge_queue.kinds import languages
    from edge_queue.kinds.transcribe import resolve_model
    from edge_queue.kinds.whisper import load_model

    t0, c0 = time.monotonic(), time.process_time()
    path = resolve_model(None, folder / "models")
    joined = {"wall_s": round(time.monotonic() - t0, 2), "cpu_s": round(time.process_time() - c0, 2)}
    c0 = time.process_time()
    model = load_model(path, "int8", 2)
    load_cpu = round(time.process_time() - c0, 2)
    rows = {}
    languages.detect(model, decode_audio(str(clips["silence"])))  # Silero loaded
    for name, clip in clips.items():
        audio = decode_audio(str(clip))
        c0, r0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
        found = languages.detect(model, audio)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        rows[name] = {
            "cpu_s": round(time.process_time() - c0, 3),
            "rusage_cpu_s": round(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, 3),
            "sure_share": getattr(found, "sure_share", None),
            "no_speech": getattr(found, "no_speech", None),
            "passes": found.passes,
            "language": found.language,
            "probability": found.probability,
            "speech_s": found.speech_s,
        }
    return {"join": joined, "load_cpu_s": load_cpu, "clips": rows}


def child(path: Path, extra: list[str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, CHILD, "eq", str(path), *extra], capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-1500:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def english(runs: int, minutes: float, folder: Path) -> dict[str, Any]:
    path, reference = build(minutes * 60, folder)
    sides: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    for _ in range(runs):
        for side, extra in SIDES.items():
            got = child(path, extra)
            stats = cue_stats(got["segments"])
            sides[side].append(
                {
                    "cpu_s": round(got["cpu_s"], 2),
                    "wall_s": round(got["wall_s"], 2),
                    "peak_rss_mib": got["peak_rss_mib"],
                    "wer": round(wer(reference, got["text"]), 4),
                    "cues": int(stats["cues"]),
                    "cues_over_7s_pct": round(stats["over"], 2),
                }
            )
    return {"file_s": minutes * 60, "runs": sides}


def non_speech(clips: dict[str, Path]) -> dict[str, Any]:
    out = {}
    for name in ("silence", "noise", "tones"):
        got = child(clips[name], [])
        out[name] = {"cues": len(got["segments"]), "cpu_s": round(got["cpu_s"], 3)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="runs of each English side, alternated")
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the English file")
    parser.add_argument("--out", type=Path, default=None, help="default: bench/results/p9-languages.json")
    parser.add_argument("--detection-only", action="store_true", help="only the detection cost per file")
    args = parser.parse_args()
    name = "p9-detection.json" if args.detection_only else "p9-languages.json"
    args.out = args.out or BENCH / "results" / name
    if shutil.which("espeak-ng") is None or shutil.which("sox") is None:
        sys.exit("espeak-ng and sox are needed (apt-get install espeak-ng sox)")
    folder = Path(tempfile.mkdtemp(prefix="p9-"))
    try:
        clips = media(folder)
        figures = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": {"cores": os.cpu_count(), "load_1_5_15": os.getloadavg()},
            "detection": detection(clips, folder),
        }
        if not args.detection_only:
            figures["english"] = english(args.runs, args.minutes, folder)
            figures["non_speech"] = non_speech(clips)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    args.out.write_text(json.dumps(figures, indent=1, ensure_ascii=False) + "\n")
    det = figures["detection"]
    print(f"base: joined in {det['join']['wall_s']} s, loaded in {det['load_cpu_s']} CPU-s")
    for name, row in det["clips"].items():
        told = f"{row['language']!s:5s} {row['probability']:.3f}"
        print(f"  {name:22s} {told}  {row['passes']} pass(es)  {row['cpu_s']:.2f} CPU-s")
    for side, rows in figures.get("english", {}).get("runs", {}).items():
        print(f"English {args.minutes:g} min, {side}: {rows}")
    if "non_speech" in figures:
        print(f"non-speech cues: {figures['non_speech']}")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
