"""The service: the composition root. Boot order, the main loop, outcomes of attempts.

Boot reads like a script (PRODUCT 4.3): open the store and migrate, requeue the attempts a
dead run left ``running``, start the workers, connect to the broker, serve. One thread owns
the store and every decision; paho's thread and the worker pipes only wake it.

This module is the one place where the outcome of an attempt becomes a job state
(:meth:`Service.on_outcome`).
"""

from __future__ import annotations

import logging
import queue
import random
import signal
import socket
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from . import payloads
from .bridge import Bridge, Connected, Incoming, RetainedJob
from .commands import Commands
from .config import Settings
from .errors import ConfigError, ErrorCode
from .kinds import registry
from .notify import Notifier
from .states import JobState, is_terminal
from .store import Store, iso, new_id
from .supervisor import Outcome, Supervisor
from .topics import ONLINE, Topics

log = logging.getLogger(__name__)

#: At most one progress publish per job per second (PRODUCT 3 rule 4).
PROGRESS_PUBLISH_INTERVAL_S = 1.0
#: At most one ``<base>/queue`` publish per this many seconds.
QUEUE_PUBLISH_INTERVAL_S = 1.0
#: At most one ``<base>/batches/<id>`` publish per batch per this many seconds.
BATCH_PUBLISH_INTERVAL_S = 0.5
#: After each connect, retained job topics are read this long to clear unknown ones.
RETAINED_SCAN_S = 3.0
#: After clearing a retained request, empty messages on its topic are echoes for this long.
ECHO_WINDOW_S = 5.0
#: How often terminal jobs past ``retention_days`` are purged.
RETENTION_INTERVAL_S = 600.0


def package_version() -> str:
    try:
        return version("edge-queue")
    except PackageNotFoundError:
        return "0+unknown"


def checked_kinds(settings: Settings) -> dict[str, Any]:
    """The kind registry for ``settings``. Raises :class:`ConfigError` when ``default_kind``
    or a ``[kinds.<name>]`` table names a kind that does not exist."""
    kinds = registry(settings.extra_kinds)
    unknown = sorted({settings.default_kind, *settings.kinds} - set(kinds))
    if unknown:
        raise ConfigError(
            f"unknown job kind(s) in the configuration: {', '.join(unknown)} (known: {', '.join(sorted(kinds))})"
        )
    return kinds


def lock_data_dir(data_dir: Path) -> Any:
    """Take ``<data_dir>/edge-queue.lock`` (``flock``, released when the process ends, even by
    kill -9). Raises :class:`ConfigError` when another service holds it: two services on one
    store would each take the other's running jobs for orphans."""
    import fcntl

    fh = open(data_dir / "edge-queue.lock", "a+")  # noqa: SIM115 - held for the process's life
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as e:
        fh.close()
        raise ConfigError(f"another edge-queue service is using {data_dir} (it holds edge-queue.lock)") from e
    return fh


def backoff_s(attempt: int, base_s: float, cap_s: float, rng: Callable[[], float] = random.random) -> float:
    """Delay before the next attempt, in seconds: "full jitter" (AWS Architecture Blog,
    "Exponential Backoff And Jitter", 2015): uniform in ``[0, min(cap, base * 2**(attempt-1))]``.

    ``attempt`` is the number of the attempt that just failed (1 for the first).
    """
    return rng() * min(cap_s, base_s * 2 ** max(attempt - 1, 0))


class Service:
    """edge-queue's service process (``edge-queue serve``).

    Args:
        settings: the validated configuration.
        client_id: MQTT client id; defaults to ``mqtt.client_id``.
        clock: Unix seconds; injectable for tests.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        client_id: str | None = None,
        clock: Callable[[], float] = time.time,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.rng = rng
        self.topics = Topics(settings.mqtt.base_topic)
        self.kinds = checked_kinds(settings)
        self._concurrency = {k: settings.kind(k).max_concurrency for k in self.kinds}
        self.run_id = new_id()
        self.started_at = iso(clock())
        self.paused = False
        self.stopping = False
        self.store: Store | None = None
        self.supervisor = Supervisor(settings)
        self.bridge = Bridge(settings.mqtt, self.topics, client_id=client_id)
        self.commands = Commands(self)
        self.notifier = Notifier()
        self._sig_r, self._sig_w = socket.socketpair()
        self._sig_r.setblocking(False)
        self._sig_w.setblocking(False)
        self._pending_progress: dict[str, dict[str, Any]] = {}
        self._last_progress_pub: dict[str, float] = {}
        self._published_stage: dict[str, str | None] = {}
        self._queue_dirty = True
        self._last_queue_pub = 0.0
        self._dirty_batches: set[str] = set()
        self._last_batch_pub: dict[str, float] = {}
        self._echoes: dict[str, float] = {}
        self._boot_changes: list[dict[str, Any]] = []  # events owed for changes made before connecting
        self._lock: Any = None  # topic -> monotonic end of its echo window
        self._scan_retained_until: float | None = None
        self._next_retention = 0.0

    # -- boot ---------------------------------------------------------------------------

    def boot(self, *, connect_timeout_s: float = 30.0) -> None:
        """Open the store, requeue orphans, start workers, connect. Raises BrokerUnavailable."""
        s = self.settings
        s.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock = lock_data_dir(s.data_dir)
        self.store = Store(s.db_path, s.durability)
        self.requeue_orphans()
        self.supervisor.start()
        self.bridge.connect(connect_timeout_s)

    def requeue_orphans(self) -> None:
        """Jobs left ``running`` by a dead run go back to ``queued`` (the attempt counts);
        ``cancelling`` ones end ``cancelled``. Runs before any new work is taken."""
        store = self._store()
        now = self.clock()
        for job_id in store.orphans(self.run_id):
            job = store.get(job_id)
            reason = {"reason": "service restart"}
            if job["state"] == JobState.CANCELLING:
                job = store.transition(
                    job_id,
                    JobState.CANCELLED,
                    now,
                    detail=reason,
                    error={"code": "cancelled", "message": "cancelled", "retryable": False},
                )
                log.warning("job %s: cancelled (the service ended while it was cancelling)", job_id)
            elif job["attempt"] >= job["max_attempts"]:
                # The attempt counts (PRODUCT 4.3); with none left, the job fails: a job that
                # takes the whole service down cannot loop forever.
                job = store.transition(
                    job_id,
                    JobState.FAILED,
                    now,
                    detail=reason,
                    error={
                        "code": str(ErrorCode.WORKER_LOST),
                        "retryable": True,
                        "message": f"the service ended during attempt {job['attempt']} of {job['max_attempts']}",
                    },
                )
                log.error("job %s failed: worker_lost (the service ended during its last attempt)", job_id)
            else:
                job = store.transition(job_id, JobState.QUEUED, now, detail=reason, owner=None)
                log.warning(
                    "job %s: requeued after the previous run of the service ended during attempt %d",
                    job_id,
                    job["attempt"],
                )
            self._boot_changes.append(job)

    def _store(self) -> Store:
        assert self.store is not None, "boot() first"
        return self.store

    def request_stop(self, *_: Any) -> None:
        """Signal handler (SIGTERM, SIGINT): only sets a flag and wakes the loop."""
        self.stopping = True
        try:
            self._sig_w.send(b"\0")
        except OSError:
            pass

    # -- the loop -----------------------------------------------------------------------

    def run(self) -> int:
        """Boot, serve until SIGTERM/SIGINT, stop gracefully (PRODUCT 4.6). Returns 0."""
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        self.boot()
        where = f"{self.settings.mqtt.host}:{self.settings.mqtt.port}"
        log.info(
            "edge-queue %s serving on %s (base topic %s, %d workers)",
            package_version(),
            where,
            self.topics.base,
            self.settings.workers,
        )
        self.notifier.ready(f"serving on {where}, base topic {self.topics.base}")
        while not self.stopping:
            self.step(max_wait_s=min(1.0, (self.notifier.watchdog_s or 2.0) / 4))
            self.notifier.tick()
        self.notifier.stopping()
        self.shutdown()
        return 0

    def step(self, max_wait_s: float = 1.0) -> None:
        """One turn of the loop: wait for something, then act on all of it."""
        self.supervisor.wait([self.bridge.wake_r, self._sig_r], self._wait_s(max_wait_s))
        self.bridge.drain_wake()
        self.tick(self.clock())

    def tick(self, now: float) -> None:
        """Act on everything pending at ``now``: messages, worker outcomes, due jobs, publishes.

        All of it is one group commit (one fsync), and nothing it publishes, answers or
        acknowledges leaves before that commit.
        """
        store = self._store()
        with self.bridge.held(), store.group():
            while True:
                try:
                    item = self.bridge.inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, Connected):
                    self.republish()
                    self._scan_retained_until = self.clock() + RETAINED_SCAN_S
                    for job in self._boot_changes:  # changes made before the first connect
                        self.publish_job(job)
                    self._boot_changes.clear()
                elif isinstance(item, RetainedJob):
                    self.on_retained_job(item)
                else:
                    self.on_message(item)
            for outcome in self.supervisor.poll():
                self.on_outcome(outcome, self.clock())
            self.schedule(self.clock())
            self.flush(self.clock())
            self.housekeeping(self.clock())

    def housekeeping(self, now: float) -> None:
        """End the start-up scan of retained job topics; purge jobs past ``retention_days``."""
        if self._scan_retained_until is not None and now >= self._scan_retained_until:
            self._scan_retained_until = None
            self.bridge.stop_retained_scan()
        if now >= self._next_retention:
            self._next_retention = now + RETENTION_INTERVAL_S
            expired = self._store().finished_before(now - self.settings.retention_days * 86400)
            if expired:
                log.info(
                    "retention: purging %d job(s) finished more than %g days ago",
                    len(expired),
                    self.settings.retention_days,
                )
                self.purge(expired)

    def purge(self, job_ids: list[str]) -> list[str]:
        """Delete terminal jobs and clear their retained topics (and of batches left empty)."""
        gone, batches = self._store().delete(job_ids)
        for job_id in gone:
            self.bridge.publish(self.topics.job(job_id), b"", retain=True)
        for batch_id in batches:
            self.bridge.publish(self.topics.batch(batch_id), b"", retain=True)
        if gone:
            self._queue_dirty = True
            log.info("purged %d job(s)", len(gone))
        return gone

    def on_retained_job(self, item: RetainedJob) -> None:
        """A retained ``<base>/jobs/<id>`` seen at start-up: clear it if the store does not
        know the id (PRODUCT 3 rule 3)."""
        if item.job_id not in self._store().job_ids_in([item.job_id]):
            log.info("clearing retained state of unknown job %s", item.job_id)
            self.bridge.publish(self.topics.job(item.job_id), b"", retain=True)

    def _wait_s(self, cap: float) -> float:
        waits = [cap]
        if (d := self.supervisor.next_deadline()) is not None:
            waits.append(d)
        if self._pending_progress or self._dirty_batches:
            waits.append(BATCH_PUBLISH_INTERVAL_S / 2)
        if (due := self._store().next_due()) is not None:
            waits.append(max(0.0, due - self.clock()))
        return max(0.0, min(waits))

    # -- requests -----------------------------------------------------------------------

    def on_message(self, msg: Incoming) -> None:
        """Execute one request and answer it; the PUBACK follows the commit."""
        try:
            self._on_message(msg)
        except Exception:  # a bug costs one request, never the service
            log.exception("request on %s: internal error", msg.topic)
            self.respond(msg, payloads.error(ErrorCode.INTERNAL_ERROR, "internal error; see the service log"), None)
            self.bridge.ack(msg)

    def _on_message(self, msg: Incoming) -> None:
        now = time.monotonic()
        if not msg.payload and (msg.retain or self._echoes.get(msg.topic, 0) > now):
            # The broker echoing our own clearing of a retained request (amqtt may send it
            # more than once): not a request.
            self.bridge.ack(msg)
            return
        if msg.retain:
            log.warning(
                "retained request on %s not executed; cleared it (publish requests without the retain flag)", msg.topic
            )
            self._echoes[msg.topic] = now + ECHO_WINDOW_S
            self.bridge.publish(msg.topic, b"", retain=True)
            transaction, reply_to = payloads.peek_envelope(msg.payload)
            self.respond(
                msg,
                payloads.error(ErrorCode.INVALID_REQUEST, "retained requests are not executed", transaction),
                reply_to,
            )
            self.bridge.ack(msg)
            return
        response, reply_to = self.commands.execute(msg.command, msg.payload)
        self.respond(msg, response, reply_to)
        self.bridge.ack(msg)

    def respond(self, msg: Incoming, response: dict[str, Any], reply_to: str | None) -> None:
        body = payloads.encode(response)
        self.bridge.respond(self.topics.response(msg.command), body)
        if msg.response_topic and self.topics.valid_reply_to(msg.response_topic):
            self.bridge.respond(msg.response_topic, body, correlation_data=msg.correlation_data)
        if reply_to and self.topics.valid_reply_to(reply_to):
            self.bridge.respond(reply_to, body)

    # -- outcomes -----------------------------------------------------------------------

    def on_outcome(self, outcome: Outcome, now: float) -> None:
        """Turn what a worker reported (or its death) into the job's next state."""
        store = self._store()
        job_id, attempt, data = outcome.job_id, outcome.attempt, outcome.data
        if outcome.op == "progress":
            # Every stage is published; within a stage, at most once per second (rule 4).
            pending = self._pending_progress.get(job_id)
            previous = pending["stage"] if pending else self._published_stage.get(job_id)
            if pending and pending["stage"] != data.get("stage"):
                self._flush_progress(job_id, now)
            self._pending_progress[job_id] = {**data, "attempt": attempt}
            due = now - self._last_progress_pub.get(job_id, 0) >= PROGRESS_PUBLISH_INTERVAL_S
            if due or previous != data.get("stage"):
                self._flush_progress(job_id, now)
            return
        self._pending_progress.pop(job_id, None)
        self._last_progress_pub.pop(job_id, None)
        self._published_stage.pop(job_id, None)
        try:
            job = store.get(job_id)
        except Exception:
            log.warning("outcome for unknown job %s ignored", job_id)
            return
        if job["attempt"] != attempt or job["state"] not in (JobState.RUNNING, JobState.CANCELLING):
            log.warning(
                "job %s: stale outcome of attempt %d ignored (now attempt %d, %s)",
                job_id,
                attempt,
                job["attempt"],
                job["state"],
            )
            return
        cancelling = job["state"] == JobState.CANCELLING
        if outcome.op == "done":
            job = store.transition(
                job_id,
                JobState.SUCCEEDED,
                now,
                expect_attempt=attempt,
                result=data.get("result"),
                progress=100.0,
                error=None,
                crashes=0,
            )
            log.info("job %s succeeded (attempt %d)", job_id, attempt)
            self.publish_job(job)
            return
        code = data.get("code", str(ErrorCode.INTERNAL_ERROR))
        message = data.get("message", "")
        # Consecutive worker deaths: any other outcome breaks the run (PRODUCT 4.3).
        crashes = job["crashes"] + 1 if outcome.op == "lost" and code == ErrorCode.WORKER_LOST else 0
        retryable = bool(data.get("retryable", code not in (ErrorCode.CANCELLED,)))
        # While cancelling: a cancel seen at a checkpoint, or the worker ended after the grace
        # period, is "cancelled"; a failure the job reported by itself stays a failure.
        if code == ErrorCode.CANCELLED or (cancelling and outcome.op == "lost"):
            job = store.transition(
                job_id,
                JobState.CANCELLED,
                now,
                expect_attempt=attempt,
                crashes=crashes,
                error={"code": "cancelled", "message": "cancelled", "retryable": False},
            )
            log.info("job %s cancelled", job_id)
        elif crashes >= self.settings.crash_loop_limit:
            job = store.transition(
                job_id,
                JobState.FAILED,
                now,
                expect_attempt=attempt,
                crashes=crashes,
                error={
                    "code": str(ErrorCode.CRASH_LOOP),
                    "retryable": False,
                    "message": f"the job ended its worker {crashes} times in a row",
                },
            )
            log.error("job %s failed: crash_loop after %d worker deaths", job_id, crashes)
        elif retryable and attempt < job["max_attempts"] and not cancelling:
            delay = (
                0.0
                if code == ErrorCode.WORKER_LOST
                else backoff_s(attempt, self.settings.retry.backoff_base_s, self.settings.retry.backoff_cap_s, self.rng)
            )
            job = store.transition(
                job_id,
                JobState.RETRYING,
                now,
                expect_attempt=attempt,
                crashes=crashes,
                retry_at=now + delay,
                error={"code": code, "message": message, "retryable": True},
            )
            log.warning("job %s attempt %d failed (%s: %s); retry in %.1f s", job_id, attempt, code, message, delay)
        else:
            job = store.transition(
                job_id,
                JobState.FAILED,
                now,
                expect_attempt=attempt,
                crashes=crashes,
                error={"code": code, "message": message, "retryable": retryable},
            )
            log.error("job %s failed: %s: %s", job_id, code, message)
        self.publish_job(job)

    # -- scheduling ---------------------------------------------------------------------

    def schedule(self, now: float) -> None:
        """Give due jobs to idle workers, within each kind's ``max_concurrency``."""
        if self.paused or self.stopping:
            return
        store = self._store()
        idle = self.supervisor.idle()
        while idle:
            busy = self.supervisor.busy_by_kind()
            allowed = [k for k, lim in self._concurrency.items() if lim is None or busy[k] < lim]
            job = store.claim(now, allowed, self.run_id)
            if job is None:
                return
            timeout = job["timeout_s"] or self.settings.kind(job["kind"]).timeout_s
            out_dir = self.settings.outputs_dir / job["job_id"]
            self.supervisor.assign(idle.pop(), job, str(out_dir), timeout)
            log.info(
                "job %s started: %s %s (attempt %d)", job["job_id"], job["kind"], job["input"] or "", job["attempt"]
            )
            self.publish_job(job)

    # -- publishing ---------------------------------------------------------------------

    def publish_job(self, job: dict[str, Any], event: str | None = None) -> None:
        """Retained job topic, an event, the job's batch; marks ``<base>/queue`` for update."""
        body = payloads.encode(payloads.job_object(job))
        self.bridge.publish(self.topics.job(job["job_id"]), body, retain=True)
        if event is None:
            event = "end" if is_terminal(job["state"]) else "update"
        # The event embeds the very bytes of the retained state: encoded once.
        self.bridge.publish(self.topics.events, b'{"v":1,"type":"%s","job":%s}' % (event.encode(), body))
        if job.get("batch_id"):
            self._dirty_batches.add(job["batch_id"])
        self._queue_dirty = True

    def publish_batch(self, batch_id: str) -> None:
        batch = self._store().batch(batch_id)
        self.bridge.publish(self.topics.batch(batch_id), payloads.encode(payloads.batch_object(batch)), retain=True)

    def _flush_progress(self, job_id: str, now: float) -> None:
        data = self._pending_progress.pop(job_id, None)
        if data is None:
            return
        self._last_progress_pub[job_id] = now
        self._published_stage[job_id] = data.get("stage")
        job = self._store().progress(
            job_id, now, progress=data["progress"], stage=data.get("stage"), eta_s=data.get("eta_s")
        )
        if job["attempt"] == data["attempt"] and job["state"] in (JobState.RUNNING, JobState.CANCELLING):
            self.publish_job(job, "update")

    def flush(self, now: float) -> None:
        """Publish throttled progress and the queue summary when their interval has passed."""
        for job_id in list(self._pending_progress):
            if now - self._last_progress_pub.get(job_id, 0) >= PROGRESS_PUBLISH_INTERVAL_S:
                self._flush_progress(job_id, now)
        for batch_id in list(self._dirty_batches):
            if now - self._last_batch_pub.get(batch_id, 0) >= BATCH_PUBLISH_INTERVAL_S:
                self._dirty_batches.discard(batch_id)
                self._last_batch_pub[batch_id] = now
                self.publish_batch(batch_id)
        if self._queue_dirty and now - self._last_queue_pub >= QUEUE_PUBLISH_INTERVAL_S:
            self.publish_queue(now)

    def publish_queue(self, now: float) -> None:
        store = self._store()
        last = store.last_finished()
        pids = self.supervisor.worker_pids()
        summary = {
            "v": 1,
            "counts": store.counts(),
            "paused": self.paused,
            "running": [
                {
                    "job_id": j["job_id"],
                    "kind": j["kind"],
                    "input": j["input"],
                    "state": j["state"],
                    "stage": j["stage"],
                    "progress": j["progress"],
                    "eta_s": j["eta_s"],
                    "worker_pid": pids.get(j["job_id"]),
                }
                for j in store.running()
            ],
            "workers_alive": self.supervisor.alive(),
            "last_finished": None
            if last is None
            else {k: last[k] for k in ("job_id", "kind", "input", "state", "finished_at")},
            "updated_at": iso(now),
        }
        self.bridge.publish(self.topics.queue, payloads.encode(summary), retain=True)
        self._queue_dirty = False
        self._last_queue_pub = now

    def info(self) -> dict[str, Any]:
        return {
            "v": 1,
            "version": package_version(),
            "started_at": self.started_at,
            "base_topic": self.topics.base,
            "kinds": {
                name: {"description": k.description, "needs_input": k.needs_input, "options": k.schema()}
                for name, k in self.kinds.items()
            },
            "default_kind": self.settings.default_kind,
            "workers": self.settings.workers,
            "broker_protocol": self.bridge.protocol_name,
        }

    def republish(self) -> None:
        """Republish ``info``, ``queue``, every job and batch from the store (rule 2)."""
        store = self._store()
        self.bridge.publish(self.topics.status, ONLINE, retain=True)
        self.bridge.publish(self.topics.info, payloads.encode(self.info()), retain=True)
        for job in store.iter_jobs():
            self.bridge.publish(self.topics.job(job["job_id"]), payloads.encode(payloads.job_object(job)), retain=True)
        for batch_id in store.batch_ids():
            self.publish_batch(batch_id)
        self.publish_queue(self.clock())

    # -- stop ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Graceful stop (PRODUCT 4.6): no new jobs; running ones get ``cancel_grace_s`` to
        finish; the rest are ended and requeued without counting the attempt; ``offline``."""
        store = self._store()
        self.stopping = True
        log.info(
            "stopping: waiting up to %.0f s for %d running job(s)",
            self.settings.cancel_grace_s,
            len(self.supervisor.running_job_ids()),
        )
        end = time.monotonic() + self.settings.cancel_grace_s
        while self.supervisor.running_job_ids() and time.monotonic() < end:
            self.supervisor.wait([self.bridge.wake_r], min(0.5, max(0.0, end - time.monotonic())))
            self.bridge.drain_wake()
            self.tick(self.clock())
        interrupted = self.supervisor.running_job_ids()
        self.supervisor.stop()
        now = self.clock()
        for job_id in interrupted:
            job = store.get(job_id)
            if job["state"] in (JobState.RUNNING, JobState.CANCELLING):
                dst = JobState.CANCELLED if job["state"] == JobState.CANCELLING else JobState.QUEUED
                # A graceful stop is not the job's fault: its attempt does not count.
                extra = {"attempt": job["attempt"] - 1} if dst == JobState.QUEUED else {}
                job = store.transition(job_id, dst, now, detail={"reason": "graceful stop"}, **extra)
                self.publish_job(job)
                log.info("job %s %s by the graceful stop", job_id, dst.value)
        self.publish_queue(now)
        self.bridge.close(offline=True)
        self.close()
        log.info("stopped")

    def close(self) -> None:
        """Release the store and the wake-up sockets (also for a service that never ran)."""
        for sock in (self._sig_r, self._sig_w, self.bridge.wake_r, self.bridge._wake_w):
            sock.close()
        self.notifier.close()
        if self.store is not None:
            self.store.close()
        if self._lock is not None:
            self._lock.close()


def serve(settings: Settings, *, client_id: str | None = None) -> int:
    """Run the service until SIGTERM/SIGINT; the exit code for the process."""
    return Service(settings, client_id=client_id).run()
