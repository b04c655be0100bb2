"""When a finished job counts as notified to Home Assistant, and what is sent for the ones that
are not (docs/home-assistant.md, "Jobs that end while Home Assistant is down"). Plain functions
over plain data.

A finished run is *owed* to Home Assistant from the commit of its end until the broker says the
``<base>/ha/finished`` message that carries it reached a subscriber: with MQTT 5, the PUBACK's
reason code (16, "No matching subscribers", means nobody got it; MQTT 5.0, 3.4.2.1). Home
Assistant's MQTT integration subscribes with a clean session, so while it is stopped nobody
does. What decides, in order:

- Home Assistant's Last Will (``offline`` on ``homeassistant/status``) seen on this connection:
  a run that ends is owed and not sent (another subscriber, such as the queue page, would make
  the broker say "received");
- its birth message (``online``): everything owed is sent;
- our own (re)connect, when Home Assistant's state is not known: everything owed is sent, with
  MQTT 5 only (with MQTT 3.1.1 the broker cannot say whether anyone got it, so it waits for
  the next birth message: late, but once).

Owed runs are sent one by one up to :data:`SINGLE_MAX`; more are one summary of them all (event
type ``missed``, with the counts) followed by the newest run on its own, so that "Job finished"
ends on the newest job, as "Last result" does, and a phone gets two notifications, not a burst.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from .unheard import NO_MATCHING_SUBSCRIBERS

#: Owed runs sent one by one; more are one ``missed`` summary and the newest.
SINGLE_MAX = 3
#: Owed runs kept; beyond, the oldest are dropped (counted in the next summary's ``dropped``).
OWED_MAX = 1_000
#: An owed run handed to the broker and not acknowledged for this long may be sent again (s).
IN_FLIGHT_S = 60.0
#: Job ids a summary lists, newest first.
SUMMARY_IDS = 20


def send_live(ha_online: bool | None) -> bool:
    """Whether a run that just ended is sent now: unless Home Assistant's Last Will is the
    last word heard of it on this connection (``ha_online`` False; None: not known)."""
    return ha_online is not False


def send_owed(trigger: str, mqtt5: bool) -> bool:
    """Whether the owed runs are sent at ``trigger``: ``"online"`` (Home Assistant's birth
    message) always; ``"connect"`` (ours, Home Assistant's state unknown) with MQTT 5 only,
    whose PUBACK says whether anyone got them."""
    if trigger == "online":
        return True
    if trigger == "connect":
        return mqtt5
    raise ValueError(f"unknown trigger {trigger!r}")


def delivered(reason_code: int) -> bool:
    """Whether a ``<base>/ha/finished`` message acknowledged with ``reason_code`` reached a
    subscriber (with MQTT 3.1.1 the code is always 0: taken as reached)."""
    return reason_code != NO_MATCHING_SUBSCRIBERS


def plan(owed: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The messages for ``owed`` (rows ``{"event_id", "job_id", "state", "finished_at"}``,
    oldest first): a list of groups, each one message; a group of one row is that run, a
    larger group is a summary of them all, followed by the newest run alone."""
    if len(owed) <= SINGLE_MAX:
        return [[row] for row in owed]
    return [owed, [owed[-1]]]


def summary(rows: list[dict[str, Any]], dropped: int) -> dict[str, Any]:
    """The ``missed`` event for ``rows`` (oldest first) and ``dropped`` older runs not kept:
    ``count`` (``dropped`` included), counts per end state, ``job_ids`` (the newest
    :data:`SUMMARY_IDS`), ``first_finished_at``/``last_finished_at``, and ``text``, a sentence
    for a notification."""
    by_state = Counter(str(r["state"]) for r in rows)
    count = len(rows) + dropped
    parts = [f"{by_state[s]} {s}" for s in ("succeeded", "failed", "cancelled") if by_state[s]]
    return {
        "event_type": "missed",
        "event_id": rows[-1]["event_id"] if rows else None,
        "count": count,
        "succeeded": by_state["succeeded"],
        "failed": by_state["failed"],
        "cancelled": by_state["cancelled"],
        "dropped": dropped,
        "job_ids": [r["job_id"] for r in reversed(rows)][:SUMMARY_IDS],
        "first_finished_at": rows[0].get("finished_at") if rows else None,
        "last_finished_at": rows[-1].get("finished_at") if rows else None,
        "text": f"{count} jobs ended while Home Assistant or the broker was away: "
        + ", ".join(parts)
        + (f" ({dropped} older not counted by state)" if dropped else "")
        + "; the newest follows",
        "late": True,
    }
