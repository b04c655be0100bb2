"""Job kinds: the built-in ones and those registered through the ``edge_queue.kinds`` entry
point group (a name mapped to a :class:`~edge_queue.kinds.base.Kind` subclass)."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterable
from functools import partial
from importlib.metadata import entry_points

from .base import Kind, KindOptions
from .extract_audio import ExtractAudio
from .noop import Noop
from .probe import Probe
from .transcode import Transcode
from .transcribe import Transcribe

log = logging.getLogger(__name__)

BUILTIN: dict[str, type[Kind]] = {k.name: k for k in (Transcribe, Probe, ExtractAudio, Transcode, Noop)}
ENTRY_POINT_GROUP = "edge_queue.kinds"


def _load(ref: str) -> object:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def registry(extra: Iterable[str] = ()) -> dict[str, type[Kind]]:
    """Every available kind, name -> class: built-ins, then the ``edge_queue.kinds`` entry
    points, then ``extra`` import paths (``"package.module:KindClass"``, the ``extra_kinds``
    setting). None can replace a built-in; a broken plug-in is logged and skipped."""
    kinds = dict(BUILTIN)
    found: list[tuple[str | None, str, Callable[[], object]]] = [
        (ep.name, ep.value, ep.load) for ep in entry_points(group=ENTRY_POINT_GROUP)
    ]
    found += [(None, ref, partial(_load, ref)) for ref in extra]
    for name, ref, load in found:
        try:
            cls = load()
        except Exception:  # a third-party plug-in must not stop the service
            log.exception("cannot load kind %s", ref)
            continue
        if not (isinstance(cls, type) and issubclass(cls, Kind)):
            log.warning("kind %s is not a Kind subclass", ref)
            continue
        name = name or cls.name
        if name in BUILTIN:
            log.warning("kind %s from %s ignored: a built-in has that name", name, ref)
            continue
        kinds[name] = cls
    return kinds


__all__ = ["BUILTIN", "Kind", "KindOptions", "registry"]
