"""Every rate limit of edge-queue, as plain data over a clock the caller passes (monotonic
seconds): one room for the MQTT requests' rate, the HTTP API's calls a minute, and the throttled
log lines of what is refused (requests, HTTP calls, node messages, handshakes)
(docs/configuration.md, "[limits]", "[api]"; docs/operations.md).

- :class:`RequestRate`: ``limits.max_requests_per_s``, a token bucket shared by all senders.
- :class:`CallRate`: ``api.calls_per_minute``, a sliding window per caller, its memory bounded.
- :class:`Throttle`: at most so many in each window of so many seconds, the rest counted; under
  :class:`RejectionLog` (log lines, 20 in 10 s) and :class:`RefusalLog` (one line a minute).
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, deque
from typing import Any

log = logging.getLogger(__name__)

#: Rejected requests logged per window at most (:class:`RejectionLog`).
REJECTIONS_LOGGED, REJECTION_WINDOW_S = 20, 10.0
#: Refused handshakes: one line in this many seconds at most (:class:`RefusalLog`).
REFUSAL_LOG_S = 60.0
#: Callers whose recent calls :class:`CallRate` remembers, at most (the oldest are forgotten
#: first): its memory is bounded whatever the number of addresses calling.
MAX_TRACKED_CALLERS = 4096


class RequestRate:
    """``limits.max_requests_per_s`` as a token bucket of at least one token (so that a rate
    under 1/s still lets requests through); a rate of 0 is no limit. ``now``: monotonic
    seconds, the clock's when not given."""

    def __init__(self, rate: float, now: float | None = None) -> None:
        self.rate = rate
        self.tokens = 0.0
        self.at = time.monotonic() if now is None else now

    def budget(self, cap: int, now: float | None = None) -> int:
        """Requests that may be taken now, at most ``cap``."""
        if not self.rate:
            return cap
        mono = time.monotonic() if now is None else now
        self.tokens = min(max(self.rate, 1.0), self.tokens + (mono - self.at) * self.rate)
        self.at = mono
        return min(cap, int(self.tokens))

    def spend(self) -> None:
        if self.rate:
            self.tokens -= 1

    def ready(self, now: float | None = None) -> bool:
        """True when a request could be taken now."""
        mono = time.monotonic() if now is None else now
        return not self.rate or self.tokens + (mono - self.at) * self.rate >= 1


class CallRate:
    """At most ``per_minute`` calls per caller in any 60 s (a sliding window of call times),
    remembering at most :data:`MAX_TRACKED_CALLERS` callers."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._calls: OrderedDict[str, deque[float]] = OrderedDict()

    def take(self, key: str, now: float) -> int | None:
        """Count one call of ``key`` at ``now`` (monotonic seconds): None when it is within
        the rate, else (not counted) the whole seconds until a call is free, at least 1."""
        calls = self._calls.pop(key, None) or deque()
        while calls and now - calls[0] >= 60.0:
            calls.popleft()
        if len(calls) >= self.per_minute:
            self._calls[key] = calls
            return max(1, math.ceil(60.0 - (now - calls[0])))
        calls.append(now)
        self._calls[key] = calls
        while len(self._calls) > MAX_TRACKED_CALLERS:
            self._calls.popitem(last=False)
        return None

    def __len__(self) -> int:
        """Callers remembered."""
        return len(self._calls)


class Throttle:
    """At most ``most`` takes in each window of ``window_s`` seconds, a window opening at the
    first take after the last one closed; the takes refused are counted, and that count is
    handed over once, by the take that opens the next window."""

    def __init__(self, most: int, window_s: float) -> None:
        self.most, self.window_s = most, window_s
        self.start: float | None = None
        self.taken = 0
        self.left_out = 0

    def take(self, now: float) -> tuple[bool, int, float]:
        """One more at ``now`` (monotonic seconds): whether it is allowed, and, when it opens a
        window, how many were refused in the window before and how long that one lasted
        (else 0 and 0.0)."""
        ended, lasted = 0, 0.0
        if self.start is None or now - self.start >= self.window_s:
            if self.start is not None:
                ended, lasted = self.left_out, now - self.start
            self.start, self.taken, self.left_out = now, 0, 0
        if self.taken < self.most:
            self.taken += 1
            return True, ended, lasted
        self.left_out += 1
        return False, ended, lasted


class RejectionLog:
    """Log lines of one repeated kind (rejected requests, refused HTTP calls and node
    messages, failed commits), at most :data:`REJECTIONS_LOGGED` per :data:`REJECTION_WINDOW_S`
    seconds: one client sending thousands of bad requests, or a full disk, cannot flood the
    journal. The ones left out are counted, and the count is logged in one line with the first
    line of a later window.

    Args:
        what: what is counted, for that line ("rejected request(s)").
        level: the ``logging`` level of every line.
        logger: where the lines go.
    """

    def __init__(
        self, what: str = "rejected request(s)", level: int = logging.WARNING, logger: logging.Logger = log
    ) -> None:
        self.what, self.level, self.logger = what, level, logger
        self.throttle = Throttle(REJECTIONS_LOGGED, REJECTION_WINDOW_S)

    def warning(self, message: str, *args: Any) -> None:
        """Log ``message % args`` at :attr:`level`, unless this window's lines are spent."""
        allowed, left_out, lasted = self.throttle.take(time.monotonic())
        if left_out:
            self.logger.log(self.level, "%d more %s not logged in %.0f s", left_out, self.what, lasted)
        if allowed:
            self.logger.log(self.level, message, *args)


class RefusalLog:
    """Throttled log lines of refused handshakes: the first in each :data:`REFUSAL_LOG_S`
    seconds, with how many were left out before it. Plain: the caller passes ``now``
    (``time.monotonic()``) and logs what :meth:`line` returns."""

    def __init__(self) -> None:
        self.throttle = Throttle(1, REFUSAL_LOG_S)

    def line(self, text: str, now: float) -> str | None:
        """``text`` to log now (with the count left out since the last line), or None."""
        allowed, left_out, lasted = self.throttle.take(now)
        if not allowed:
            return None
        return f"{text} ({left_out} more refused in the {lasted:.0f} s since the last line)" if left_out else text
