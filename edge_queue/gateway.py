"""The HTTP API's way into the loop: requests handed over from the API's thread, run in the
loop's turn like any MQTT request, answered after the turn's commit; and the end of the jobs
those requests wait for.

Thread-safe by construction: the API's thread only appends to a :class:`collections.deque`
and writes one byte to the wake socket; everything else runs on the loop's thread, and each
answer reaches the API as a :class:`concurrent.futures.Future` (docs/http-api.md, "How a
call becomes a job").

Bounds: at most :data:`CALLS_PER_TURN` requests are run per turn (the rest wait for the next
one), and a waiter costs one dictionary entry until its job ends or its caller goes away. An
upload goes with its job's failure or cancel (:meth:`Gateway.committed`): only a succeeded
job's upload is kept (docs/http-api.md, "Uploads").
"""

from __future__ import annotations

import logging
import socket
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from edge_queue.errors import ErrorCode
from edge_queue.http.api import Ended
from edge_queue.http.uploads import delete
from edge_queue.mqtt import payloads
from edge_queue.rules.states import is_terminal
from edge_queue.store import Store

log = logging.getLogger(__name__)

#: Requests of the API run in one turn of the loop, at most; the rest wait for the next turn.
CALLS_PER_TURN = 32

#: ``execute(command, raw, user, input_roots)`` -> ``(response, reply_to)``: the requests'
#: handler (:meth:`~edge_queue.requests.commands.Commands.execute`).
Execute = Callable[..., tuple[dict[str, Any], Any]]


@dataclass(slots=True)
class _Call:
    command: str
    raw: bytes
    user: str | None
    input_roots: list[Path] | None
    answered: Future[dict[str, Any]] = field(default_factory=Future)
    #: submit only: the end of the one job it made (or found)
    ended: Future[Ended] | None = None


class Gateway:
    """Requests from the HTTP API, run by the loop (:class:`~edge_queue.service.Service`)."""

    def __init__(
        self, execute: Execute, job_store: Callable[[], Store], wake: socket.socket, uploads: Path | None = None
    ) -> None:
        self._execute, self._job_store, self._wake = execute, job_store, wake
        #: ``<data_dir>/uploads``: the inputs of jobs that fail or are cancelled there are deleted
        self._uploads = uploads
        self._incoming: deque[_Call] = deque()
        #: run this turn, answered at its commit
        self._turn: list[tuple[_Call, dict[str, Any]]] = []
        #: job id -> the futures waiting for its end
        self._waiting: dict[str, list[Future[Ended]]] = {}
        #: jobs found already ended by this turn's submits (a duplicate of a finished job)
        self._done_now: list[str] = []
        #: set by :meth:`stop`: a request handed over after it is let go at once
        self._stopped = False

    # -- the API's thread ---------------------------------------------------------------

    def request(
        self, command: str, raw: bytes, user: str | None, *, input_roots: list[Path] | None = None
    ) -> Future[dict[str, Any]]:
        """Run ``command`` with JSON payload ``raw`` as ``user`` in the loop's next turn; the
        future gets the response (docs/topics.md, "Response shapes") once the turn is committed.
        ``input_roots``: the folders a submit's inputs must be in, instead of ``media_roots``."""
        call = _Call(command, raw, user, input_roots)
        self._hand_over(call)
        return call.answered

    def submit_and_wait(
        self, raw: bytes, user: str | None, *, input_roots: list[Path] | None = None, command: str = "submit"
    ) -> tuple[Future[dict[str, Any]], Future[Ended]]:
        """``submit`` of one input (or ``retry`` of one job, with ``command``), and the end of
        its job: the second future is set once the job is terminal (at once for a duplicate of an
        ended job), and cancelled when the request is refused. Cancelling it (the caller went
        away) forgets the waiter; the job goes on."""
        call = _Call(command, raw, user, input_roots, ended=Future())
        self._hand_over(call)
        assert call.ended is not None
        return call.answered, call.ended

    def _hand_over(self, call: _Call) -> None:
        self._incoming.append(call)
        if self._stopped:  # after stop() took the requests waiting: let this one go too
            _let_go(call)
            return
        try:
            self._wake.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # the socket's buffer is full: the loop is awake already

    # -- the loop's thread --------------------------------------------------------------

    def pending(self) -> bool:
        """True while requests wait to be run."""
        return bool(self._incoming)

    def step(self) -> None:
        """Run up to :data:`CALLS_PER_TURN` waiting requests inside the turn's transaction."""
        for _ in range(min(CALLS_PER_TURN, len(self._incoming))):
            call = self._incoming.popleft()
            if call.answered.cancelled():
                continue
            response, _ = self._execute(call.command, call.raw, call.user, input_roots=call.input_roots)
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

    def committed(self, turn_jobs: Mapping[str, tuple[bytes, bool]]) -> None:
        """After the turn's commit: answer its requests, and hand the jobs that ended in it
        (``turn_jobs``: :attr:`~edge_queue.publish.publisher.Publisher.turn_jobs`, job id ->
        (encoded job object, terminal)) to those waiting for them."""
        for call, response in self._turn:
            if not call.answered.cancelled():
                call.answered.set_result(response)
        self._turn.clear()
        self._drop_failed_uploads(turn_jobs)
        if not self._waiting:
            self._done_now.clear()
            return
        ended = {job_id: body for job_id, (body, terminal) in turn_jobs.items() if terminal and job_id in self._waiting}
        store = self._job_store()
        for job_id in self._done_now:
            if job_id not in ended:
                ended[job_id] = payloads.encode(payloads.job_object(store.get(job_id)))
        self._done_now.clear()
        for job_id, body in ended.items():
            waiters = self._waiting.pop(job_id, [])
            live = [f for f in waiters if not f.cancelled()]
            if not live:
                continue
            result = Ended(orjson.loads(body), store.output_files(job_id))
            for fut in live:
                if not fut.done():
                    fut.set_result(result)
        # callers that went away: their entries go at the next end of any job, bounded by the
        # API's connections meanwhile
        for job_id in [j for j, fs in self._waiting.items() if all(f.cancelled() for f in fs)]:
            del self._waiting[job_id]

    def _drop_failed_uploads(self, turn_jobs: Mapping[str, tuple[bytes, bool]]) -> None:
        """Delete the uploads of the jobs that failed or were cancelled in the turn: nothing
        reads them again (the same audio sent again is answered from the job's error, or
        uploaded anew for its retry), and a caller's refused audio would otherwise hold the
        disk for ``retention_days`` and a day."""
        if self._uploads is None:
            return
        folder = str(self._uploads).encode()
        for body, terminal in turn_jobs.values():
            if not terminal or folder not in body:
                continue
            job = orjson.loads(body)
            path = job.get("input")
            if job.get("state") in ("failed", "cancelled") and isinstance(path, str):
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
        self._stopped = True  # before taking the waiting requests: none is missed by both
        while self._incoming:
            _let_go(self._incoming.popleft())
        for waiters in self._waiting.values():
            for fut in waiters:
                fut.cancel()
        self._waiting.clear()


def _let_go(call: _Call) -> None:
    call.answered.cancel()
    if call.ended is not None:
        call.ended.cancel()
