"""The HTTP API's intake (an :class:`~.ports.Intake`): typed requests handed over from the API's
thread, run by the queue (:class:`~.queue.Queue`) when the loop drains its intakes, answered
after the turn's commit; and the end of the jobs those requests wait for.

Thread-safe by construction: the API's thread only hands calls over (:class:`~.handoff.Handoff`)
and writes one byte to the wake socket; everything else runs on the loop's thread, and each
answer reaches the API as a :class:`concurrent.futures.Future` (docs/http-api.md, "How a
call becomes a job").

Bounds: at most :data:`CALLS_PER_TURN` requests are run per turn (the rest wait for the next
one), and a waiter costs one dictionary entry until its job ends or its caller goes away. An
upload goes with its job's failure or cancel (:meth:`HttpIntake.committed`): only a succeeded
job's upload is kept (docs/http-api.md, "Uploads").
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_queue.component import Component
from edge_queue.config.settings import Settings
from edge_queue.errors import ErrorCode
from edge_queue.http.api import Ended
from edge_queue.http.uploads import delete
from edge_queue.mqtt import payloads
from edge_queue.rules.states import is_terminal
from edge_queue.store import Store

from .handoff import Handoff
from .models import Request, RetryRequest, SubmitRequest
from .queue import Caller, Queue

log = logging.getLogger(__name__)

#: Requests of the API run in one turn of the loop, at most; the rest wait for the next turn.
CALLS_PER_TURN = 32


@dataclass(slots=True)
class _Call:
    command: str
    request: Request
    caller: Caller
    answered: Future[dict[str, Any]] = field(default_factory=Future)
    #: the end of the one job it made, found or retried
    ended: Future[Ended] | None = None


class HttpIntake(Component):
    """Requests from the HTTP API, run by the loop (:class:`~edge_queue.service.Service`).

    Args:
        settings: ``access`` (a caller's role) and ``uploads_dir``: a submit's inputs must be
            there, and the inputs of jobs that fail or are cancelled there are deleted.
        queue: the typed queue the requests run against.
        job_store: returns the open store.
        wake: the loop's wake socket (written from the API's thread).
        ended: the jobs that ended in the turn, job id -> the job's row
            (:attr:`~edge_queue.publish.publisher.Publisher.turn_ended`).
    """

    def __init__(
        self,
        settings: Settings,
        queue: Queue,
        job_store: Callable[[], Store],
        wake: socket.socket,
        ended: Mapping[str, dict[str, Any]],
    ) -> None:
        self._settings, self._queue, self._job_store = settings, queue, job_store
        self._uploads = settings.uploads_dir
        self._ended = ended
        self._incoming: Handoff[_Call] = Handoff(wake)
        #: run this turn, answered at its commit
        self._turn: list[tuple[_Call, dict[str, Any]]] = []
        #: job id -> the futures waiting for its end
        self._waiting: dict[str, list[Future[Ended]]] = {}
        #: jobs found already ended by this turn's submits (a duplicate of a finished job)
        self._done_now: list[str] = []

    # -- the API's thread ---------------------------------------------------------------

    def submit_and_wait(
        self, input: Path, options: dict[str, Any], idempotency_key: str, user: str | None
    ) -> tuple[Future[dict[str, Any]], Future[Ended]]:
        """``submit`` of one ``transcribe`` job of the upload ``input`` (inside ``uploads_dir``)
        as ``user``, and the end of its job: the first future gets the response
        (docs/topics.md, "Response shapes") once the turn is committed, the second is set once
        the job is terminal (at once for a duplicate of an ended job), and cancelled when the
        request is refused. Cancelling it (the caller went away) forgets the waiter; the job
        goes on. Raises ``pydantic.ValidationError`` for fields the request model refuses."""
        request = SubmitRequest(kind="transcribe", input=str(input), options=options, idempotency_key=idempotency_key)
        return self._wait_for("submit", request, user)

    def retry_and_wait(self, job_id: str, user: str | None) -> tuple[Future[dict[str, Any]], Future[Ended]]:
        """``retry`` of the job ``job_id`` as ``user``, and its end (as :meth:`submit_and_wait`)."""
        return self._wait_for("retry", RetryRequest(job_id=job_id), user)

    def _wait_for(
        self, command: str, request: Request, user: str | None
    ) -> tuple[Future[dict[str, Any]], Future[Ended]]:
        caller = Caller(user, self._settings.access.role_of(user), (self._uploads,))
        call = _Call(command, request, caller, ended=Future())
        self._hand_over(call)
        assert call.ended is not None
        return call.answered, call.ended

    def _hand_over(self, call: _Call) -> None:
        self._incoming.put(call)

    # -- the loop's thread --------------------------------------------------------------

    def wait_s(self, now: float) -> float | None:
        """0 while requests wait to be run, else None."""
        return 0.0 if self._incoming else None

    def turn(self, now: float) -> None:
        """Run up to :data:`CALLS_PER_TURN` waiting requests inside the turn's transaction."""
        for call in self._incoming.take(CALLS_PER_TURN):
            if call.answered.cancelled():
                continue
            response = self._queue.answer(call.command, call.request, call.caller)
            self._turn.append((call, response))
            if call.ended is not None:
                self._watch(call, response)

    def _watch(self, call: _Call, response: dict[str, Any]) -> None:
        assert call.ended is not None
        data = response.get("data") if response.get("status") == "ok" else None
        jobs = data.get("jobs") if isinstance(data, dict) else None
        job_id = jobs[0]["job_id"] if jobs else data.get("job_id") if isinstance(data, dict) else None
        if not isinstance(job_id, str):
            call.ended.cancel()
            return
        self._waiting.setdefault(job_id, []).append(call.ended)
        if is_terminal(self._job_store().get(job_id)["state"]):
            self._done_now.append(job_id)

    def committed(self) -> None:
        """After the turn's commit: answer its requests, and hand the jobs that ended in it
        (``ended``, the rows the turn published) to those waiting for them."""
        for call, response in self._turn:
            if not call.answered.cancelled():
                call.answered.set_result(response)
        self._turn.clear()
        self._drop_failed_uploads()
        if not self._waiting:
            self._done_now.clear()
            return
        ended = {job_id: row for job_id, row in self._ended.items() if job_id in self._waiting}
        store = self._job_store()
        for job_id in self._done_now:
            if job_id not in ended:
                ended[job_id] = store.get(job_id)
        self._done_now.clear()
        for job_id, row in ended.items():
            waiters = self._waiting.pop(job_id, [])
            live = [f for f in waiters if not f.cancelled()]
            if not live:
                continue
            result = Ended(payloads.job_object(row), store.output_files(job_id))
            for fut in live:
                if not fut.done():
                    fut.set_result(result)
        # callers that went away: their entries go at the next end of any job, bounded by the
        # API's connections meanwhile
        for job_id in [j for j, fs in self._waiting.items() if all(f.cancelled() for f in fs)]:
            del self._waiting[job_id]

    def _drop_failed_uploads(self) -> None:
        """Delete the uploads of the jobs that failed or were cancelled in the turn: nothing
        reads them again (the same audio sent again is answered from the job's error, or
        uploaded anew for its retry), and a caller's refused audio would otherwise hold the
        disk for ``retention_days`` and a day."""
        prefix = f"{self._uploads}/"
        for job in self._ended.values():
            path = job.get("input")
            if isinstance(path, str) and path.startswith(prefix) and job.get("state") in ("failed", "cancelled"):
                upload = Path(path)
                if upload.is_relative_to(self._uploads) and ".." not in upload.parts:
                    try:
                        delete(upload)
                    except OSError as e:
                        log.warning("HTTP API: cannot delete the upload of failed job %s: %s", job.get("job_id"), e)

    def turn_failed(self, *, disk_full: bool) -> None:
        """The turn's commit failed: its requests are answered with ``disk_full`` or
        ``internal_error`` (nothing of them was kept), and their waiters let go."""
        code = ErrorCode.DISK_FULL if disk_full else ErrorCode.INTERNAL_ERROR
        for call, _ in self._turn:
            if not call.answered.cancelled():
                call.answered.set_result(
                    payloads.error(code, "the store could not commit the request; nothing of it was kept")
                )
            if call.ended is not None:
                call.ended.cancel()
        self._turn.clear()
        self._done_now.clear()

    def stop(self) -> None:
        """The service stops: every caller still waiting is let go (its job stays queued), and
        so is every request handed over after (the API answers them 503 ``stopping``)."""
        self._incoming.stop()
        for waiters in self._waiting.values():
            for fut in waiters:
                fut.cancel()
        self._waiting.clear()
