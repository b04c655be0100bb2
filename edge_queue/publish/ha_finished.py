"""``<base>/ha/finished``: one message per finished job for Home Assistant's "Job finished"
event entity, and, when Home Assistant comes back after being offline, the ones that ended
meanwhile (docs/home-assistant.md, "Jobs that end while Home Assistant is down").

Home Assistant's MQTT integration has the broker publish ``offline`` on
``<prefix>/status`` when it stops or loses its connection (its Last Will; it does not
disconnect cleanly on purpose), and ``online`` once it has started, its discovered entities
have subscribed and discovery has cooled down (its birth message). The event log's newest id
when ``offline`` came is kept in the store (``ha_offline_after``), so that a restart of
edge-queue while Home Assistant is down loses nothing; at ``online`` the ``end`` events after
it are sent again, marked ``late``: the first :data:`REPLAY_MAX`, oldest first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from edge_queue.errors import NotFoundError
from edge_queue.mqtt import payloads
from edge_queue.mqtt.bridge import Bridge
from edge_queue.mqtt.topics import Topics
from edge_queue.store import Store

from . import discovery

log = logging.getLogger(__name__)

#: At most this many finished jobs are sent again when Home Assistant comes back.
REPLAY_MAX = 100
#: The store key of the event cursor kept while Home Assistant is offline.
CURSOR_KEY = "ha_offline_after"
#: The cursor's value while Home Assistant is not known to be offline.
NOT_OFFLINE = -1


class FinishedJobs:
    """``<base>/ha/finished`` (discovery on), live and after Home Assistant was offline.

    Args:
        bridge: where messages go.
        topics: the installation's topic names.
        store: returns the open store (the event log and the cursor).
    """

    def __init__(self, bridge: Bridge, topics: Topics, store: Callable[[], Store]) -> None:
        self.bridge, self.topics, self.store = bridge, topics, store

    def ended(self, job: dict[str, Any]) -> None:
        """A job reached a terminal state (its ``end`` event, ``event_id`` in ``job``)."""
        self._send(discovery.finished_payload(job, job["state"], job.get("event_id"), late=False))

    def home_assistant(self, online: bool) -> None:
        """Home Assistant's status: ``offline`` keeps the event cursor (once, until it is back);
        ``online`` sends the jobs that ended meanwhile."""
        store = self.store()
        after = store.meta(CURSOR_KEY)
        offline = after is not None and after >= 0
        if not online:
            if not offline:
                store.set_meta(CURSOR_KEY, store.newest_event_id())
            return
        if not offline:
            return
        assert after is not None
        events, _, dropped = store.events_after(after, REPLAY_MAX + 1, types=["end"])
        store.set_meta(CURSOR_KEY, NOT_OFFLINE)
        sent = 0
        for event in events[:REPLAY_MAX]:
            try:
                job = store.get(event["job_id"])
            except NotFoundError:  # purged since
                continue
            self._send(discovery.finished_payload(job, event["state"], event["event_id"], late=True))
            sent += 1
        if sent or len(events) > REPLAY_MAX or dropped:
            log.info(
                "Home Assistant is back: sent it %d job(s) that ended while it was offline%s",
                sent,
                f" (the first {REPLAY_MAX} only: more ended)" if len(events) > REPLAY_MAX else "",
            )

    def _send(self, body: dict[str, Any]) -> None:
        self.bridge.publish(discovery.finished_topic(self.topics), payloads.encode(body))
