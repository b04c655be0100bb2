"""The Wyoming listener's intake (an :class:`~edge_queue.requests.ports.Intake`): voice commands
handed over from the listener's thread, run by the queue when the loop drains its intakes, and
answered with their job's end.

A voice command is a ``transcribe`` job of its WAV under ``<data_dir>/voice`` (the only folder
its caller may name), at priority :data:`PRIORITY` (claimed before every batch job; a short
input, so the short lane takes it while every worker is busy: docs/configuration.md,
``short_lane_s``), with one attempt (never run again once its caller is gone), writing no
file (``formats: []``: its transcript is in its result). The job is purged in the turn after
it ends (docs/home-assistant.md, "Voice (Assist)": nothing of a voice command is kept), and a
command whose caller went away is cancelled while it waits (one that
runs already ends: a cancel would end its worker process, whose model the next command needs).

Thread-safe as :class:`~edge_queue.requests.http_intake.HttpIntake` is: the listener's thread
only hands commands over (:class:`~edge_queue.requests.handoff.Handoff`); each answer comes back as a
:class:`concurrent.futures.Future`.
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
from edge_queue.errors import ErrorCode, NotFoundError
from edge_queue.mqtt import payloads
from edge_queue.requests.handoff import Handoff
from edge_queue.requests.models import CancelRequest, Request, SubmitRequest
from edge_queue.requests.queue import Caller, Queue
from edge_queue.rules.states import is_terminal
from edge_queue.store import Store

log = logging.getLogger(__name__)

#: A voice command's priority: the highest a submit may give (docs/topics.md, "submit").
PRIORITY = 100
#: Commands run in one turn of the loop, at most; the rest wait for the next turn.
CALLS_PER_TURN = 16


@dataclass(slots=True)
class _Call:
    request: Request
    answered: Future[dict[str, Any]] = field(default_factory=Future)
    #: the job's object (docs/topics.md, "The job object") once it is terminal
    ended: Future[dict[str, Any]] | None = None


def is_voice_job(job: Mapping[str, Any], voice_dir: Path) -> bool:
    """True for a voice command's job: its input is in ``voice_dir`` (``Settings.voice_dir``),
    where only the Wyoming listener writes."""
    text = job.get("input")
    return isinstance(text, str) and text.startswith(f"{voice_dir}/")


class VoiceIntake(Component):
    """Voice commands from the Wyoming listener, run by the loop.

    Args:
        settings: ``wyoming.user`` (and its role in ``access``), ``wyoming.wait_s`` (a
            command's attempt's timeout too), ``voice_dir``.
        queue: the typed queue the commands run against.
        job_store: returns the open store.
        wake: the loop's wake socket (written from the listener's thread).
        ended: the jobs that ended in the turn, job id -> the job's row
            (:attr:`~edge_queue.publish.publisher.Publisher.turn_ended`).
        purge: deletes terminal jobs with their outputs and retained topics
            (:meth:`~edge_queue.jobs.retention.Retention.purge`), inside a turn.
    """

    def __init__(
        self,
        settings: Settings,
        queue: Queue,
        job_store: Callable[[], Store],
        wake: socket.socket,
        ended: Mapping[str, dict[str, Any]],
        purge: Callable[[list[str]], list[str]],
    ) -> None:
        self._queue, self._job_store, self._ended, self._purge = queue, job_store, ended, purge
        self.voice_dir = settings.voice_dir
        self._wait_s = settings.wyoming.wait_s
        user = settings.wyoming.user
        self._caller = Caller(user, settings.access.role_of(user), (self.voice_dir,))
        self._incoming: Handoff[_Call] = Handoff(wake)
        self._turn: list[tuple[_Call, dict[str, Any]]] = []
        #: job id -> the future waiting for its end
        self._waiting: dict[str, Future[dict[str, Any]]] = {}
        #: voice jobs that ended: purged in the next turn
        self._to_purge: list[str] = []

    # -- the listener's thread ----------------------------------------------------------

    def transcribe(self, wav: Path, language: str | None) -> tuple[Future[dict[str, Any]], Future[dict[str, Any]]]:
        """Submit the command ``wav`` (inside ``voice_dir``) told in ``language`` (a Whisper
        code, or ``None``: the model tells it): the first future gets the response
        (docs/topics.md, "Response shapes") once the turn is committed, the second the job's
        object once it is terminal; both are cancelled when the service stops. Cancelling the
        second (the caller went away) cancels the job."""
        # no files: the result's text is the answer, and a file (its fsync, its record in the
        # store before it is moved into place, a turn of the loop) would be purged at once
        options: dict[str, Any] = {"output": "data_dir", "formats": []}
        if language:
            options["language"] = language
        request = SubmitRequest(
            kind="transcribe",
            input=str(wav),
            options=options,
            priority=PRIORITY,
            max_attempts=1,
            timeout_s=self._wait_s,  # of no use once its caller stopped waiting
        )
        call = _Call(request, ended=Future())
        self._hand_over(call)
        assert call.ended is not None
        return call.answered, call.ended

    def cancel(self, job_id: str) -> None:
        """Cancel the job of a command whose caller went away (or waited past ``wyoming.wait_s``)."""
        self._hand_over(_Call(CancelRequest(job_id=job_id)))

    def _hand_over(self, call: _Call) -> None:
        self._incoming.put(call)

    # -- the loop's thread --------------------------------------------------------------

    def wait_s(self, now: float) -> float | None:
        """0 while commands wait to be run or ended jobs to be purged, else None."""
        return 0.0 if self._incoming or self._to_purge else None

    def turn(self, now: float) -> None:
        """Purge the voice jobs that ended, then run up to :data:`CALLS_PER_TURN` commands."""
        if self._to_purge:
            store = self._job_store()
            done = [j for j in self._to_purge if _terminal(store, j)]
            self._to_purge = [j for j in self._to_purge if j not in done]
            if done:
                self._purge(done)
        for call in self._incoming.take(CALLS_PER_TURN):
            if call.answered.cancelled():
                continue
            if isinstance(call.request, CancelRequest) and not self._worth_cancelling(call.request.job_id):
                continue
            command = "submit" if isinstance(call.request, SubmitRequest) else "cancel"
            response = self._queue.answer(command, call.request, self._caller)
            self._turn.append((call, response))
            if call.ended is not None:
                self._watch(call, response)

    def _worth_cancelling(self, job_id: str | None) -> bool:
        """False for a job already running (or gone): a command's attempt is seconds long,
        while a cancel ends its worker process and the next command would load its model
        again; it ends, is not run again (one attempt) and is purged."""
        try:
            return job_id is not None and self._job_store().get(job_id)["state"] in ("queued", "retrying")
        except NotFoundError:
            return False

    def _watch(self, call: _Call, response: dict[str, Any]) -> None:
        assert call.ended is not None
        data = response.get("data") if response.get("status") == "ok" else None
        jobs = data.get("jobs") if isinstance(data, dict) else None
        job_id = jobs[0].get("job_id") if jobs else None
        if not isinstance(job_id, str):
            call.ended.cancel()
            return
        self._waiting[job_id] = call.ended

    def committed(self) -> None:
        """After the turn's commit: answer its commands, and hand the voice jobs that ended in
        it to those waiting for them (then purged in the next turn)."""
        for call, response in self._turn:
            if not call.answered.cancelled():
                call.answered.set_result(response)
        self._turn.clear()
        for job_id, row in self._ended.items():
            if not is_voice_job(row, self.voice_dir):
                continue
            self._to_purge.append(job_id)
            waiter = self._waiting.pop(job_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(payloads.job_object(row))

    def turn_failed(self, *, disk_full: bool) -> None:
        """The turn's commit failed: its commands are answered with ``disk_full`` or
        ``internal_error`` (nothing of them was kept)."""
        code = ErrorCode.DISK_FULL if disk_full else ErrorCode.INTERNAL_ERROR
        for call, _ in self._turn:
            if not call.answered.cancelled():
                call.answered.set_result(payloads.error(code, "the store could not commit the voice command"))
            if call.ended is not None:
                call.ended.cancel()
                for job_id, fut in list(self._waiting.items()):
                    if fut is call.ended:
                        del self._waiting[job_id]
        self._turn.clear()

    def stop(self) -> None:
        """The service stops: every command waiting is let go (the listener answers ``stopping``)."""
        self._incoming.stop()
        for fut in self._waiting.values():
            fut.cancel()
        self._waiting.clear()


def _terminal(store: Store, job_id: str) -> bool:
    try:
        return is_terminal(store.get(job_id)["state"])
    except NotFoundError:  # gone already (purged by a request): nothing to purge
        return False
