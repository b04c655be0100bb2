"""How ``edge-queue --help`` names values: ``--kind KIND``, ``--timeout TIMEOUT``, and nothing
after a flag, instead of Typer's type tags (``<str>``, ``<bool>``, ``<list[str]>``), which
say how the value is parsed, not what it is. A choice keeps its list of choices."""

from __future__ import annotations

from typing import Any

from typer.core import TyperArgument, TyperCommand, TyperGroup


def _no_type(ctx: Any) -> None:
    return None


def plain_metavars(params: list[Any]) -> list[Any]:
    """Give each parameter without a metavar of its own the one help shows: none for a flag
    (``--wait``, ``--help``), ``[a|b|c]`` for a choice, the upper-case name otherwise; an
    argument keeps its name (``[FILES]...``) and its row shows no type."""
    for p in params:
        if isinstance(p, TyperArgument):
            p.display_type_rich = _no_type  # type: ignore[method-assign]  # Typer reads no metavar there
            continue
        if getattr(p, "metavar", "") is not None:
            continue
        desc = getattr(p, "type_descriptor", None)
        if getattr(p, "is_flag", False) or getattr(p, "count", False):
            p.metavar = ""
        elif desc is not None and desc.is_choice and desc.choices:
            p.metavar = "[" + "|".join(str(getattr(c, "value", c)) for c in desc.choices) + "]"
        else:
            p.metavar = (p.name or "value").upper()
    return params


class PlainCommand(TyperCommand):
    """A command whose help shows :func:`plain_metavars`."""

    def get_params(self, ctx: Any) -> list[Any]:
        return plain_metavars(super().get_params(ctx))


class PlainGroup(TyperGroup):
    """A group whose help shows :func:`plain_metavars`."""

    def get_params(self, ctx: Any) -> list[Any]:
        return plain_metavars(super().get_params(ctx))
