"""The loop's parts (docs/architecture.md, "The turn's parts"): their order in a turn, and what
each keeps when a turn's commit fails."""

from __future__ import annotations

from typing import Any

from edge_queue.component import Component
from edge_queue.config.settings import Settings
from edge_queue.jobs.outcomes import Outcomes
from edge_queue.service import Service
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
