"""The Huey reference of P1, run with the reference environment's Python (bench/.venv-ref).

    python bench/ref/huey_drain.py N DATA_DIR

Starts ``huey_consumer`` with one worker process (``-w 1 -k process``) on a SqliteHuey in
DATA_DIR, waits until it is up, then enqueues N no-op tasks and polls the result store every
5 ms until N results are stored. Prints ``{"jobs_per_s", "elapsed_s", "enqueue_s", ...}``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    n, data_dir = int(sys.argv[1]), Path(sys.argv[2])
    os.environ["HUEY_BENCH_DB"] = str(data_dir / "huey.db")
    sys.path.insert(0, str(Path(__file__).parent))
    import huey_tasks

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    consumer = subprocess.Popen(
        [sys.executable, "-m", "huey.bin.huey_consumer", "huey_tasks.huey", "-w", "1", "-k", "process", "-q"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(data_dir / "consumer.log", "ab"),
    )
    try:
        # Up when it has run a probe task.
        r = huey_tasks.noop(-1)
        r.get(blocking=True, timeout=30)
        store = huey_tasks.huey.storage
        t0 = time.monotonic()
        for i in range(n):
            huey_tasks.noop(i)
        enq = time.monotonic() - t0
        deadline = t0 + 600
        while store.result_store_size() < n and time.monotonic() < deadline:
            time.sleep(0.005)
        el = time.monotonic() - t0
        done = store.result_store_size()
        import huey

        print(
            json.dumps(
                {
                    "jobs_per_s": done / el,
                    "elapsed_s": el,
                    "enqueue_s": enq,
                    "done": done,
                    "huey": huey.__version__,
                    "fsync": store._fsync if hasattr(store, "_fsync") else None,
                    "journal_mode": getattr(store, "_journal_mode", None),
                }
            )
        )
    finally:
        consumer.send_signal(signal.SIGTERM)
        try:
            consumer.wait(15)
        except subprocess.TimeoutExpired:
            consumer.kill()
            consumer.wait(5)


if __name__ == "__main__":
    main()
