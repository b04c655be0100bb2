"""Whether anyone reads a topic that edge-queue publishes without retaining (``<base>/events``,
``<base>/ha/finished``), as the broker's PUBACKs tell: so that messages nobody receives are not
sent (docs/topics.md, "Messages per job"). Plain data over a clock passed in.

With MQTT 5, a broker acknowledges a message that matched no subscription with reason code 16,
"No matching subscribers" (MQTT 5.0, 3.4.2.1). After such a PUBACK the topic is *unheard*: its
messages are not sent, but for one try every :data:`UNHEARD_RETRY_S`. It is *heard* again when
a try (or any message of it still in flight) is acknowledged with another code (someone
subscribed meanwhile), and at once at :meth:`Unheard.wake`: a sign that someone may be
listening (our own connect, Home Assistant's birth message, a request other than ``submit``).
A subscriber that comes while the topic is unheard misses what was not sent until the next
try: never anything retained. With MQTT 3.1.1 every PUBACK says 0: every message is sent.
"""

from __future__ import annotations

#: A PUBACK reason code: the broker had no subscriber for the message (MQTT 5.0, 3.4.2.1).
NO_MATCHING_SUBSCRIBERS = 16
#: While a topic is unheard, one message of it is sent this often (seconds): the try that tells
#: a subscriber that came since.
UNHEARD_RETRY_S = 1.0


class Unheard:
    """One topic's state: heard (every message sent) or unheard (one try per ``retry_s``).

    The broker acknowledges our messages in the order it got them (MQTT 5.0, 4.6), so the
    PUBACKs are counted as they come: a "no subscriber" for a message sent before the last
    :meth:`wake` says nothing of who listens now, and is not taken into account.

    Args:
        retry_s: seconds between two tries while unheard.
    """

    def __init__(self, retry_s: float = UNHEARD_RETRY_S) -> None:
        self.retry_s = retry_s
        self.heard = True
        self.next_try = 0.0  # monotonic seconds: the next try while unheard
        self.sent = 0  # messages sent on the topic (counted by send and sending)
        self.acked = 0  # their PUBACKs so far
        self.woken_at = 0  # self.sent at the last wake
        self.skipped = 0  # messages not sent, ever

    def send(self, now: float) -> bool:
        """Whether a message on the topic is sent at ``now`` (monotonic seconds): always while
        heard; while unheard, once per ``retry_s`` (the try). Counts it when it is sent."""
        if not self.heard:
            if now < self.next_try:
                self.skipped += 1
                return False
            self.next_try = now + self.retry_s
        self.sent += 1
        return True

    def sending(self) -> None:
        """A message on the topic is sent without asking :meth:`send` (one that is owed)."""
        self.sent += 1

    def acknowledged(self, reason_code: int, now: float) -> bool:
        """The broker's PUBACK for the next message of the topic, with ``reason_code``, at
        ``now``. Returns True when it makes the topic heard again (someone subscribed)."""
        self.acked += 1
        if reason_code != NO_MATCHING_SUBSCRIBERS:
            was, self.heard = self.heard, True
            return not was
        if self.heard and self.acked > self.woken_at:
            self.heard = False
            self.next_try = now + self.retry_s
        return False

    def wake(self) -> None:
        """Someone may be listening now: every message is sent until a PUBACK of one sent from
        now on says that nobody is."""
        self.heard = True
        self.woken_at = self.sent
