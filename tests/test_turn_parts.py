"""The loop's parts (docs/architecture.md, "The turn's parts"): their order in a turn, and what
each keeps when a turn's commit fails."""

from __future__ import annotations

from typing import Any

from edge_queue.component import Component
from edge_queue.config.settings import Settings
from edge_queue.jobs.outcomes import Outcomes
from edge_queue.service import Service
from edge_queue.store import Store
from edge_queue.workers.supervisor import Outcome


class RecordedOutcomes(Outcomes):
    """Outcomes whose applying is recorded (the ops of each turn's outcomes, in order)."""

    def __init__(self, reports: list[list[Outcome]]) -> None:
        super().__init__(
            lambda: None,  # type: ignore[arg-type,return-value]
            None,  # type: ignore[arg-type]
            crash_loop_limit=3,
            backoff=lambda attempt: 0.0,
            sources=(lambda: reports.pop(0) if reports else [],),
        )
        self.applied: list[list[str]] = []

    def apply_all(self, outcomes: list[Outcome], now: float) -> None:
        self.applied.append([f"{o.op}:{o.job_id}" for o in outcomes])


def test_outcomes_of_failed_turns_are_applied_in_the_next_whichever_part_failed() -> None:
    # Given a worker that reported progress and a success, then nothing, then a failure
    reports = [[Outcome("progress", "a", 1), Outcome("done", "a", 1)], [], [Outcome("failed", "b", 1)]]
    outcomes = RecordedOutcomes(reports)
    # When the turn that applied them fails to commit
    outcomes.turn(1.0)
    outcomes.turn_failed(disk_full=True)
    assert outcomes.wait_s(1.0) == 0.05  # soon again, not at once
    # and the next turn fails in a part before this one (this part's turn never ran)
    outcomes.turn_failed(disk_full=False)
    # Then the next turn that runs applies the success again (not its progress), then the new ones
    outcomes.turn(2.0)
    outcomes.committed()
    outcomes.turn(3.0)
    outcomes.committed()
    assert outcomes.applied == [["progress:a", "done:a"], ["done:a"], ["failed:b"]]
    assert outcomes.wait_s(3.0) is None


def test_the_intakes_come_first_and_every_part_has_the_component_shape(tmp_path: Any) -> None:
    svc = Service(Settings(data_dir=tmp_path))
    try:
        parts = svc.parts
        assert parts[: len(svc.intakes)] == svc.intakes  # a job from any door is claimed this turn
        assert all(Component in type(p).__mro__ for p in parts)  # its defaults, its four methods
        order = [parts.index(p) for p in (svc.outcomes, svc.nodes, svc.scheduler, svc.supervisor, svc.publisher)]
        assert order == sorted(order)  # outcomes free workers before the scheduler fills them
    finally:
        svc.close()


class Stamping(Component):
    """A part that stamps the clock in its turn, as an intake's submit does (``created_at``)."""

    def __init__(self, clock: Any) -> None:
        self.clock = clock
        self.seen: list[float] = []

    def turn(self, now: float) -> None:
        self.seen.append(self.clock())


class Receiving(Component):
    """A part that records the time its turn is given, as the scheduler's claim uses it
    (``started_at``)."""

    def __init__(self) -> None:
        self.given: list[float] = []

    def turn(self, now: float) -> None:
        self.given.append(now)


def test_no_part_is_given_a_time_before_what_an_earlier_part_stamped(tmp_path: Any) -> None:
    # Given a clock that moves on at every reading (a busy turn: the intake's submit reads it
    # after the turn began)
    ticks = iter(range(1000, 2000))
    svc = Service(Settings(data_dir=tmp_path), clock=lambda: float(next(ticks)))
    try:
        svc.store = Store(svc.settings.db_path, svc.settings.durability)  # the store boot() opens
        stamping, receiving = Stamping(svc.clock), Receiving()
        svc.parts = (stamping, receiving)
        # When a turn runs from a time read before it
        svc.tick(svc.clock())
        # Then the later part's time is not before the earlier part's stamp (a job submitted and
        # claimed in one turn: started_at >= created_at)
        assert receiving.given[0] >= stamping.seen[0]
        # and a time given to the turn later than the clock is kept (a turn run for a time ahead)
        svc.tick(5000.0)
        assert receiving.given[1] == 5000.0
    finally:
        svc.close()
