"""What a worker node can tell from the hub's retained ``<base>/info`` about why it gets no
work (docs/nodes.md, "When a node gets no job"): the hub does not list it in ``access.nodes``
(``node_ids``; a hub of an earlier release: ``nodes``),
it shows it ``incompatible``, or a ``[[path_map]]`` entry names a folder outside every one of the
hub's media roots (no job input can ever lie there). Plain functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import PurePosixPath
from typing import Any

from .pathmap import Entry

#: Seconds after connecting before a node looks at the hub's info: the hub lists a node once it
#: has read its announcement, so the info first received may predate it.
HUB_VIEW_AFTER_S = 10.0


def node_problems(info: Any, node_id: str, entries: Sequence[Entry]) -> list[str]:
    """Why the hub of ``info`` (its ``<base>/info`` object) gives node ``node_id`` no job, one
    sentence each naming the fix; empty when none is seen. ``entries``: this node's path map."""
    if not isinstance(info, dict) or info.get("state") == "offline":
        return []
    problems = []
    listed = info.get("nodes")
    nodes: list[Any] = listed if isinstance(listed, list) else []
    mine = next((n for n in nodes if isinstance(n, dict) and n.get("node_id") == node_id), None)
    allowed = info.get("node_ids")  # access.nodes; a node not running yet is in it, not in nodes
    if node_id not in (
        allowed if isinstance(allowed, list) else [n.get("node_id") for n in nodes if isinstance(n, dict)]
    ):
        problems.append(
            f"the hub does not list this node ({node_id!r}) in its nodes: its access.nodes must name "
            "this node's id, which is its broker user name (or nodes.node_id)"
        )
    elif mine is not None and isinstance(mine.get("incompatible"), str):
        problems.append(f"the hub shows this node incompatible: {mine['incompatible'][:300]}")
    roots = [PurePosixPath(r) for r in info.get("media_roots") or [] if isinstance(r, str)]
    for hub_folder, _ in entries:
        folder = PurePosixPath(hub_folder)
        if roots and not any(folder == r or r in folder.parents or folder in r.parents for r in roots):
            problems.append(
                f"path_map hub = {hub_folder} is outside the hub's media roots "
                f"({', '.join(map(str, roots))}): no job's input lies there; it must name the hub's folder"
            )
    return problems
