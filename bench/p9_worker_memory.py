"""P9, a worker's memory by language (docs/configuration.md, ``transcribe.keep_models``):

    .venv/bin/python bench/p9_worker_memory.py [--keep 1|2]

A real worker process (edge_queue.workers.worker, as the service spawns it), driven through
its pipe, cpu_threads 2. Per job: the worker's peak RSS while it runs (``VmHWM``, reset through
``/proc/<pid>/clear_refs`` before the job), its RSS 0.5 s after (steady), its CPU seconds and the
wall seconds. The jobs, each group in a fresh worker:

- the P3L recording of 5 minutes (bench/p3_long.py: the shared clips in turn) with the language
  given (``en``); the same without it (base tells, tiny.en transcribes);
- Spanish speech (espeak-ng ``-v es``) without its language;
- a household mixing languages: Spanish, English (the JFK clip), Spanish, English, Spanish.

Prints one line per job and, last, all of them as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import speech  # noqa: E402
from p3_long import build  # noqa: E402

SPANISH = "Buenos días. Hoy vamos a hablar del tiempo en Madrid. Mañana hará sol y calor por la tarde."


def status(pid: int) -> dict[str, float]:
    """``VmRSS`` and ``VmHWM`` of ``pid``, MiB."""
    with open(f"/proc/{pid}/status") as fh:
        return {k: int(v.split()[0]) / 1024 for k, v in (line.split(":", 1) for line in fh) if k in ("VmRSS", "VmHWM")}


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def jobs(sequence: list[tuple[Path, dict[str, Any]]], root: Path, keep: int, log: Any) -> list[dict[str, Any]]:
    """Run ``sequence`` (input, options) in one fresh worker; one row per job."""
    from edge_queue.config.settings import Settings
    from edge_queue.workers import worker

    settings = Settings(
        data_dir=root / "data",
        media_roots=[root, speech("jfk.flac").parent],
        transcribe={"cpu_threads": 2, "keep_models": keep},
    )
    spawn = multiprocessing.get_context("spawn")
    ours, theirs = spawn.Pipe()
    proc = spawn.Process(target=worker.main, args=(theirs, settings), daemon=True)
    proc.start()
    rows = []
    try:
        assert ours.poll(60) and ours.recv()["op"] == "ready"
        pid = int(proc.pid or 0)
        for i, (path, options) in enumerate(sequence):
            job_id = f"j{i}"
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak starts again from now
            c0, t0 = cpu_s(pid), time.monotonic()
            job = {"job_id": job_id, "attempt": 1, "kind": "transcribe", "options": options, "input": str(path)}
            ours.send({"op": "run", "jobs": [{**job, "output_dir": str(root / "out" / job_id)}]})
            while True:
                if not ours.poll(1800):
                    raise RuntimeError("no message from the worker")
                msg = ours.recv()
                if msg.get("op") == "outputs":
                    ours.send({"op": "outputs_ok", "job_id": job_id, "attempt": 1, "ok": True})
                if msg.get("op") in ("done", "failed"):
                    break
            wall, cpu = time.monotonic() - t0, cpu_s(pid) - c0
            time.sleep(0.5)
            now = status(pid)
            result = msg.get("result", {})
            row = {
                "input": path.name,
                "language given": options.get("language"),
                "state": msg["op"],
                "language": result.get("language"),
                "model": result.get("model"),
                "peak MiB": round(now["VmHWM"]),
                "after MiB": round(now["VmRSS"]),
                "CPU s": round(cpu, 2),
                "wall s": round(wall, 2),
            }
            rows.append(row)
            log(row)
    finally:
        ours.send({"op": "stop"})
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keep", type=int, default=1, help="transcribe.keep_models")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="eqp9mem-") as tmp:
        root = Path(tmp)
        five, _ = build(300, root)
        spanish = root / "es.wav"
        subprocess.run(["espeak-ng", "-v", "es", "-w", str(spanish), SPANISH], check=True, timeout=60)
        jfk = speech("jfk.flac")
        out: dict[str, Any] = {"keep_models": args.keep}
        for name, sequence in {
            "5 min, en given": [(five, {"language": "en"})],
            "5 min, told": [(five, {})],
            "Spanish, told": [(spanish, {})],
            "es, en, es, en, es": [(spanish, {}), (jfk, {}), (spanish, {}), (jfk, {}), (spanish, {})],
        }.items():
            out[name] = jobs(sequence, root, args.keep, lambda row, n=name: print(n, row, flush=True))
        print(json.dumps(out))


if __name__ == "__main__":
    main()
