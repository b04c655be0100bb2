"""The Dramatiq reference of P1, run with the reference environment's Python (bench/.venv-ref).

    python bench/ref/dramatiq_drain.py N REDIS_URL DATA_DIR

Starts the ``dramatiq`` worker with one process and Dramatiq's default 8 threads
(``--processes 1 --threads 8``) on a RedisBroker at REDIS_URL (a redis-server the bench
started: bench/redis_server.py), waits until it has run a probe message, then sends N no-op
messages, one ``send`` (one request to Redis) per job, and polls the counter of processed
messages (bench/ref/dramatiq_tasks.py) every 5 ms until it reaches N. Prints
``{"jobs_per_s", "elapsed_s", "enqueue_s", "done", "dramatiq", ...}``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

THREADS = 8  # dramatiq's default --threads


def main() -> None:
    n, url, data_dir = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    os.environ["DRAMATIQ_BENCH_REDIS"] = url
    sys.path.insert(0, str(Path(__file__).parent))
    import dramatiq
    import dramatiq_tasks

    client = dramatiq_tasks.broker.client
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    worker = subprocess.Popen(
        [sys.executable, "-m", "dramatiq", "dramatiq_tasks", "--processes", "1", "--threads", str(THREADS)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(data_dir / "worker.log", "ab"),
    )
    try:
        # Up when it has processed a probe message.
        dramatiq_tasks.noop.send(-1)
        deadline = time.monotonic() + 60
        while int(client.get(dramatiq_tasks.DONE_KEY) or 0) < 1:
            if time.monotonic() > deadline or worker.poll() is not None:
                raise RuntimeError(
                    f"the dramatiq worker did not run the probe: {(data_dir / 'worker.log').read_text()[-1500:]}"
                )
            time.sleep(0.01)
        client.set(dramatiq_tasks.DONE_KEY, 0)
        t0 = time.monotonic()
        for i in range(n):
            dramatiq_tasks.noop.send(i)
        enq = time.monotonic() - t0
        deadline = t0 + 600
        while int(client.get(dramatiq_tasks.DONE_KEY) or 0) < n and time.monotonic() < deadline:
            time.sleep(0.005)
        el = time.monotonic() - t0
        done = int(client.get(dramatiq_tasks.DONE_KEY) or 0)
        info = client.config_get("save") | client.config_get("appendonly") | client.config_get("appendfsync")
        print(
            json.dumps(
                {
                    "jobs_per_s": done / el,
                    "elapsed_s": el,
                    "enqueue_s": enq,
                    "done": done,
                    "dramatiq": dramatiq.__version__,
                    "threads": THREADS,
                    "redis": info,
                }
            )
        )
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(15)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(5)


if __name__ == "__main__":
    main()
