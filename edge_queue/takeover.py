"""Another client connected with our client id: the rule that tells a take-over from a plain
network cut, and how long to wait before taking the id back (docs/operations.md).

Plain data and a clock passed in: tested without a broker.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .topics import Topics

log = logging.getLogger(__name__)

#: MQTT 5 DISCONNECT reason code 0x8E: another connection took our client id (MQTT 5.0, 3.14.2.1).
SESSION_TAKEN_OVER = 0x8E
#: Seconds before reconnecting after a take-over: 10, doubling with each take-over of the last
#: TAKEOVER_WINDOW_S, at most 60.
TAKEOVER_MIN_S, TAKEOVER_MAX_S = 10.0, 60.0
TAKEOVER_WINDOW_S = 600.0
#: A broker that does not say "session taken over" (mosquitto 2.0.11 closes the old connection
#: without a DISCONNECT): this many connections that it ended within SHORT_CONNECTION_S of their
#: start, within SHORT_WINDOW_S, are taken for a take-over (two clients with one id take it from
#: each other every second or two).
SHORT_CONNECTIONS, SHORT_CONNECTION_S, SHORT_WINDOW_S = 3, 10.0, 120.0


@dataclass
class Takeover:
    """Why a connection's end was taken for a take-over, and the wait before reconnecting."""

    delay_s: float
    why: str


@dataclass
class TakeoverRule:
    """Remembers recent take-overs and short connections (monotonic seconds)."""

    takeovers: list[float] = field(default_factory=list)
    short: list[float] = field(default_factory=list)  # ends of connections that lasted under SHORT_CONNECTION_S
    #: take-overs seen since the start
    count: int = 0

    def after_disconnect(
        self,
        now: float,
        *,
        reason_code: int | None,
        was_connected: bool,
        connected_at: float,
        closing: bool,
        refused_copy: bool,
    ) -> Takeover | None:
        """A connection ended at ``now``: a :class:`Takeover` when another client took our id
        (the broker says so with reason code :data:`SESSION_TAKEN_OVER`, or
        :data:`SHORT_CONNECTIONS` connections ended within :data:`SHORT_CONNECTION_S` of their
        start in :data:`SHORT_WINDOW_S`), else None. ``closing``: we ended it ourselves;
        ``refused_copy``: a copy on a client-named topic, which the broker may refuse by closing
        the connection, went out on it (that explains a short connection)."""
        said = reason_code == SESSION_TAKEN_OVER
        if was_connected and not closing and not refused_copy and now - connected_at < SHORT_CONNECTION_S:
            self.short = [t for t in self.short if now - t < SHORT_WINDOW_S] + [now]
        if closing or not (said or len(self.short) >= SHORT_CONNECTIONS):
            return None
        self.takeovers = [t for t in self.takeovers if now - t < TAKEOVER_WINDOW_S] + [now]
        self.count += 1
        delay = min(TAKEOVER_MAX_S, TAKEOVER_MIN_S * 2 ** (len(self.takeovers) - 1))
        why = (
            "it says so"
            if said
            else f"{len(self.short)} connections ended within {SHORT_CONNECTION_S:.0f} s of their start "
            f"in {SHORT_WINDOW_S / 60:.0f} minutes, the broker up all along"
        )
        self.short.clear()
        return Takeover(delay, why)


@dataclass
class ForeignMessages:
    """Messages our session received on topics we never subscribed to: the session holds
    subscriptions of another client that uses our client id (two installations given the
    same ``mqtt.client_id``), which then takes requests meant for us, and we for it. Such a
    message is acknowledged (it is not ours to run, and left unacknowledged it would hold one
    of our Receive Maximum places for good), but never silently: the first one of each base is
    logged as an ERROR naming the cause (docs/operations.md, "Several boxes on one broker")."""

    bases: set[str] = field(default_factory=set)
    count: int = 0

    def note(self, topic: str, topics: Topics, client_id: str) -> None:
        """A message on ``topic`` that is not a request of ours arrived."""
        if topic.startswith(topics.nodes_prefix) or topic.startswith(topics.base + "/"):
            return  # ours (a node's message, an echo): not foreign
        self.count += 1
        base = topic.split("/request/", 1)[0] if "/request/" in topic else topic.rsplit("/", 1)[0]
        if base in self.bases or len(self.bases) >= 100:
            return
        self.bases.add(base)
        log.error(
            "our MQTT session received a message on %s, a topic this edge-queue never subscribed to: another "
            "client uses our client id %r (two installations with the same mqtt.client_id take each other's "
            "requests; give each its own, or leave mqtt.client_id unset); not run here",
            topic[:200],
            client_id,
        )
