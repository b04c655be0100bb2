"""The Celery app of the P1 and P2 references: Redis as broker and as result backend (one
redis-server, databases 0 and 1), Celery's defaults otherwise, one no-op task. The worker
counts each task that succeeded in the Redis key ``eqbench:done`` (Celery's ``task_success``
signal, sent after the result is stored), the completion P1's client polls."""

import os

import redis
from celery import Celery
from celery.signals import task_success

DONE_KEY = "eqbench:done"
url = os.environ["CELERY_BENCH_REDIS"]
app = Celery("eqbench", broker=url, backend=url.rsplit("/", 1)[0] + "/1")
counter = redis.Redis.from_url(url)  # connects on first use, in the worker's child


@app.task
def noop(i):
    return True


@task_success.connect
def count_done(sender=None, **kwargs):
    counter.incr(DONE_KEY)
