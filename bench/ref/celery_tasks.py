"""The Celery app of the P2 reference: Redis as broker and as result backend (one redis-server,
databases 0 and 1), Celery's defaults otherwise, one no-op task."""

import os

from celery import Celery

url = os.environ["CELERY_BENCH_REDIS"]
app = Celery("eqbench", broker=url, backend=url.rsplit("/", 1)[0] + "/1")


@app.task
def noop(i):
    return True
