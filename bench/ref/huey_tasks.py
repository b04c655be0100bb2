"""The Huey app of the P1 reference: a SqliteHuey with its defaults and one no-op task."""

import os

from huey import SqliteHuey

huey = SqliteHuey("bench", filename=os.environ["HUEY_BENCH_DB"])


@huey.task()
def noop(i):
    return True
