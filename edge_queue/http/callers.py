"""Who calls the HTTP API, and how often they may (docs/http-api.md, "Who may call").

A caller is the user its API key names (``[api] keys``: user -> key, sent as ``Authorization:
Bearer <key>`` or ``X-API-Key: <key>``), or, without a key, ``api.anonymous_user`` when that is
set. Plain data and functions: :func:`caller_of` decides, :func:`count_call` counts (the rate
itself is :class:`edge_queue.rules.rates.CallRate`, beside the queue's other rates). A refused
call raises :class:`~edge_queue.errors.RequestError` with its code.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from edge_queue.config.api import ApiSettings
from edge_queue.errors import ErrorCode, RequestError
from edge_queue.rules.rates import CallRate


@dataclass(frozen=True, slots=True)
class Caller:
    """``user``: the user the calls act as; ``key``: what the rate limit counts by (the user
    with a key, ``addr:<address>`` without one); ``placeholder``: a key not in ``[api] keys``
    taken as no key (``api.anonymous_user``)."""

    user: str
    key: str
    placeholder: bool = False


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
    open already (docs/http-api.md, "Who may call"). Raises :class:`~edge_queue.errors.RequestError`
    401 (``unauthorized``) for a wrong key, and for no key, when ``api.anonymous_user`` is unset."""
    if key is not None:
        found = None
        for user, secret in settings.keys.items():
            if hmac.compare_digest(key.encode(), secret.get_secret_value().encode()):
                found = user
        if found is not None:
            return Caller(found, found)
        if settings.anonymous_user is None:
            raise RequestError("the API key is not one of [api] keys", code=ErrorCode.UNAUTHORIZED)
        return Caller(settings.anonymous_user, f"addr:{address}", placeholder=True)
    if settings.anonymous_user is None:
        raise RequestError(
            "an API key is needed (Authorization: Bearer <key>); [api] anonymous_user is unset",
            code=ErrorCode.UNAUTHORIZED,
        )
    return Caller(settings.anonymous_user, f"addr:{address}")


def count_call(rate: CallRate, key: str, now: float) -> None:
    """Count one call of ``key`` at ``now`` (monotonic seconds) against ``api.calls_per_minute``
    (:class:`~edge_queue.rules.rates.CallRate`). Raises :class:`~edge_queue.errors.RequestError`
    429 (``rate_limited``, with the seconds until a call is free) when it is one too many."""
    wait = rate.take(key, now)
    if wait is not None:
        raise RequestError(
            f"more than {rate.per_minute} calls a minute ([api] calls_per_minute)",
            code=ErrorCode.RATE_LIMITED,
            retry_after_s=wait,
        )
