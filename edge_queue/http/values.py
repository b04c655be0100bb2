"""A call's query and form values read as the HTTP API's routes take them: flags and whole
numbers, each bad value ``invalid_request`` naming the parameter."""

from __future__ import annotations

from typing import Any

from edge_queue.errors import ErrorCode, RequestError


def flag(value: Any, default: bool) -> bool:
    """A query or form flag: ``true``/``1``/``yes``/``on`` or ``false``/``0``/``no``/``off``;
    ``default`` when absent or empty. Raises :class:`~edge_queue.errors.RequestError`
    ``invalid_request`` for anything else."""
    if value is None or value == "":
        return default
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise RequestError(f"{str(value)[:40]!r} is not true or false", code=ErrorCode.INVALID_REQUEST)


def count(value: str, name: str) -> int:
    """A query's or form's whole number (``min_speakers=2``); anything else is
    ``invalid_request`` naming ``name``."""
    try:
        return int(value.strip())
    except ValueError:
        raise RequestError(f"{name}: {value[:40]!r} is not a whole number", field=name) from None
