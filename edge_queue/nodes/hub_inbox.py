"""The hub's inbox of worker nodes' messages (docs/nodes.md): what the bridge hands over on the
node topics, kept for the loop's next turn within bounds (a message's size, each node's share,
the whole), from the nodes in ``access.nodes`` only, and read a bounded piece of each node's
per turn (:func:`~.hub_rules.within`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from edge_queue.logfmt import clip
from edge_queue.mqtt.topics import Topics
from edge_queue.rules.rates import RejectionLog
from edge_queue.store.chunks import MAX_CHUNK_BYTES

from .hub_rules import POLL_BYTES_PER_NODE, counted, within

#: Node messages waiting for the next turn at most; more are dropped (their nodes send again
#: until the hub answers ``ok``; a dropped ``chunk`` is decoded again on resume).
INBOX_MAX = 10_000
#: ... and their bytes. One listed node sending 1 MB messages as fast as the broker took them
#: held 846 MB in the hub and made a submit wait 14.7 s for its answer before these bounds.
INBOX_BYTES_MAX = 64 * 1024 * 1024
#: What one node may have waiting, of :data:`INBOX_MAX` and :data:`INBOX_BYTES_MAX`: a node
#: that floods the hub is dropped from, and the others are still read.
NODE_INBOX_MAX = 1_000
NODE_INBOX_BYTES_MAX = 16 * 1024 * 1024
#: The largest node message read: a kept chunk (``MAX_CHUNK_BYTES`` of JSON, store/chunks.py)
#: in its envelope. A larger one is dropped unread.
MESSAGE_MAX_BYTES = MAX_CHUNK_BYTES + 64 * 1024


class NodeInbox:
    """Node messages waiting for the loop's next turn, for the hub's :class:`~.hub.Nodes` (the
    loop's thread; no locking). Its length is the number of messages waiting.

    Args:
        allowed: ``access.nodes``: the node ids whose messages are kept; any other's are ignored
            (a warning once per node id, for the first 1,000).
        topics: the installation's topics (a node topic read as node id and level).
        refused: the hub's rate-limited log of refused node messages, shared with it.
    """

    def __init__(self, allowed: Iterable[str], topics: Topics, refused: RejectionLog) -> None:
        self.allowed, self.topics, self.refused = frozenset(allowed), topics, refused
        self.items: list[tuple[str, str, bytes]] = []  # (node id, topic level, payload), oldest first
        self.bytes = 0
        self.waiting: Counter[str] = Counter()  # messages of each node in the inbox
        self.waiting_bytes: Counter[str] = Counter()
        self.told: set[str] = set()  # node ids not in access.nodes, logged once each

    def __len__(self) -> int:
        return len(self.items)

    def on_message(self, topic: str, payload: bytes, retain: bool) -> None:
        """A message on a node topic (called by the bridge on the loop's thread). Kept for the
        next :meth:`take` within the bounds above (:data:`MESSAGE_MAX_BYTES` a message,
        :data:`NODE_INBOX_MAX` and :data:`NODE_INBOX_BYTES_MAX` a node, :data:`INBOX_MAX` and
        :data:`INBOX_BYTES_MAX` in all); dropped, with a rate-limited warning, over them."""
        parsed = self.topics.parse_node(topic)
        if parsed is None:
            return
        node_id, level = parsed
        if node_id not in self.allowed:
            if node_id not in self.told and len(self.told) < 1000:
                self.told.add(node_id)
                self.refused.logger.warning("node %s is not in access.nodes: its messages are ignored", clip(node_id))
            return
        size = len(payload)
        if size > MESSAGE_MAX_BYTES:
            self.refused.warning("node %s sent %d bytes, over %d: dropped unread", node_id, size, MESSAGE_MAX_BYTES)
            return
        if (
            self.waiting[node_id] >= NODE_INBOX_MAX
            or self.waiting_bytes[node_id] + size > NODE_INBOX_BYTES_MAX
            or len(self.items) >= INBOX_MAX
            or self.bytes + size > INBOX_BYTES_MAX
        ):
            self.refused.warning("node %s sends faster than the hub reads: a message dropped", node_id)
            return
        self.items.append((node_id, level, payload))
        self.bytes += size
        self.waiting[node_id] += 1
        self.waiting_bytes[node_id] += size

    def take(self) -> list[tuple[str, str, bytes]]:
        """This turn's messages, (node id, topic level, payload) oldest first: each node's up to
        :data:`~.hub_rules.POLL_BYTES_PER_NODE` bytes (its first always); the rest waits for the
        next turn, in order."""
        now, self.items = within(self.items, POLL_BYTES_PER_NODE)
        self.bytes = sum(len(item[2]) for item in self.items)
        self.waiting, self.waiting_bytes = counted(self.items)
        return now
