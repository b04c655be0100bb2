"""The rule that tells another client taking our client id from a plain network cut
(edge_queue/mqtt/takeover.py): plain data and a clock, no broker."""

from __future__ import annotations

from edge_queue.mqtt.takeover import (
    SESSION_TAKEN_OVER,
    SHORT_CONNECTION_S,
    SHORT_CONNECTIONS,
    SHORT_WINDOW_S,
    TAKEOVER_MAX_S,
    TakeoverRule,
)


def ended(rule: TakeoverRule, now: float, *, lasted: float = 1.0, code: int | None = None, **kw: bool):
    args = {"was_connected": True, "closing": False, "refused_copy": False, **kw}
    return rule.after_disconnect(now, reason_code=code, connected_at=now - lasted, **args)


def test_the_broker_saying_so_is_a_takeover_and_the_wait_doubles_to_a_cap() -> None:
    rule = TakeoverRule()
    delays = [ended(rule, 100.0 * i, code=SESSION_TAKEN_OVER, lasted=500).delay_s for i in range(1, 6)]
    assert delays == [10.0, 20.0, 40.0, TAKEOVER_MAX_S, TAKEOVER_MAX_S]
    assert rule.count == 5


def test_short_connections_in_a_row_are_a_takeover_long_ones_are_not() -> None:
    rule = TakeoverRule()
    for i in range(SHORT_CONNECTIONS - 1):
        assert ended(rule, 10.0 * i) is None
    took = ended(rule, 10.0 * SHORT_CONNECTIONS)
    assert took is not None and "connections ended within" in took.why
    # a connection that lasted is a network cut, whatever came before
    rule = TakeoverRule()
    for i in range(10):
        assert ended(rule, 100.0 * i, lasted=SHORT_CONNECTION_S + 1) is None


def test_short_connections_spread_over_more_than_the_window_are_not() -> None:
    rule = TakeoverRule()
    for i in range(10):
        assert ended(rule, i * (SHORT_WINDOW_S / (SHORT_CONNECTIONS - 1) + 1)) is None


def test_our_own_stop_and_a_refused_copy_explain_the_end() -> None:
    rule = TakeoverRule()
    for i in range(10):
        assert ended(rule, float(i), refused_copy=True) is None
    assert ended(rule, 20.0, closing=True, code=SESSION_TAKEN_OVER) is None
    assert ended(rule, 21.0, was_connected=False) is None  # a reconnect that never connected


def test_plain_network_cuts_a_minute_apart_are_not_a_takeover() -> None:
    # three cuts in two minutes, each a few seconds after a reconnect that succeeded at once
    # (before: a take-over ERROR and a 10-s wait on the third)
    rule = TakeoverRule()
    assert [ended(rule, t, lasted=3.0) for t in (0.0, 50.0, 100.0)] == [None, None, None]


def test_two_clients_taking_one_id_every_second_or_two_are_a_takeover() -> None:
    rule = TakeoverRule()
    ends = [ended(rule, 2.0 * i, lasted=1.0) for i in range(1, SHORT_CONNECTIONS + 1)]
    assert ends[:-1] == [None] * (SHORT_CONNECTIONS - 1) and ends[-1] is not None


def test_a_failed_reconnect_between_short_connections_means_the_network_was_down() -> None:
    rule = TakeoverRule()
    for i in range(1, 2 * SHORT_CONNECTIONS):
        assert ended(rule, 2.0 * i, lasted=1.0) is None
        if i % (SHORT_CONNECTIONS - 1) == 0:
            rule.reconnect_failed()


def test_the_newcomer_stops_when_the_owner_takes_its_session_back_and_the_owner_goes_on() -> None:
    from edge_queue.mqtt.takeover import ForeignMessages, Takeover

    newcomer, owner = ForeignMessages(recorded=None), ForeignMessages(recorded="shared-id")
    newcomer.after_connect(session_present=True, client_id="shared-id")  # a session it did not make
    owner.after_connect(session_present=True, client_id="shared-id")  # its own
    assert newcomer.newcomer and not owner.newcomer
    assert newcomer.after_takeover(Takeover(10.0, "it says so"), "shared-id") == TAKEOVER_MAX_S
    assert newcomer.shared is not None  # the service stops with exit code 6
    assert owner.after_takeover(Takeover(10.0, "it says so"), "shared-id") == 10.0
    assert owner.shared is None
    # a first connect without a session found is no newcomer, whatever the store recorded
    alone = ForeignMessages(recorded=None)
    alone.after_connect(session_present=False, client_id="shared-id")
    assert alone.after_takeover(Takeover(20.0, "it says so"), "shared-id") == 20.0 and alone.shared is None
