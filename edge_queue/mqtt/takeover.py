"""Another client connected with our client id: the rule that tells a take-over from a plain
network cut, and how long to wait before taking the id back (docs/operations.md).

Plain data and a clock passed in: tested without a broker.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

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
#: start, within SHORT_WINDOW_S, each followed by a reconnect that succeeded at the first try
#: (the broker up all along), are taken for a take-over. Two clients with one id take it from
#: each other every second or two; plain network cuts a minute apart (3 in 2 minutes) are not.
SHORT_CONNECTIONS, SHORT_CONNECTION_S, SHORT_WINDOW_S = 4, 5.0, 60.0


@dataclass
class Takeover:
    """Why a connection's end was taken for a take-over, and the wait before reconnecting."""

    delay_s: float
    why: str

    def say(self, client_id: str) -> float:
        """Log the take-over as one ERROR line; the wait before reconnecting (seconds)."""
        log.error(
            "the broker closed our connection because another client connected with our client id %r (%s): "
            "another edge-queue with the same mqtt.client_id, or a client using it; reconnecting in %.0f s",
            client_id,
            self.why,
            self.delay_s,
        )
        return self.delay_s


@dataclass
class TakeoverRule:
    """Remembers recent take-overs and short connections (monotonic seconds)."""

    takeovers: list[float] = field(default_factory=list)
    short: list[float] = field(default_factory=list)  # ends of connections that lasted under SHORT_CONNECTION_S
    #: take-overs seen since the start
    count: int = 0

    def reconnect_failed(self) -> None:
        """A reconnect attempt failed: the broker or the network was down, so the short
        connections before it were cut, not taken."""
        self.short.clear()

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


#: The store's record of the client id whose broker session this installation made.
SESSION_KEY = "session_client_id"
#: The exit code of ``serve``/``up`` that stopped because another installation shares its client
#: id (docs/cli.md, "Exit codes"); systemd does not restart on it.
EXIT_SHARED_CLIENT_ID = 6


@dataclass
class ForeignMessages:
    """Messages our session received on topics we never subscribed to: the session holds
    subscriptions of another client that uses our client id (two installations given the
    same ``mqtt.client_id``), which then takes requests meant for us, and we for it
    (docs/operations.md, "Several boxes on one broker").

    Which installation stops is decided once, at the first connect of this run: the
    *newcomer* found a session it did not make (present, while the store records no session
    of this client id as its own). Another installation's request is never acknowledged, by
    either: the broker keeps it in the session and sends it again to whichever client holds
    the session next, its owner in time. The newcomer, at the first one, makes ``shared``: the
    service logs one ERROR, takes its own requests still on their way, and exits with
    :data:`EXIT_SHARED_CLIENT_ID`. The owner of the session never stops for it (so the two
    never both stop): it logs an ERROR per other base topic, and the other's requests wait
    unacknowledged for their owner. Any other foreign message is acknowledged."""

    #: the first other installation's request topic seen by the newcomer; None: none yet
    shared: str | None = None
    #: the client id whose session the store records as this installation's own (set at boot)
    recorded: str | None = None
    #: decided at the first connect of this run
    newcomer: bool = False
    decided: bool = False
    #: the client id to record as ours in the store (:meth:`record`), once
    unrecorded: str | None = None
    #: the other installations' base topics whose requests reached the session's owner
    waiting: set[str] = field(default_factory=set)

    def after_connect(self, session_present: bool, client_id: str) -> None:
        """A CONNACK: at the first one of this run, decide whether we are the newcomer."""
        if self.decided:
            return
        self.decided = True
        self.newcomer = session_present and self.recorded != client_id
        if not self.newcomer and self.recorded != client_id:
            self.unrecorded = client_id

    def record(self, store: Any) -> None:
        """Keep in ``store`` (a :class:`~edge_queue.store.Store`, inside the turn) that the
        session of our client id is ours."""
        if self.unrecorded is not None:
            store.set_meta_text(SESSION_KEY, self.unrecorded)
            self.recorded, self.unrecorded = self.unrecorded, None

    def note(self, topic: str, topics: Topics, client_id: str) -> str:
        """A message on ``topic`` outside our request topics arrived: ``"ours"`` (a node's
        message, an echo), ``"leave"`` (another installation's request: not acknowledged) or
        ``"ack"``."""
        if topic.startswith(topics.nodes_prefix) or topic.startswith(topics.base + "/"):
            return "ours"
        if "/request/" not in topic:
            return "ack"
        if self.newcomer:
            if self.shared is None:
                self.shared = topic
                log.error(
                    "our MQTT session received %s, a request of another installation: it uses our client id %r "
                    "(two installations must not share an mqtt.client_id: give each its own, or leave it unset); "
                    "stopping with exit code %d and leaving its requests to it, unacknowledged",
                    topic[:200],
                    client_id,
                    EXIT_SHARED_CLIENT_ID,
                )
            return "leave"
        base = topic.split("/request/", 1)[0]
        if base not in self.waiting and len(self.waiting) < 100:
            self.waiting.add(base)
            log.error(
                "our MQTT session received %s, a request of another installation: it uses our client id %r, and "
                "stops (exit code %d) when it sees one of ours; its requests wait in the session for it, not run "
                "here (two installations must not share an mqtt.client_id: give each its own, or leave it unset)",
                topic[:200],
                client_id,
                EXIT_SHARED_CLIENT_ID,
            )
        return "leave"

    def after_takeover(self, takeover: Takeover, client_id: str) -> float:
        """Another client took our session (:class:`TakeoverRule` said so): the wait before
        reconnecting (seconds). When we are the newcomer, the session we found at our first
        connect was not made by this installation, and now its owner takes it back: another
        installation uses our client id. Then ``shared`` is set and one ERROR line logged, and
        the service stops with :data:`EXIT_SHARED_CLIENT_ID` at once, without waiting for one of
        the other's requests (with none arriving, the two took the session from each other for
        ever); :data:`TAKEOVER_MAX_S` is returned. The owner logs the take-over
        (:meth:`Takeover.say`) and goes on."""
        if not self.newcomer:
            return takeover.say(client_id)
        if self.shared is None:
            self.shared = "(the session taken back by its owner)"
            log.error(
                "another client took back our MQTT session (client id %r), which this installation did not make: "
                "another installation uses our client id (two installations must not share an mqtt.client_id: "
                "give each its own, or leave it unset); stopping with exit code %d",
                client_id,
                EXIT_SHARED_CLIENT_ID,
            )
        return TAKEOVER_MAX_S
