"""What the hub keeps of a worker node's announcement (docs/nodes.md, "What the hub takes from
a node"): only the fields it shows, each bounded before anything is copied, so that a node
announcing a 3.4 MB list of kinds costs ``<base>/info``, ``<base>/queue`` and the log no more
than an honest one; the :class:`Node` the hub makes of it, its slots within ``nodes.max_slots``.
Plain data and functions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from edge_queue.rules.rates import RejectionLog

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


@dataclass(slots=True)
class Node:
    """A node as its retained announcement describes it."""

    node_id: str
    online: bool
    kinds: frozenset[str]
    slots: int
    announcement: dict[str, Any]
    #: jobs its last heartbeat listed that it holds no lease for (it runs them still): they
    #: take slots until it drops them
    strays: set[tuple[str, int]] = field(default_factory=set)
    #: no hand-out until its next heartbeat: it went silent past a lease, or gave a job back
    hold: bool = False


def announced(node_id: str, msg: dict[str, Any], max_slots: int, refused: RejectionLog) -> Node:
    """The node ``node_id`` as its announcement ``msg`` describes it: online when its
    ``state`` says so, its fields :func:`bounded`, its ``slots`` at most ``max_slots``
    (``nodes.max_slots``), none when they or its ``kinds`` are out of range or it is
    ``incompatible``. What was left out is logged through ``refused``, the hub's rate limit."""
    online = msg.get("state") == "online"
    kept, problems = bounded(msg)  # nothing of the message is kept beyond these bounds
    if problems:
        refused.warning("node %s's announcement: %s", node_id, "; ".join(problems))
    kinds = msg.get("kinds")
    raw = msg.get("slots")
    slots = min(raw, max_slots) if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0 else None
    if isinstance(raw, int) and slots is not None and raw > max_slots:
        refused.warning("node %s announced %d slots: it gets %d (nodes.max_slots)", node_id, raw, slots)
    if slots is None or not isinstance(kinds, list):
        refused.warning("node %s announced slots or kinds out of range: it gets no jobs", node_id)
    return Node(
        node_id,
        online,
        frozenset(kept["kinds"]),
        0 if kept["incompatible"] else slots or 0,
        kept,
    )
