"""The Dramatiq app of the P1 reference: a RedisBroker with its default middleware, one no-op
actor, and one middleware that counts the messages processed without error in the Redis key
``eqbench:done`` (after the actor returns, where dramatiq's Results middleware stores a result),
the completion the client polls."""

import os

import dramatiq
from dramatiq.brokers.redis import RedisBroker

DONE_KEY = "eqbench:done"


class CountDone(dramatiq.Middleware):
    def after_process_message(self, broker, message, *, result=None, exception=None):
        if exception is None:
            broker.client.incr(DONE_KEY)


broker = RedisBroker(url=os.environ["DRAMATIQ_BENCH_REDIS"])
broker.add_middleware(CountDone())
dramatiq.set_broker(broker)


@dramatiq.actor(max_retries=0)
def noop(i):
    return True
