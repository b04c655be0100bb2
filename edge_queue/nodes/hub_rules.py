"""Plain functions of the hub's side of worker nodes (:mod:`.hub`): how much of the nodes'
messages one loop turn reads, and how the nodes are shown (docs/nodes.md)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable
from typing import Any

#: Bytes of one node's messages read in one loop turn, at most (the rest waits for the next
#: turn; its first message always goes): a node flooding the hub with 4 MB heartbeats costs
#: each turn a bounded parse (about 0.1 s), and the other nodes' messages are read meanwhile.
POLL_BYTES_PER_NODE = 8 * 1024 * 1024
#: ``ok`` answers sent to one node in one turn, at most (a node holds at most ``nodes.max_slots``
#: jobs: its honest outcomes are a handful).
ACKS_PER_NODE = 64


def within(inbox: list[tuple[str, str, bytes]], budget: int) -> tuple[list[Any], list[Any]]:
    """``inbox`` ((node id, topic level, payload), oldest first) split into what this turn
    reads (each node's messages up to ``budget`` bytes, its first always) and what waits for
    the next, each node's in order."""
    used: Counter[str] = Counter()
    deferred: set[str] = set()  # nodes with messages left for the next turn: their order is kept
    now, later = [], []
    for item in inbox:
        node_id, size = item[0], len(item[2])
        if node_id in deferred or (used[node_id] and used[node_id] + size > budget):
            deferred.add(node_id)
            later.append(item)
        else:
            used[node_id] += size
            now.append(item)
    return now, later


def capped(acks: list[tuple[str, Any]], most: int) -> list[tuple[str, Any]]:
    """``acks`` ((node id, message), in order) with at most ``most`` for each node: 20,000
    forged outcomes in a turn cost the broker at most ``most`` answers, not 20,000."""
    sent: Counter[str] = Counter()
    out = []
    for node_id, msg in acks:
        if sent[node_id] < most:
            sent[node_id] += 1
            out.append((node_id, msg))
    return out


def counted(inbox: list[tuple[str, str, bytes]]) -> tuple[Counter[str], Counter[str]]:
    """Messages and bytes of each node in ``inbox``."""
    messages, size = Counter[str](), Counter[str]()
    for node_id, _, payload in inbox:
        messages[node_id] += 1
        size[node_id] += len(payload)
    return messages, size


def summary_of(nodes: Iterable[Any], leases: Iterable[Any], silent: Collection[str] = ()) -> list[dict[str, Any]]:
    """``nodes`` (:class:`~.announcements.Node`) as ``<base>/info`` and ``<base>/queue`` show them: id,
    online (false while ``silent``: not heard from for a lease, whatever its announcement
    says), silent, host, version, kinds, slots, running (their ``leases`` now), device, models."""
    held = Counter(lease.node_id for lease in leases)
    return [
        {
            "node_id": n.node_id,
            "online": n.online and n.node_id not in silent,
            "silent": n.node_id in silent,
            "incompatible": n.announcement.get("incompatible"),
            "host": n.announcement.get("host"),
            "version": n.announcement.get("version"),
            "kinds": sorted(n.kinds),
            "slots": n.slots,
            "running": held[n.node_id],
            "device": n.announcement.get("device"),
            "models": n.announcement.get("models"),
        }
        for n in sorted(nodes, key=lambda n: n.node_id)
    ]
