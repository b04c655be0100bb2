"""The shape of a part of the loop's turn (docs/architecture.md, "The turn's parts").

The loop (:meth:`edge_queue.service.Service.tick`) runs its parts in one order each turn, inside
the turn's one transaction, then tells each whether the commit succeeded. A part implements
:class:`Component` by inheriting it and overriding what it does; the rest are the defaults here,
which do nothing. The intakes (:class:`edge_queue.requests.ports.Intake`) are components too.
"""

from __future__ import annotations

from typing import Protocol


class Component(Protocol):
    """A part of the loop's turn, in four phases:

    - :meth:`wait_s`, before the turn: how long the loop's ``select`` may wait for this part;
    - :meth:`turn`, inside the turn's transaction, in the loop's order (docs/architecture.md);
    - :meth:`committed`, after the commit succeeded: what the turn decided may leave now
      (answers, hand-outs, retained states);
    - :meth:`turn_failed`, after the commit failed: nothing of the turn was kept.
    """

    def wait_s(self, now: float) -> float | None:
        """Seconds until :meth:`turn` has work (0: now), or None for no deadline of its own;
        ``now`` is Unix seconds (the service's clock)."""
        return None

    def turn(self, now: float) -> None:
        """This part's share of the turn at ``now`` (Unix seconds), inside its transaction. An
        ``sqlite3.Error`` or ``OSError`` raised here fails the whole turn."""
        return None

    def committed(self) -> None:
        """The turn's commit succeeded."""
        return None

    def turn_failed(self, *, disk_full: bool) -> None:
        """The turn's commit failed (``disk_full``: for lack of space): nothing of it was kept."""
        return None
