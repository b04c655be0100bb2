"""The Celery reference of P2, run with the reference environment's Python (bench/.venv-ref).

    python bench/ref/celery_latency.py N REDIS_URL DATA_DIR

Starts a Celery worker with one prefork child (``worker --pool prefork --concurrency 1``) on
Redis at REDIS_URL (a redis-server the bench started: bench/redis_server.py), waits until it
has run a probe task and is idle (1 s), then submits N no-op tasks one at a time: per task,
``delay()`` -> its result seen by the client (``AsyncResult.get()``, which Celery's Redis result
backend answers from a pub/sub notification, not by polling), 10 ms apart as P2's edge-queue
side. Prints ``{"submit->succeeded": [ms, ...], "celery": version}``.
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
    n, url, data_dir = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    os.environ["CELERY_BENCH_REDIS"] = url
    sys.path.insert(0, str(Path(__file__).parent))
    import celery
    import celery_tasks

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    argv = [sys.executable, "-m", "celery", "-A", "celery_tasks", "worker"]
    worker = subprocess.Popen(
        [*argv, "--pool", "prefork", "--concurrency", "1", "--loglevel", "WARNING"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(data_dir / "worker.log", "ab"),
    )
    try:
        celery_tasks.noop.delay(-1).get(timeout=60)  # up when it has run a probe task
        time.sleep(1.0)  # idle
        out: list[float] = []
        for i in range(n):
            t0 = time.monotonic()
            celery_tasks.noop.delay(i).get(timeout=10)
            out.append((time.monotonic() - t0) * 1000)
            time.sleep(0.01)  # let the worker go idle again
        print(json.dumps({"submit->succeeded": out, "celery": celery.__version__}))
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(15)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(5)


if __name__ == "__main__":
    main()
