"""The rate limits of edge-queue (edge_queue/rules/rates.py), in milliseconds, on a clock the
test passes: the MQTT requests' token bucket, the HTTP API's calls a minute, and the one
throttle under every throttled log line (refused requests, HTTP calls, node messages,
handshakes)."""

from __future__ import annotations

from edge_queue.rules.rates import MAX_TRACKED_CALLERS, CallRate, RefusalLog, RequestRate, Throttle


def test_the_request_rate_is_a_bucket_of_at_least_one_token() -> None:
    bucket = RequestRate(2.0, now=0.0)
    assert bucket.budget(500, now=0.0) == 0 and not bucket.ready(now=0.0)
    assert bucket.budget(500, now=10.0) == 2  # full: two tokens at 2/s, not twenty
    bucket.spend()
    bucket.spend()
    assert not bucket.ready(now=10.0) and bucket.ready(now=10.5)
    slow = RequestRate(0.1, now=0.0)  # under 1/s: one token, once in ten seconds
    assert slow.budget(500, now=5.0) == 0 and slow.budget(500, now=10.0) == 1
    assert RequestRate(0).budget(500) == 500 and RequestRate(0).ready()  # 0: no limit


def test_the_call_rate_is_a_sliding_minute_per_caller() -> None:
    rate = CallRate(2)
    assert rate.take("a", 0.0) is None and rate.take("a", 50.0) is None
    assert rate.take("a", 55.0) == 5  # the seconds until the call of 0.0 leaves the minute
    assert rate.take("b", 55.0) is None  # another caller is not slowed
    assert rate.take("a", 60.0) is None
    for i in range(MAX_TRACKED_CALLERS + 1):
        rate.take(f"addr:{i}", 61.0)
    assert len(rate) == MAX_TRACKED_CALLERS


def test_a_throttle_counts_what_it_leaves_out_and_hands_the_count_over_once() -> None:
    throttle = Throttle(2, 10.0)
    assert [throttle.take(t)[0] for t in (0.0, 1.0, 2.0, 3.0, 9.9)] == [True, True, False, False, False]
    assert throttle.take(12.0) == (True, 3, 12.0)  # a new window: the three left out, once
    assert throttle.take(13.0) == (True, 0, 0.0)
    log = RefusalLog()  # one line a minute
    assert log.line("refused", 0.0) == "refused" and log.line("refused", 59.0) is None
    assert log.line("refused", 60.0) == "refused (1 more refused in the 60 s since the last line)"
