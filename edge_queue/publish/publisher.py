"""What the service publishes about jobs: events, retained job state and its coalescing,
progress throttling, batches, the queue summary, and the republish in pieces after a connect.

Everything here is called from the service's one thread, inside a loop turn; what it hands to
the bridge leaves after the turn's commit (the bridge holds it until then: ``Bridge.held``).
docs/topics.md, "`<base>/jobs/<job_id>`", "`<base>/events`", "`<base>/queue`",
"`<base>/batches/<batch_id>`".
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge_queue.component import Component
from edge_queue.errors import NotFoundError
from edge_queue.mqtt import payloads
from edge_queue.mqtt.bridge import Bridge
from edge_queue.mqtt.topics import Topics
from edge_queue.rules.states import JobState, is_terminal
from edge_queue.rules.unheard import Unheard
from edge_queue.store import Store, iso, parse_iso
from edge_queue.workers.supervisor import Supervisor

from . import discovery
from .ha_finished import FinishedJobs

log = logging.getLogger(__name__)

#: At most one progress publish per job per second (docs/topics.md, "`<base>/jobs/<job_id>`").
PROGRESS_PUBLISH_INTERVAL_S = 1.0
#: At most one ``<base>/queue`` publish per this many seconds.
QUEUE_PUBLISH_INTERVAL_S = 1.0
#: At most one ``<base>/batches/<id>`` publish per batch per this many seconds.
BATCH_PUBLISH_INTERVAL_S = 0.5
#: A job's non-terminal retained state is published once it has stood this long (seconds).
COALESCE_S = 0.02
#: The republish after a connect sends this many job states per turn, while fewer than
#: BACKLOG_LOW messages wait for the broker: it proceeds in pieces, between requests.
REPUBLISH_PAGE = 1_000
BACKLOG_LOW = 4_000


def storage(db_path: Path) -> dict[str, int | None]:
    """``store_bytes`` (the job store's file and its write-ahead log) and ``disk_free_bytes``
    (free on the disk holding it, for an unprivileged user), None when unreadable: for
    ``<base>/queue``, and Home Assistant's diagnostic sensors."""
    size: int | None = 0
    for path in (db_path, db_path.with_name(db_path.name + "-wal")):
        try:
            size = (size or 0) + path.stat().st_size
        except FileNotFoundError:
            pass
        except OSError:
            size = None
            break
    try:
        free: int | None = shutil.disk_usage(db_path.parent).free
    except OSError:
        free = None
    return {"store_bytes": size, "disk_free_bytes": free}


class Publisher(Component):
    """Job events and retained state, throttled and coalesced.

    Args:
        bridge: where messages go (held until the turn's commit).
        topics: the installation's topic names.
        store: returns the open store (the service opens it at boot).
        supervisor: the worker pool, for the queue summary's worker pids and count.
        paused: returns whether the queue is paused, for the queue summary.
        ha_last: whether Home Assistant's ``<base>/ha/last`` is published (discovery on).
        private: True for a private job (a voice command's): Home Assistant is not told of its
            end (neither ``<base>/ha/last`` nor ``<base>/ha/finished``), and its retained state
            and events carry its result without the transcript's ``text`` (:meth:`job_body`).
    """

    def __init__(
        self,
        bridge: Bridge,
        topics: Topics,
        store: Callable[[], Store],
        supervisor: Supervisor,
        paused: Callable[[], bool],
        *,
        ha_last: bool,
        nodes: Callable[[], list[dict[str, Any]]] = list,
        private: Callable[[dict[str, Any]], bool] = lambda job: False,
    ) -> None:
        self.bridge, self.topics, self.store, self.supervisor = bridge, topics, store, supervisor
        #: private jobs (a voice command's: Assist has its answer already, and no one else reads it)
        self.private = private
        self.paused, self.nodes = paused, nodes
        self.ha_enabled = ha_last
        self.ha_finished = FinishedJobs(bridge, topics, store)
        self.pending_progress: dict[str, dict[str, Any]] = {}
        self.last_progress_pub: dict[str, float] = {}
        self.published_stage: dict[str, str | None] = {}
        self.queue_dirty = True
        self.last_queue_pub = 0.0
        self.dirty_batches: set[str] = set()
        self.last_batch_pub: dict[str, float] = {}
        # Retained job state is coalesced: job id -> (latest state, is terminal) decided this
        # turn, and job id -> (latest state, monotonic time it changed first) of committed
        # non-terminal states held back for COALESCE_S (see publish_states).
        # A state that is not final is kept as a copy of its row and made into the job object
        # only when published (most are replaced by the job's next state first).
        self.turn_jobs: dict[str, tuple[bytes | dict[str, Any], bool]] = {}
        #: the rows of the jobs that ended in the turn, job id -> row (for the HTTP API's waiters)
        self.turn_ended: dict[str, dict[str, Any]] = {}
        self.held_jobs: dict[str, tuple[bytes | dict[str, Any], float]] = {}
        self.ha_last: dict[str, Any] | None = None  # the turn's last finished job, for <base>/ha/last
        #: whether anyone reads <base>/events (rules/unheard): not sent while nobody does
        self.events_heard = Unheard()
        self.events_receipt = self.events_acknowledged  # one bound method for every event's receipt
        self.ha_finished.on_birth = self.wake_unheard

    def job_body(self, job: dict[str, Any]) -> bytes:
        """The job object (docs/topics.md, "The job object") as published: a private job's
        result without its transcript's ``text``, which only its caller is answered with."""
        obj = payloads.job_object(job)
        result = obj.get("result")
        if isinstance(result, dict) and "text" in result and self.private(job):
            obj["result"] = {k: v for k, v in result.items() if k != "text"}
        return payloads.encode(obj)

    def encoded(self, body: bytes | dict[str, Any]) -> bytes:
        """A kept state as published: :meth:`job_body` of a row kept as it was."""
        return body if isinstance(body, bytes) else self.job_body(body)

    def publish_job(self, job: dict[str, Any], event: str | None = None) -> None:
        """An event now; the retained job topic once per turn with the job's latest state (a
        job that changes several times in one turn is published once, ``seq`` only grows);
        the job's batch; marks ``<base>/queue`` for update."""
        terminal = is_terminal(job["state"])
        body: bytes | None = self.job_body(job) if terminal else None
        self.turn_jobs[job["job_id"]] = (body if body is not None else dict(job), terminal)
        if terminal:
            self.turn_ended[job["job_id"]] = job
        elif self.turn_ended:
            self.turn_ended.pop(job["job_id"], None)
        if event is None:
            event = "end" if terminal else "update"
        # The event embeds the very bytes of the retained state: encoded once. event_id: the
        # state change's id in the store's event log (the events request's cursor); progress
        # is not a state change and has none. Not sent while nobody reads <base>/events.
        if self.events_heard.send(time.monotonic()):
            if body is None:
                body = self.job_body(job)
                self.turn_jobs[job["job_id"]] = (body, terminal)
            event_id = job.get("event_id")
            self.bridge.publish(
                self.topics.events,
                b'{"v":1,"type":"%s","event_id":%s,"job":%s}'
                % (event.encode(), b"null" if event_id is None else str(int(event_id)).encode(), body),
                receipt=self.events_receipt,
            )
        if job.get("batch_id"):
            self.dirty_batches.add(job["batch_id"])
        self.queue_dirty = True
        if terminal and event == "end" and self.ha_enabled and not self.private(job):
            self.ha_last = job  # Home Assistant's "last result": once per turn, the turn's last
            self.ha_finished.ended(job)  # its "Job finished" event: every one

    def events_acknowledged(self, reason_code: int) -> None:
        """The broker's PUBACK of an event (``reason_code`` 16: nobody read it)."""
        self.events_heard.acknowledged(reason_code, time.monotonic())

    def wake_unheard(self) -> None:
        """Someone may be listening (our connect, Home Assistant's birth message, a request
        other than ``submit``): ``<base>/events`` and ``<base>/ha/finished`` are sent again
        until the broker says nobody reads them (docs/topics.md, "Messages per job")."""
        self.events_heard.wake()
        self.ha_finished.unheard.wake()

    def request_seen(self, command: str) -> None:
        """A request came: its sender may read ``<base>/events`` (the queue page, which asks
        ``list``; a client catching up with ``events``). Submits are the load itself and wake
        nothing: a submitter that reads ``<base>/events`` is heard at the next try."""
        if command != "submit" and not (self.events_heard.heard and self.ha_finished.unheard.heard):
            self.wake_unheard()

    def publish_states(self, mono: float, *, everything: bool = False) -> None:
        """Publish the retained job states committed by the turns so far: a terminal state at
        once; any other state once it has stood for :data:`COALESCE_S` (a job that goes
        queued -> running -> succeeded within that window is published once, as succeeded;
        ``seq`` only grows, and ``<base>/events`` carries every transition). Call after the
        turn's commit; ``mono`` is monotonic seconds."""
        if self.ha_last is not None:
            last = payloads.encode(discovery.last_payload(self.ha_last))
            self.bridge.publish(discovery.last_topic(self.topics), last, retain=True)
            self.ha_last = None
        held = self.held_jobs
        for job_id, (body, terminal) in self.turn_jobs.items():
            if terminal:
                held.pop(job_id, None)
                self.bridge.publish(
                    self.topics.job(job_id), self.encoded(body), retain=True, expiry_s=self.finished_expiry_s
                )
            else:
                since = held[job_id][1] if job_id in held else mono
                held[job_id] = (body, since)
        self.turn_jobs.clear()
        self.turn_ended.clear()
        if not held:
            return
        due = [j for j, (_, since) in held.items() if everything or mono - since >= COALESCE_S]
        for job_id in due:
            body, _ = held.pop(job_id)
            self.bridge.publish(self.topics.job(job_id), self.encoded(body), retain=True)

    @property
    def finished_expiry_s(self) -> int:
        """``mqtt.finished_expiry_s``: seconds a finished job's retained state stays."""
        return self.bridge.settings.finished_expiry_s

    def expiry_left(self, job: dict[str, Any], now: float) -> int | None:
        """Seconds left of a finished job's retained state at ``now`` (Unix seconds; 0 or less:
        expired, its topic is cleared), or None for a job not finished or no expiry."""
        if not self.finished_expiry_s or not is_terminal(job["state"]) or not job.get("finished_at"):
            return None
        return int(parse_iso(job["finished_at"]) + self.finished_expiry_s - now)

    def committed(self) -> None:
        """The turn's commit succeeded: its job states leave (:meth:`publish_states`)."""
        self.publish_states(time.monotonic())

    def turn_failed(self, *, disk_full: bool = False) -> None:
        """The turn's commit failed: nothing it decided is published."""
        self.turn_jobs.clear()
        self.turn_ended.clear()

    def unpublished(self, job_id: str) -> bool:
        """True while a newer state of the job waits to be published (a republish skips it)."""
        return job_id in self.held_jobs or job_id in self.turn_jobs

    def cleared(self, job_ids: list[str], batch_ids: list[str], shrunk: list[str]) -> None:
        """Jobs and batches were deleted (a purge): clear their retained topics, publish the
        batches that lost jobs again."""
        for job_id in job_ids:
            self.turn_jobs.pop(job_id, None)
            self.turn_ended.pop(job_id, None)
            self.held_jobs.pop(job_id, None)
            self.bridge.publish(self.topics.job(job_id), b"", retain=True)
        for batch_id in batch_ids:
            self.dirty_batches.discard(batch_id)
            self.bridge.publish(self.topics.batch(batch_id), b"", retain=True)
        self.dirty_batches.update(shrunk)
        if job_ids:
            self.queue_dirty = True

    # -- progress -----------------------------------------------------------------------

    def on_progress(self, job_id: str, attempt: int, data: dict[str, Any], now: float) -> None:
        """A worker's progress report: every stage is published; within a stage, at most once
        per :data:`PROGRESS_PUBLISH_INTERVAL_S`."""
        pending = self.pending_progress.get(job_id)
        previous = pending["stage"] if pending else self.published_stage.get(job_id)
        if pending and pending["stage"] != data.get("stage"):
            self.flush_progress(job_id, now)
        self.pending_progress[job_id] = {**data, "attempt": attempt}
        due = now - self.last_progress_pub.get(job_id, 0) >= PROGRESS_PUBLISH_INTERVAL_S
        if due or previous != data.get("stage"):
            self.flush_progress(job_id, now)

    def forget_progress(self, job_id: str) -> None:
        """The job's attempt ended: its throttled progress is dropped."""
        self.pending_progress.pop(job_id, None)
        self.last_progress_pub.pop(job_id, None)
        self.published_stage.pop(job_id, None)

    def flush_progress(self, job_id: str, now: float) -> None:
        data = self.pending_progress.pop(job_id, None)
        if data is None:
            return
        self.last_progress_pub[job_id] = now
        self.published_stage[job_id] = data.get("stage")
        job = self.store().progress(
            job_id, now, progress=data["progress"], stage=data.get("stage"), eta_s=data.get("eta_s")
        )
        if job["attempt"] == data["attempt"] and job["state"] in (JobState.RUNNING, JobState.CANCELLING):
            self.publish_job(job, "update")

    def turn(self, now: float) -> None:
        """Publish throttled progress, batches and the queue summary whose interval has passed
        at ``now`` (Unix seconds); forget the finished runs Home Assistant got (inside the turn's
        group)."""
        if self.ha_enabled:
            self.ha_finished.step()
        for job_id in list(self.pending_progress):
            if now - self.last_progress_pub.get(job_id, 0) >= PROGRESS_PUBLISH_INTERVAL_S:
                self.flush_progress(job_id, now)
        for batch_id in list(self.dirty_batches):
            if now - self.last_batch_pub.get(batch_id, 0) >= BATCH_PUBLISH_INTERVAL_S:
                self.dirty_batches.discard(batch_id)
                self.last_batch_pub[batch_id] = now
                self.publish_batch(batch_id)
        if len(self.last_batch_pub) > 10_000:  # forget the times of batches long quiet
            self.last_batch_pub = {b: t for b, t in self.last_batch_pub.items() if now - t < 60}
        if self.queue_dirty and now - self.last_queue_pub >= QUEUE_PUBLISH_INTERVAL_S:
            self.publish_queue(now)

    def wait_s(self, now: float) -> float | None:
        """Seconds until :meth:`turn` or :meth:`publish_states` has something due, or None."""
        waits = []
        if self.pending_progress or self.dirty_batches:
            waits.append(BATCH_PUBLISH_INTERVAL_S / 2)
        if self.held_jobs:
            waits.append(COALESCE_S)
        return min(waits) if waits else None

    # -- batches and the queue ----------------------------------------------------------

    def publish_batch(self, batch_id: str) -> None:
        try:
            batch = self.store().batch(batch_id)
        except NotFoundError:
            return
        self.bridge.publish(self.topics.batch(batch_id), payloads.encode(payloads.batch_object(batch)), retain=True)

    def publish_queue(self, now: float) -> None:
        """The retained ``<base>/queue`` summary: counts, running jobs, workers, worker nodes,
        last finished."""
        store = self.store()
        last = store.last_finished()
        pids = self.supervisor.worker_pids()
        summary = {
            "v": 1,
            "counts": store.counts(),
            "paused": self.paused(),
            "running": [
                {
                    "job_id": j["job_id"],
                    "kind": j["kind"],
                    "input": j["input"],
                    "state": j["state"],
                    "stage": j["stage"],
                    "progress": None if j["progress"] is None else round(float(j["progress"]), 1),
                    "eta_s": j["eta_s"],
                    "worker_pid": pids.get(j["job_id"]),
                    "node": payloads.job_object(j)["node"],
                }
                for j in store.running()
            ],
            "workers_alive": self.supervisor.alive(),
            **storage(store.path),
            "nodes": self.nodes(),
            "last_finished": None
            if last is None
            else {k: last[k] for k in ("job_id", "kind", "input", "state", "finished_at")},
            "updated_at": iso(now),
        }
        self.bridge.publish(self.topics.queue, payloads.encode(summary), retain=True)
        self.queue_dirty = False
        self.last_queue_pub = now


class Republisher(Component):
    """The retained state of every job and batch, sent again from the store after a connect or
    a ``republish`` request, in pieces of :data:`REPUBLISH_PAGE` between requests, while the
    broker keeps up (fewer than :data:`BACKLOG_LOW` of our messages unacknowledged)."""

    def __init__(self, publisher: Publisher, clock: Callable[[], float]) -> None:
        self.publisher = publisher
        self.clock = clock
        self.at: tuple[str, str] | None = None  # (phase, cursor) of the republish under way
        self.started = 0.0
        self.count = 0

    @property
    def active(self) -> bool:
        return self.at is not None

    def start(self) -> None:
        self.at = ("jobs", "")
        self.started = time.monotonic()
        self.count = 0

    def wait_s(self, now: float) -> float | None:
        """While a republish is under way, the next piece is due soon (the broker's backlog
        may have gone down meanwhile)."""
        return 0.05 if self.active else None

    def turn(self, now: float) -> None:
        """Send the next piece when the broker keeps up."""
        pub = self.publisher
        bridge = pub.bridge
        if self.at is None or bridge.backlog >= BACKLOG_LOW or not bridge.connected:
            return
        phase, cursor = self.at
        store = pub.store()
        if phase == "jobs":
            page = store.iter_job_page(cursor, REPUBLISH_PAGE)
            now = self.clock()
            for job in page:
                if pub.unpublished(job["job_id"]):
                    continue
                left = pub.expiry_left(job, now)
                body = pub.job_body(job) if left is None or left > 0 else b""
                bridge.publish(pub.topics.job(job["job_id"]), body, retain=True, expiry_s=left or 0)
            self.count += len(page)
            self.at = ("jobs", page[-1]["job_id"]) if len(page) == REPUBLISH_PAGE else ("batches", "")
        elif phase == "batches":
            ids = store.batches.batch_id_page(cursor, REPUBLISH_PAGE // 10)
            for batch_id in ids:
                pub.publish_batch(batch_id)
            if len(ids) == REPUBLISH_PAGE // 10:
                self.at = ("batches", ids[-1])
            else:
                self.at = None
                pub.publish_queue(self.clock())
                log.info(
                    "republished the retained state of %d job(s) in %.1f s",
                    self.count,
                    time.monotonic() - self.started,
                )
