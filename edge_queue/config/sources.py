"""What the configuration's sources hold, checked before pydantic reads them: values of the
TOML file whose TOML type is not their key's (pydantic would convert them), and the
environment variables of lists and tables that are not JSON (pydantic-settings names neither
the variable nor JSON). The model they are checked against is passed in: :mod:`.config`'s
``Settings``.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Mapping
from typing import Any, get_args, get_origin

from pydantic import BaseModel

#: ``X | None`` and ``Optional[X]``.
UNIONS = (types.UnionType, typing.Union)


def _kind_of(annotation: Any) -> Any:
    """``int``, ``float``, ``bool``, a section model, ``("list", model)``, ``("dict", model)``
    or ``None`` (checked by pydantic alone) for a field's annotation."""
    args = [a for a in get_args(annotation) if a is not type(None)] if get_origin(annotation) in UNIONS else []
    if args:
        return _kind_of(args[0]) if len(args) == 1 else None
    origin = get_origin(annotation)
    if origin in (list, dict):
        item = _kind_of(get_args(annotation)[-1])
        return (origin.__name__, item) if isinstance(item, type) and issubclass(item, BaseModel) else None
    if annotation in (int, float, bool) or (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return annotation
    return None


def toml_type_problems(data: Any, model: type[BaseModel], where: str = "") -> list[str]:
    """Values of a TOML document (``data``, as ``tomllib`` reads it) whose TOML type is not
    the key's: a string, a boolean or a float for an integer key, a string or a boolean for a
    number, anything but ``true``/``false`` for a boolean. pydantic converts them (``"2"``,
    ``true`` and ``2.0`` gave 2); TOML has types of its own, so a file saying ``"2"`` is a
    mistake to name. The environment's values are strings, converted as before. Returns one
    ``key: problem`` line per value, keys named as pydantic names them (``watch.0.settle_s``)."""
    problems: list[str] = []
    if not isinstance(data, dict):
        return problems
    for key, value in data.items():
        field = model.model_fields.get(key)
        if field is None:
            continue  # unknown keys are pydantic's to name
        name, kind = f"{where}{key}", _kind_of(field.annotation)
        shown = f"{type(value).__name__} ({value!r:.40})"
        if kind is int and (type(value) is not int):
            problems.append(f"{name}: should be an integer, not a {shown}")
        elif kind is float and type(value) not in (int, float):
            problems.append(f"{name}: should be a number, not a {shown}")
        elif kind is bool and type(value) is not bool:
            problems.append(f"{name}: should be true or false, not a {shown}")
        elif isinstance(kind, type) and issubclass(kind, BaseModel):
            problems += toml_type_problems(value, kind, f"{name}.")
        elif isinstance(kind, tuple) and kind[0] == "list" and isinstance(value, list):
            for i, item in enumerate(value):
                problems += toml_type_problems(item, kind[1], f"{name}.{i}.")
        elif isinstance(kind, tuple) and kind[0] == "dict" and isinstance(value, dict):
            for sub, item in value.items():
                problems += toml_type_problems(item, kind[1], f"{name}.{sub}.")
    return problems


def _takes_json(parts: list[str], settings: type[BaseModel]) -> bool:
    """Whether the key an environment variable names (``parts``: ``["mqtt", "tls"]``) is a
    list or a table, whose value the environment gives as JSON."""
    model: type[BaseModel] = settings
    at = 0
    while at < len(parts):
        info = model.model_fields.get(parts[at])
        if info is None:
            return False
        kind = _kind_of(info.annotation)
        if at == len(parts) - 1:
            return (
                get_origin(info.annotation) in (list, dict)
                or isinstance(kind, tuple)
                or (isinstance(kind, type) and issubclass(kind, BaseModel))
            )
        if isinstance(kind, tuple) and kind[0] == "dict":  # [kinds.<name>]: skip the name
            model, at = kind[1], at + 2
        elif isinstance(kind, type) and issubclass(kind, BaseModel):
            model, at = kind, at + 1
        else:
            return False
    return False


def not_json_in_environment(field: str, environ: Mapping[str, str], settings: type[BaseModel]) -> str:
    """The message for an environment variable of a list or a table (``field``, a top-level
    key of ``settings``, the configuration's model) whose value pydantic-settings could not
    read as JSON: the variables that are not JSON, by name, and how a list is written."""
    prefix = f"EDGE_QUEUE_{field.upper()}"
    bad = []
    for name, value in environ.items():
        if (name.upper() == prefix or name.upper().startswith(prefix + "__")) and _takes_json(
            name[len("EDGE_QUEUE_") :].lower().split("__"), settings
        ):
            try:
                json.loads(value)
            except ValueError:
                bad.append(name)
    shown = ", ".join(sorted(bad)) or f"{prefix} (or one below it)"
    return (
        f"the environment variable {shown} should hold JSON: lists and tables take "
        """JSON, as in EDGE_QUEUE_MEDIA_ROOTS='["/srv/media"]'"""
    )
