"""Who calls the HTTP API, and how often they may (docs/http-api.md, "Who may call").

A caller is the user its API key names (``[api] keys``: user -> key, sent as ``Authorization:
Bearer <key>`` or ``X-API-Key: <key>``), or, without a key, ``api.anonymous_user`` when that is
set. Plain data and functions: :func:`caller_of` decides, :class:`CallRate` counts.
"""

from __future__ import annotations

import hmac
import math
from collections import OrderedDict, deque
from dataclasses import dataclass

from edge_queue.config.api import ApiSettings

from .statuses import HttpError

#: Callers whose recent calls are remembered, at most (the oldest are forgotten first): the
#: rate limit's memory is bounded whatever the number of addresses calling.
MAX_TRACKED_CALLERS = 4096


@dataclass(frozen=True, slots=True)
class Caller:
    """``user``: the user the calls act as; ``key``: what the rate limit counts by (the user
    with a key, ``addr:<address>`` without one); ``placeholder``: a key not in ``[api] keys``
    taken as no key (``api.anonymous_user``)."""

    user: str
    key: str
    placeholder: bool = False


class Refused(HttpError):
    """A call refused before its body is read: its error ``code`` (docs/http-api.md, "Errors");
    ``retry_after_s`` when the caller may try again later."""


def presented_key(authorization: str | None, api_key: str | None) -> str | None:
    """The key a request presents: ``Authorization: Bearer <key>`` or ``X-API-Key: <key>``."""
    if authorization:
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    if api_key and api_key.strip():
        return api_key.strip()
    return None


def caller_of(settings: ApiSettings, key: str | None, address: str) -> Caller:
    """The caller presenting ``key`` (``None``: none) from ``address``. Every configured key is
    compared in constant time. A key that is not one of ``[api] keys`` is no key when
    ``api.anonymous_user`` is set: OpenAI's clients cannot send none, and send a placeholder
    (``sk-no-key-required``, ``EMPTY``, ...) that opens nothing a call without a key does not
    open already (docs/http-api.md, "Who may call"). Raises :class:`Refused` 401
    (``unauthorized``) for a wrong key, and for no key, when ``api.anonymous_user`` is unset."""
    if key is not None:
        found = None
        for user, secret in settings.keys.items():
            if hmac.compare_digest(key.encode(), secret.get_secret_value().encode()):
                found = user
        if found is not None:
            return Caller(found, found)
        if settings.anonymous_user is None:
            raise Refused("unauthorized", "the API key is not one of [api] keys")
        return Caller(settings.anonymous_user, f"addr:{address}", placeholder=True)
    if settings.anonymous_user is None:
        raise Refused(
            "unauthorized", "an API key is needed (Authorization: Bearer <key>); [api] anonymous_user is unset"
        )
    return Caller(settings.anonymous_user, f"addr:{address}")


class CallRate:
    """At most ``per_minute`` calls per caller in any 60 s (a sliding window of call times),
    remembering at most :data:`MAX_TRACKED_CALLERS` callers."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._calls: OrderedDict[str, deque[float]] = OrderedDict()

    def take(self, key: str, now: float) -> None:
        """Count one call of ``key`` at ``now`` (monotonic seconds). Raises :class:`Refused`
        429 (``rate_limited``, with the seconds until a call is free) when it is one too many."""
        calls = self._calls.pop(key, None) or deque()
        while calls and now - calls[0] >= 60.0:
            calls.popleft()
        if len(calls) >= self.per_minute:
            self._calls[key] = calls
            wait = max(1, math.ceil(60.0 - (now - calls[0])))
            raise Refused("rate_limited", f"more than {self.per_minute} calls a minute ([api] calls_per_minute)", wait)
        calls.append(now)
        self._calls[key] = calls
        while len(self._calls) > MAX_TRACKED_CALLERS:
            self._calls.popitem(last=False)
