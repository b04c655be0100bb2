"""Ids and times of the store: job and batch ids that sort in the order they were made, RFC 3339
timestamps, dedupe and idempotency keys (docs/topics.md, "`submit`": duplicates).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import time
from datetime import UTC, datetime
from typing import Any

_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"
_iso_second: tuple[int, str] = (-1, "")


def iso(ts: float) -> str:
    """Unix seconds -> ``2026-11-29T07:40:12.345Z`` (RFC 3339, UTC, milliseconds, truncated
    after rounding to microseconds, as ``datetime.fromtimestamp`` rounds). The text of the
    second is kept from the call before: a busy service stamps many changes per second."""
    global _iso_second
    frac, whole = math.modf(ts)
    us = round(frac * 1e6)
    second = int(whole)
    if us >= 1_000_000:
        second, us = second + 1, us - 1_000_000
    elif us < 0:  # before 1970
        second, us = second - 1, us + 1_000_000
    if _iso_second[0] != second:
        _iso_second = (second, datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S."))
    return f"{_iso_second[1]}{us // 1000:03d}Z"


def parse_iso(text: str) -> float:
    """Inverse of :func:`iso`. Raises ``ValueError`` for text that is not RFC 3339."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


_last_ms = 0
_pool = b""
_pool_at = 0


def _random64() -> int:
    """64 bits from the operating system's random source (``secrets``), drawn 4 KiB at a time:
    one system call per 512 ids instead of one per id."""
    global _pool, _pool_at
    if _pool_at >= len(_pool):
        _pool, _pool_at = secrets.token_bytes(4096), 0
    at = _pool_at
    _pool_at = at + 8
    return int.from_bytes(_pool[at : at + 8])


def _drop_pool() -> None:
    global _pool, _pool_at
    _pool, _pool_at = b"", 0


os.register_at_fork(after_in_child=_drop_pool)  # a forked child never reuses the parent's bits


def new_id(now: float | None = None) -> str:
    """A 16-character ``[a-z0-9]`` id: 9 characters of milliseconds + 7 random. Ids made by
    one process sort in the order they were made: within one millisecond the time part steps
    on by one (the monotonic rule of ULID)."""
    global _last_ms, _head
    ms = max(int((time.time() if now is None else now) * 1000), _last_ms + 1)
    _last_ms = ms
    high, low = divmod(ms, 1296)  # the first 7 digits change once every 1.296 s
    if _head[0] != high:
        _head = (high, _base36(high, 7))
    r = _random64()  # 64 random bits for 7 base-36 digits, the least significant first
    return (
        _head[1]
        + _B36_2[low]
        + _B36_2_REV[r % 1296]
        + _B36_2_REV[(r // 1296) % 1296]
        + _B36_2_REV[(r // 1679616) % 1296]
        + _ALPHABET[(r // 2176782336) % 36]
    )


def sender_key(idempotency_key: str, submitted_by: str | None) -> str:
    """The stored form of a sender's key: a user's keys live apart from the shared topics' and
    from every other user's (a NUL cannot be in a key that came in JSON: payloads refuse it)."""
    return idempotency_key if submitted_by is None else f"\x00{submitted_by}\x00{idempotency_key}"


def ids_after(newest: str | None) -> None:
    """Make the ids of this process sort after ``newest``, an id made by an earlier process
    (read from the store at start). The time part of an id runs ahead of the clock by 1 ms per
    id beyond 1,000 a second, so after a burst a restarted process would otherwise make ids
    that sort before the burst's (docs/topics.md: ids sort in creation order). Text that is
    not an id is ignored."""
    global _last_ms
    if newest is None or len(newest) != 16:
        return
    try:
        ms = int(newest[:9], 36)
    except ValueError:
        return
    _last_ms = max(_last_ms, ms)


def _base36(n: int, width: int) -> str:
    """The last ``width`` base-36 digits of ``n``, most significant first."""
    out = ""
    for _ in range(width):
        n, r = divmod(n, 36)
        out = _ALPHABET[r] + out
    return out


#: every 2-digit base-36 string, most significant digit first, and reversed
_B36_2 = [_base36(i, 2) for i in range(1296)]
_B36_2_REV = [d[::-1] for d in _B36_2]
_head: tuple[int, str] = (-1, "")


#: json.dumps(..., sort_keys=True, separators=(",", ":")) with one encoder for every call
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"))


def dedupe_key(kind: str, input_: str | None, options: dict[str, Any]) -> str:
    """sha256 of kind, input and canonical options: equal active jobs share it (docs/topics.md, "`submit`")."""
    canon = _CANONICAL.encode([kind, input_, options])
    return hashlib.sha256(canon.encode()).hexdigest()
