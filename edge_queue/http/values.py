"""A call's query and form values read as the HTTP API's routes take them: flags and whole
numbers, each bad value ``invalid_request`` naming the parameter."""

from __future__ import annotations

from typing import Any

from edge_queue.errors import ErrorCode, RequestError

#: The whole numbers ``min_speakers`` and ``max_speakers`` take: the job options' bounds
#: (docs/topics.md, "Speakers"), checked here so that a refusal names the call's own field.
SPEAKERS = range(1, 33)


def flag(value: Any, default: bool, name: str | None = None) -> bool:
    """A query or form flag: ``true``/``1``/``yes``/``on`` or ``false``/``0``/``no``/``off``;
    ``default`` when absent or empty. Raises :class:`~edge_queue.errors.RequestError`
    ``invalid_request`` for anything else, its ``field`` ``name``."""
    if value is None or value == "":
        return default
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    said = f"{name}: " if name else ""
    raise RequestError(f"{said}{str(value)[:40]!r} is not true or false", code=ErrorCode.INVALID_REQUEST, field=name)


def count(value: str, name: str, within: range | None = None) -> int:
    """A query's or form's whole number (``min_speakers=2``): ASCII digits only (no sign, space
    or other script's digits; empty is not a number), within ``within`` when given; anything
    else is ``invalid_request`` naming ``name`` (its ``field``)."""
    if not (value.isascii() and value.isdigit()):
        raise RequestError(f"{name}: {value[:40]!r} is not a whole number", field=name)
    number = int(value)
    if within is not None and number not in within:
        raise RequestError(f"{name}: {number} is not within {within.start}-{within.stop - 1}", field=name)
    return number


def speaker_bounds(min_value: str | None, max_value: str | None) -> dict[str, int]:
    """The job options ``min_speakers`` and ``max_speakers`` of a call's values (None: not
    given), each a whole number in :data:`SPEAKERS`, the first not above the second. Raises
    :class:`~edge_queue.errors.RequestError` ``invalid_request`` naming the field at fault."""
    out = {
        name: count(value, name, SPEAKERS)
        for name, value in (("min_speakers", min_value), ("max_speakers", max_value))
        if value is not None
    }
    if out.get("min_speakers", SPEAKERS.start) > out.get("max_speakers", SPEAKERS.stop - 1):
        raise RequestError(
            f"max_speakers: {out['max_speakers']} is below min_speakers ({out['min_speakers']})", field="max_speakers"
        )
    return out
