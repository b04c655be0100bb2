"""``<base>/ha/finished``: each finished job for Home Assistant's "Job finished" event entity,
once, whatever restarts in whatever order (docs/home-assistant.md, "Jobs that end while Home
Assistant is down").

A run's end is owed to Home Assistant from the commit that ends it (``ha_owed`` in the store, in
the same transaction) until the broker's PUBACK for the message carrying it says a subscriber
got it; the rules are :mod:`edge_queue.rules.ha_delivery`. Home Assistant's MQTT integration
has the broker publish ``offline`` on ``<prefix>/status`` when it stops or loses its connection
(its Last Will) and ``online`` once its entities have subscribed (its birth message); neither is
retained, so after our own (re)connect its state is not known until it speaks again.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable
from typing import Any

from edge_queue.errors import NotFoundError
from edge_queue.mqtt import payloads
from edge_queue.mqtt.bridge import Bridge
from edge_queue.mqtt.outbox import Pub
from edge_queue.mqtt.topics import Topics
from edge_queue.rules import ha_delivery
from edge_queue.rules.unheard import Unheard
from edge_queue.store import Store

from . import discovery

log = logging.getLogger(__name__)


#: what the log line of :meth:`FinishedJobs.send_owed` says of why
WHY = {
    "online": "is online",
    "connect": "may be online (edge-queue connected)",
    "heard": "or another subscriber reads <base>/ha/finished again",
}


class FinishedJobs:
    """``<base>/ha/finished`` (discovery on): live, and what Home Assistant did not get.

    Args:
        bridge: where messages go.
        topics: the installation's topic names.
        store: returns the open store (``ha_owed``).
    """

    def __init__(self, bridge: Bridge, topics: Topics, store: Callable[[], Store]) -> None:
        self.bridge, self.topics, self.store = bridge, topics, store
        #: Home Assistant's last word on this connection: True (birth), False (Last Will), None
        self.ha_online: bool | None = None
        #: owed runs handed to the broker and not yet acknowledged: event id -> monotonic time
        self.in_flight: dict[int, float] = {}
        self.reached: list[int] = []  # event ids a subscriber got, deleted from ha_owed by step()
        self.dropped_reported = False  # a summary with the dropped count reached a subscriber
        #: whether anyone reads <base>/ha/finished (rules/unheard): a run that ends while nobody
        #: does is owed, not sent; once a try is heard, what is owed is sent
        self.unheard = Unheard()
        #: told of Home Assistant's birth message (the publisher: <base>/events is sent again)
        self.on_birth: Callable[[], None] = lambda: None

    def ended(self, job: dict[str, Any]) -> None:
        """A job reached a terminal state (its ``end`` event, ``event_id`` in ``job``), inside
        the turn's group: owed in the same transaction, and sent unless Home Assistant's Last
        Will is the last word heard of it."""
        event_id, state = job.get("event_id"), job["state"]
        if event_id is None:  # (every end has one; without it nothing could be tracked)
            self._publish(discovery.finished_payload(job, state, event_id, late=False), None)
            return
        row = {"event_id": int(event_id), "job_id": job["job_id"], "state": state}
        self.store().ha_owed.owe(row["event_id"], row["job_id"], state, job.get("finished_at"))
        if ha_delivery.send_live(self.ha_online) and self.unheard.send(time.monotonic()):
            body = discovery.finished_payload(job, state, event_id, late=False)
            self._send([row], body, reports_dropped=False, counted=True)

    def step(self) -> None:
        """Forget the runs that reached Home Assistant (inside a turn's group, or on its own)."""
        if not self.reached:
            return
        owed = self.store().ha_owed
        try:
            owed.delivered(self.reached)
            if self.dropped_reported:
                owed.forget_dropped()
        except (sqlite3.Error, OSError) as e:  # kept for the next turn
            log.warning("could not record what Home Assistant received: %s", e)
            return
        self.reached, self.dropped_reported = [], False

    def connected(self, mqtt5: bool) -> None:
        """Our own (re)connect: Home Assistant's state is not known; the owed runs are sent when
        the broker can say whether anyone got them (MQTT 5)."""
        self.ha_online = None
        self.unheard.wake()
        if ha_delivery.send_owed("connect", mqtt5):
            self.send_owed("connect")

    def home_assistant(self, online: bool) -> None:
        """Home Assistant's status: its Last Will (``online`` False) or its birth message, at
        which everything it did not get is sent."""
        self.ha_online = online
        if online:
            self.unheard.wake()
            self.on_birth()
        if online and ha_delivery.send_owed("online", True):
            self.send_owed("online")

    def send_owed(self, why: str) -> None:
        """Send the owed runs not in flight: one by one, or a summary and the newest."""
        store = self.store()
        try:
            rows, dropped = store.ha_owed.owed()
        except (sqlite3.Error, OSError) as e:  # (a full disk): sent at the next chance
            log.warning("could not read the finished jobs owed to Home Assistant: %s", e)
            return
        now = time.monotonic()
        self.in_flight = {i: t for i, t in self.in_flight.items() if now - t < ha_delivery.IN_FLIGHT_S}
        reached = set(self.reached)  # got by a subscriber, not yet forgotten by step()
        rows = [
            r
            for r in rows
            if now - self.in_flight.get(r["event_id"], -1e9) >= ha_delivery.IN_FLIGHT_S and r["event_id"] not in reached
        ]
        if not rows:
            return
        groups = ha_delivery.plan(rows)
        for group in groups:
            if len(group) > 1:
                self._send(group, ha_delivery.summary(group, dropped), reports_dropped=bool(dropped))
                continue
            row = group[0]
            try:
                job = store.get(row["job_id"])
            except NotFoundError:  # purged since: nothing to tell
                self.reached.append(row["event_id"])
                continue
            self._send(
                group, discovery.finished_payload(job, row["state"], row["event_id"], late=True), reports_dropped=False
            )
        log.info(
            "Home Assistant %s: sending it %d finished job(s) it has not received%s",
            WHY.get(why, why),
            len(rows) + dropped,
            " as one summary and the newest" if len(groups[0]) > 1 else "",
        )

    def _send(
        self, rows: list[dict[str, Any]], body: dict[str, Any], *, reports_dropped: bool, counted: bool = False
    ) -> None:
        """Send ``body`` for the owed ``rows``; ``counted``: :meth:`Unheard.send` counted it."""
        ids = [r["event_id"] for r in rows]
        now = time.monotonic()
        for i in ids:
            self.in_flight[i] = now
        if not counted:
            self.unheard.sending()

        def receipt(reason_code: int) -> None:
            for i in ids:
                self.in_flight.pop(i, None)
            if ha_delivery.delivered(reason_code):
                self.reached.extend(ids)
                self.dropped_reported = self.dropped_reported or reports_dropped
            if self.unheard.acknowledged(reason_code, time.monotonic()):
                self.send_owed("heard")  # a subscriber came: what ended meanwhile, late

        self._publish(body, receipt)

    def _publish(self, body: dict[str, Any], receipt: Callable[[int], None] | None) -> None:
        # QoS 1, with the PUBACK's reason code handed to ``receipt`` (Outbox.acknowledged)
        topic = discovery.finished_topic(self.topics)
        self.bridge.outbox.put(Pub(topic, payloads.encode(body), False, receipt=receipt))
