"""Who said what (`diarize`), scored and costed with one command:

    .venv/bin/python bench/speakers.py [--long-s 600]   # printed and written to bench/results/speakers-<date>.json

Quality: conversations built from voices with an exact reference: the shared clips (JFK, 11 s,
cut at 5.2 s into two turns; the LibriVox reader's three clips) and espeak-ng voices (``en-us``
and its ``+f3`` variant), 0.7 s of silence between turns. Each is transcribed by the
``transcribe`` kind with ``diarize`` (tiny.en, ``language`` en, as a worker runs it) and scored
as the share of speech time given to the right speaker: the reference turns' time that the
transcript's segments cover, given to the speaker of the best one-to-one mapping of labels to
voices; and whether the number of speakers found is the number of voices.

Cost: the same transcription of the P3L recording (bench/p3_long.py ``build``: the four shared
clips in turn, two voices) of ``--long-s`` seconds, with and without ``diarize``, CPU seconds of
the process, each side once (a loaded 2-core box: read the figures as a range, not a point).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import wave
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import BENCH, speech  # noqa: E402
from p3_long import GAP_S, REFERENCE, build  # noqa: E402

TURN_GAP_S = 0.7
SAID = [
    "Hello, this is another voice speaking now, with a few more words to say about it.",
    "And here it comes again, the same voice, talking about the weather and the train today.",
    "Well, I think we should meet on Thursday afternoon, if that works for everybody here.",
]


def clip(name: str) -> Any:
    import numpy as np

    from edge_queue.kinds.audio import decode_pcm

    return np.concatenate(list(decode_pcm(str(speech(name)))))


def espeak(folder: Path, voice: str, text: str) -> Any:
    import numpy as np

    from edge_queue.kinds.audio import decode_pcm

    path = folder / f"say-{voice.replace('+', '_')}-{abs(hash(text)) % 10**6}.wav"
    subprocess.run(["espeak-ng", "-v", voice, "-w", str(path), text], check=True)
    return np.concatenate(list(decode_pcm(str(path))))


def write(path: Path, turns: list[tuple[str, Any]]) -> list[tuple[str, float, float]]:
    """``turns`` (voice, audio) one after another with :data:`TURN_GAP_S` between them, as a
    16 kHz WAV; the reference ``(voice, start, end)`` of each turn."""
    import numpy as np

    gap = np.zeros(int(TURN_GAP_S * 16000), np.float32)
    parts, ref, t = [], [], 0.0
    for who, audio in turns:
        parts += [audio, gap]
        ref.append((who, t, t + audio.shape[0] / 16000))
        t += audio.shape[0] / 16000 + TURN_GAP_S
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((np.clip(np.concatenate(parts), -1, 1) * 32767).astype("<i2").tobytes())
    return ref


def conversations(folder: Path) -> dict[str, tuple[Path, list[tuple[str, float, float]]]]:
    """The built conversations by name: 1, 2 and 3 voices."""
    jfk = clip("jfk.flac")
    j1, j2 = jfk[: int(5.2 * 16000)], jfk[int(5.2 * 16000) :]
    r1, r2, r3 = (clip(n) for n in ("librivox-0870.wav", "librivox-0890.wav", "librivox-0930.wav"))
    m = [espeak(folder, "en-us", t) for t in SAID]
    f = [espeak(folder, "en-us+f3", t) for t in SAID]
    built = {
        "1 voice: reader": [("reader", r1), ("reader", r2), ("reader", r3)],
        "1 voice: JFK": [("jfk", j1), ("jfk", j2)],
        "1 voice: espeak": [("m", m[0]), ("m", m[1]), ("m", m[2])],
        "2 voices: JFK, reader": [("jfk", j1), ("reader", r1), ("jfk", j2), ("reader", r2), ("reader", r3)],
        "2 voices: reader, espeak": [("reader", r1), ("m", m[0]), ("reader", r2), ("m", m[1]), ("reader", r3)],
        "2 voices: espeak m, f": [("m", m[0]), ("f", f[1]), ("m", m[2]), ("f", f[0])],
        "3 voices: JFK, reader, espeak": [
            ("jfk", j1),
            ("reader", r1),
            ("m", m[0]),
            ("jfk", j2),
            ("reader", r2),
            ("m", m[1]),
        ],  # fmt: skip
        "3 voices: reader, espeak m, f": [("reader", r1), ("m", m[0]), ("f", f[1]), ("reader", r2), ("f", f[2])],
    }
    out = {}
    for k, (name, turns) in enumerate(built.items()):
        path = folder / f"conversation-{k}.wav"
        out[name] = (path, write(path, turns))
    return out


def score(segments: list[dict[str, Any]], ref: list[tuple[str, float, float]]) -> float:
    """The share of the reference's speech time, where a segment covers it, given to the right
    speaker under the best one-to-one mapping of the segments' speakers to the voices."""
    hyp = sorted({s["speaker"] for s in segments})
    voices = sorted({r[0] for r in ref})

    def overlap(h: str | None, v: str | None) -> float:
        return sum(
            max(0.0, min(s["end"], b) - max(s["start"], a))
            for s in segments
            if h is None or s["speaker"] == h
            for who, a, b in ref
            if v is None or who == v
        )

    covered = overlap(None, None) or 1.0
    best = 0.0
    for perm in itertools.permutations(hyp, min(len(hyp), len(voices))):
        best = max(best, sum(overlap(h, v) for h, v in zip(perm, voices, strict=False)))
    return best / covered


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def transcribe(path: Path, out: Path, diarize: bool) -> tuple[dict[str, Any], list[dict[str, Any]], float]:
    """The ``transcribe`` kind on ``path``: its result, the json output's segments, CPU s."""
    from edge_queue.config.settings import Settings
    from edge_queue.kinds.transcribe import Transcribe, TranscribeOptions

    class Ctx:  # edge_queue.kinds.base.JobContext, without a service behind it
        job_id, attempt, output_dir, kept, written = "bench", 1, out, [], {}
        settings = Settings(data_dir=out, transcribe={"model": "tiny.en", "cpu_threads": 2})

        def claim_outputs(self, files: dict[str, Any]) -> None:
            pass

        def keep_chunk(self, index: int, data: Any) -> None:
            pass

        def progress(self, *a: Any, **k: Any) -> None:
            pass

        def checkpoint(self) -> None:
            pass

    options = TranscribeOptions(formats=["json"], overwrite=True, language="en", diarize=diarize)
    c0 = cpu_s()
    result = Transcribe().run(Ctx(), str(path), options)  # type: ignore[arg-type]
    spent = cpu_s() - c0
    return result, json.loads(Path(result["outputs"]["json"]).read_text())["segments"], spent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--long-s", type=float, default=600.0, help="the cost recording's length, s (0: none)")
    args = parser.parse_args()
    figures: dict[str, Any] = {"when": datetime.now().isoformat(timespec="seconds"), "quality": {}, "cost": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        transcribe(speech("librivox-0930.wav"), folder / "warm", True)  # the models loaded, not counted
        for name, (path, ref) in conversations(folder).items():
            result, segments, spent = transcribe(path, folder / path.stem, True)
            voices = len({r[0] for r in ref})
            row = {"voices": voices, "found": result["speakers"], "score": round(score(segments, ref), 4)}
            row["cpu_s"] = round(spent, 2)
            figures["quality"][name] = row
            print(f"{name}: {row}", flush=True)
        if args.long_s:
            path, _ = build(args.long_s, folder)
            clips = [clip(n) for n in REFERENCE]
            ref, t = [], 0.0
            for i in range(10**6):
                length = clips[i % 4].shape[0] / 16000
                if t >= args.long_s:
                    break
                ref.append(("jfk" if i % 4 == 0 else "reader", t, t + length))
                t += length + GAP_S
            for diarize in (False, True):
                started = time.monotonic()
                result, segments, spent = transcribe(path, folder / f"long-{diarize}", diarize)
                row = {"cpu_s": round(spent, 1), "wall_s": round(time.monotonic() - started, 1)}
                if diarize:
                    row |= {"found": result["speakers"], "score": round(score(segments, ref), 4)}
                figures["cost"]["diarize" if diarize else "plain"] = row
                print(f"{int(args.long_s)} s, diarize={diarize}: {row}", flush=True)
    out = BENCH / "results" / f"speakers-{datetime.now():%Y-%m-%d}.json"
    out.write_text(json.dumps(figures, indent=1) + "\n")
    print("written", out)


if __name__ == "__main__":
    main()
