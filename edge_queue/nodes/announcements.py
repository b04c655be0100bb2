"""What the hub keeps of a worker node's announcement (docs/nodes.md, "What the hub takes from
a node"): only the fields it shows, each bounded before anything is copied, so that a node
announcing a 3.4 MB list of kinds costs ``<base>/info``, ``<base>/queue`` and the log no more
than an honest one. Plain functions.
"""

from __future__ import annotations

import re
from typing import Any

#: Kinds a node may announce, and the longest kind name.
MAX_KINDS, MAX_KIND_CHARS = 64, 64
#: Models a node may announce, and the longest model name.
MAX_MODELS, MAX_MODEL_CHARS = 32, 200
#: The node protocol this hub speaks (``"v"`` of every node message, docs/nodes.md, "Topics").
PROTOCOL = 1
#: The longest host name, version and device kept.
MAX_HOST_CHARS, MAX_VERSION_CHARS, MAX_DEVICE_CHARS = 255, 64, 32
KIND_NAME = re.compile(rf"[A-Za-z0-9_.-]{{1,{MAX_KIND_CHARS}}}")


def _text(value: Any, most: int) -> str | None:
    return value if isinstance(value, str) and 0 < len(value) <= most and value.isprintable() else None


def bounded(msg: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The announcement ``msg`` as the hub keeps it: ``incompatible`` (why the hub gives the
    node no job: its ``"v"`` is not :data:`PROTOCOL`; else None), ``host``, ``version``, ``device`` (text
    within their bounds, else None), ``kinds`` (names of at most :data:`MAX_KIND_CHARS`
    letters, digits, ``_``, ``.`` or ``-``, at most :data:`MAX_KINDS`) and ``models`` (at most
    :data:`MAX_MODELS` names); and what was left out, one phrase each (empty when nothing)."""
    problems: list[str] = []
    raw_kinds = msg.get("kinds")
    kinds: list[str] = []
    if isinstance(raw_kinds, list):
        kinds = [k for k in raw_kinds[:MAX_KINDS] if isinstance(k, str) and KIND_NAME.fullmatch(k)]
        if len(raw_kinds) > MAX_KINDS or len(kinds) < min(len(raw_kinds), MAX_KINDS):
            problems.append(
                f"kinds: {len(raw_kinds)} given, {len(kinds)} kept (names of 1-{MAX_KIND_CHARS} characters)"
            )
    raw_models = msg.get("models")
    models: list[str] | None = None
    if isinstance(raw_models, list):
        models = [m for m in raw_models[:MAX_MODELS] if _text(m, MAX_MODEL_CHARS)]
        if len(models) < len(raw_models):
            problems.append(f"models: {len(raw_models)} given, {len(models)} kept")
    incompatible = None
    if msg.get("v") != PROTOCOL:
        shown = str(msg.get("v"))[:20]
        incompatible = (
            f"speaks node protocol {shown}; this hub speaks {PROTOCOL}: it gets no jobs (upgrade one of them)"
        )
        problems.append(incompatible)
    kept = {
        "incompatible": incompatible,
        "host": _text(msg.get("host"), MAX_HOST_CHARS),
        "version": _text(msg.get("version"), MAX_VERSION_CHARS),
        "device": _text(msg.get("device"), MAX_DEVICE_CHARS),
        "kinds": kinds,
        "models": models,
    }
    for key, most in (("host", MAX_HOST_CHARS), ("version", MAX_VERSION_CHARS), ("device", MAX_DEVICE_CHARS)):
        if msg.get(key) is not None and kept[key] is None:
            problems.append(f"{key} left out (not text of at most {most} characters)")
    return kept, problems
