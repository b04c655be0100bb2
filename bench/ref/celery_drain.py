"""The Celery reference of P1 (informative), run with the reference environment's Python
(bench/.venv-ref).

    python bench/ref/celery_drain.py N REDIS_URL DATA_DIR

Starts a Celery worker with one prefork child (``worker --pool prefork --concurrency 1``) on
Redis at REDIS_URL (a redis-server the bench started: bench/redis_server.py), waits until it
has run a probe task, then sends N no-op tasks, one ``delay()`` per job, and polls the counter
of succeeded tasks (bench/ref/celery_tasks.py) every 5 ms until it reaches N. Prints
``{"jobs_per_s", "elapsed_s", "enqueue_s", "done", "celery"}``.
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

    done = celery_tasks.counter
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "celery_tasks", "worker", "--pool", "prefork", "--concurrency", "1",
         "--loglevel", "WARNING"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(data_dir / "worker.log", "ab"),
    )  # fmt: skip
    try:
        celery_tasks.noop.delay(-1).get(timeout=60)  # up when it has run a probe task
        deadline = time.monotonic() + 10
        while int(done.get(celery_tasks.DONE_KEY) or 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)  # the probe's count, sent after its result
        done.set(celery_tasks.DONE_KEY, 0)
        t0 = time.monotonic()
        for i in range(n):
            celery_tasks.noop.delay(i)
        enq = time.monotonic() - t0
        deadline = t0 + 600
        while int(done.get(celery_tasks.DONE_KEY) or 0) < n and time.monotonic() < deadline:
            time.sleep(0.005)
        el = time.monotonic() - t0
        count = int(done.get(celery_tasks.DONE_KEY) or 0)
        print(
            json.dumps(
                {
                    "jobs_per_s": count / el,
                    "elapsed_s": el,
                    "enqueue_s": enq,
                    "done": count,
                    "celery": celery.__version__,
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
