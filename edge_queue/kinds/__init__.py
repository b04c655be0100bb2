"""Job kinds: the built-in ones and those registered through the ``edge_queue.kinds`` entry
point group (a name mapped to a :class:`~edge_queue.kinds.base.Kind` subclass)."""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

from .base import Kind, KindOptions
from .noop import Noop
from .probe import Probe
from .transcribe import Transcribe

log = logging.getLogger(__name__)

BUILTIN: dict[str, type[Kind]] = {k.name: k for k in (Transcribe, Probe, Noop)}
ENTRY_POINT_GROUP = "edge_queue.kinds"


def registry() -> dict[str, type[Kind]]:
    """Every available kind, name -> class: built-ins, then entry points (which cannot
    replace a built-in). A broken entry point is logged and skipped."""
    kinds = dict(BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in kinds:
            log.warning("kind %s from %s ignored: a built-in has that name", ep.name, ep.value)
            continue
        try:
            cls = ep.load()
        except Exception:  # a third-party plug-in must not stop the service
            log.exception("cannot load kind %s from %s", ep.name, ep.value)
            continue
        if isinstance(cls, type) and issubclass(cls, Kind):
            kinds[ep.name] = cls
        else:
            log.warning("kind %s from %s is not a Kind subclass", ep.name, ep.value)
    return kinds


__all__ = ["BUILTIN", "Kind", "KindOptions", "registry"]
