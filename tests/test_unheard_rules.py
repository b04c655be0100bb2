"""When a topic nobody reads is published (edge_queue/rules/unheard.py; docs/topics.md, "Messages
per job"): plain data over a clock, tested in milliseconds."""

from __future__ import annotations

from edge_queue.rules.unheard import NO_MATCHING_SUBSCRIBERS, UNHEARD_RETRY_S, Unheard

NOBODY, SOMEONE = NO_MATCHING_SUBSCRIBERS, 0


def test_every_message_is_sent_while_someone_reads_the_topic() -> None:
    u = Unheard()
    assert all(u.send(t / 10) for t in range(50))
    u.acknowledged(SOMEONE, 5.0)
    assert u.send(5.0) and u.skipped == 0


def test_after_nobody_read_one_only_one_try_a_second_is_sent() -> None:
    # Given a topic whose message the broker acknowledged with "no matching subscribers"
    u = Unheard()
    assert u.send(0.0)
    u.acknowledged(NOBODY, 0.01)
    # Then nothing is sent until a second has passed, then one try, then nothing again
    assert [u.send(t) for t in (0.02, 0.5, 1.0)] == [False, False, False]
    assert u.send(0.01 + UNHEARD_RETRY_S)
    assert not u.send(0.02 + UNHEARD_RETRY_S)
    assert u.skipped == 4
    # and a try nobody read keeps it so
    assert not u.acknowledged(NOBODY, 1.05)
    assert not u.send(1.5)
    assert u.send(2.02)


def test_a_try_someone_read_sends_everything_again() -> None:
    u = Unheard()
    u.send(0.0)
    u.acknowledged(NOBODY, 0.0)
    assert u.send(UNHEARD_RETRY_S)
    # When the try's PUBACK says it reached a subscriber
    assert u.acknowledged(SOMEONE, 1.1) is True  # heard again: the caller sends what is owed
    # Then every message goes again
    assert all(u.send(1.1 + t / 100) for t in range(10))
    assert u.acknowledged(SOMEONE, 1.3) is False  # already heard


def test_a_wake_sends_everything_again_and_a_late_nobody_from_before_it_is_ignored() -> None:
    # Given three messages in flight, then unheard
    u = Unheard()
    for _ in range(3):
        u.send(0.0)
    u.acknowledged(NOBODY, 0.0)
    assert not u.send(0.1)
    # When someone may be listening (a request, our connect, Home Assistant's birth)
    u.wake()
    assert u.send(0.2)
    # Then the PUBACKs of the two messages sent before the wake say nothing of now
    u.acknowledged(NOBODY, 0.3)
    u.acknowledged(NOBODY, 0.3)
    assert u.heard and u.send(0.3)
    # but one sent after it does
    u.acknowledged(NOBODY, 0.4)
    assert not u.heard and not u.send(0.5)


def test_owed_messages_sent_without_asking_count_in_the_order_of_the_pubacks() -> None:
    u = Unheard()
    u.wake()
    u.sending()  # an owed message, sent at a birth message
    u.acknowledged(NOBODY, 0.0)
    assert not u.heard
