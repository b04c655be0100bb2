"""Records of executed requests, so that one delivered again after a lost acknowledgement is
answered with its first response, not executed twice (docs/topics.md, "Requests delivered twice").
"""

from __future__ import annotations

from .connection import Connection
from .rows import REMEMBER_REQUEST


class RequestRecords:
    """The ``delivered_requests`` table."""

    def __init__(self, c: Connection) -> None:
        self.c = c

    def remember_request(self, key: bytes, response: bytes, reply_to: str | None, now: float, seq: int) -> None:
        """Record the response to an executed request, in the transaction of its effect, so
        that the same request delivered again (``key``: :func:`edge_queue.requests.dispatch.request_key`)
        is answered with it instead of taking effect twice. ``seq``: how many requests the
        service had received when this one came (the window of :meth:`recall_request`).

        Inside :meth:`.Connection.group`, the row is written with the group's other deferred
        rows, before any other statement (:meth:`recall_request` included) and before the
        commit."""
        row = (key, response, reply_to, now, seq)
        if self.c.group_depth == 1:
            self.c.deferred_requests.append(row)
        else:
            self.c.conn.execute(REMEMBER_REQUEST, row)

    def recall_request(self, key: bytes) -> tuple[bytes, str | None, int] | None:
        """``(response, reply_to, seq)`` recorded for ``key``, or None."""
        row = self.c.conn.execute(
            "SELECT response, reply_to, seq FROM delivered_requests WHERE key = ?", [key]
        ).fetchone()
        return None if row is None else (bytes(row[0]), row[1], int(row[2]))

    def forget_all_requests(self) -> None:
        """Drop every record: the broker lost our session, so nothing it sends is a redelivery."""
        with self.c.immediate():
            self.c.conn.execute("DELETE FROM delivered_requests")

    def forget_requests(self, before: float) -> int:
        """Drop the records of requests executed before ``before`` (Unix seconds); their count."""
        with self.c.immediate():
            return self.c.conn.execute("DELETE FROM delivered_requests WHERE at < ?", [before]).rowcount
