"""The service: the composition root and the one-thread loop (docs/architecture.md).

Boot reads like a script (docs/cli.md, "`edge-queue serve`"): open the store and migrate, requeue
the attempts a dead run left ``running``, start the workers, connect to the broker, serve.

Invariants that hold between the rooms wired here:

- **One thread.** The loop (:meth:`Service.step`) owns the store and every decision; paho's
  socket is read by the loop itself, and the worker pipes, the watch-folder thread and the
  retained scan only wake it (the wake socket).
- **Commit before acknowledge.** A turn (:meth:`Service.tick`) is one group commit (one fsync).
  Nothing it decides leaves before that commit: responses, PUBACKs, retained states, events
  and job hand-outs are held by the bridge and the supervisor until the commit succeeded.
  When the commit fails, the turn's requests are answered with the error and its worker
  outcomes are kept for the next turn: none is lost and the service keeps serving.
- **Bounded turns.** A turn takes at most ``TURN_REQUESTS`` requests, ``TURN_WORK`` job changes
  and ``TURN_BYTES`` of output (:mod:`.limits`); the rest wait in the inbox, unacknowledged, so
  the broker holds them back (MQTT flow control).
- **One place per decision.** Job lifecycle rules are :mod:`.lifecycle` (applied by
  :mod:`.outcomes`), scheduling is :mod:`.scheduler`, request checks are :mod:`.dispatch`,
  what is published is :mod:`.publisher` and :mod:`.announce`.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import select
import signal
import socket
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge_queue import package_version
from edge_queue.component import Component
from edge_queue.config.settings import Settings
from edge_queue.errors import ConfigError
from edge_queue.http.api_server import ApiServer, start_api
from edge_queue.http.page import PageServer, start_page
from edge_queue.jobs.control import QueueControl
from edge_queue.jobs.outcomes import Outcomes
from edge_queue.jobs.recovery import GhostClearing, requeue_orphans
from edge_queue.jobs.retention import Retention
from edge_queue.jobs.scheduler import Scheduler
from edge_queue.kinds import registry
from edge_queue.logfmt import TurnLog
from edge_queue.mqtt.bridge import Bridge
from edge_queue.mqtt.inbox import Connected
from edge_queue.mqtt.instance import claim_base_topic, note_base_topic
from edge_queue.mqtt.takeover import EXIT_SHARED_CLIENT_ID, SESSION_KEY
from edge_queue.mqtt.topics import MAX_REPLY_AREAS, ReplyAreas, Topics
from edge_queue.nodes.hub import Nodes
from edge_queue.notify import Notifier
from edge_queue.publish.announce import Announcer
from edge_queue.publish.publisher import Publisher, Republisher
from edge_queue.requests.commands import Commands
from edge_queue.requests.dispatch import Dispatcher
from edge_queue.requests.http_intake import HttpIntake
from edge_queue.requests.models import SubmitRequest
from edge_queue.requests.ports import Intake
from edge_queue.requests.queue import SERVICE
from edge_queue.rules.inputs import roots_text
from edge_queue.rules.lifecycle import backoff_s
from edge_queue.rules.limits import DiskGuard
from edge_queue.rules.rates import RejectionLog
from edge_queue.store import Store, iso, new_id
from edge_queue.store.preflight import check_data_dir, no_locks, private_store_files
from edge_queue.voice.intake import VoiceIntake, is_voice_job
from edge_queue.voice.server import VoiceServer, start_voice
from edge_queue.wake import WakeSocket
from edge_queue.watch.folders import WatchFolders
from edge_queue.workers.supervisor import Supervisor

log = logging.getLogger(__name__)

#: The largest MQTT packet the broker may send us: the size limit of the shipped broker
#: configurations (mosquitto ``max_packet_size``); requests up to it get an answer.
MAX_PACKET_BYTES = 16 * 2**20
#: A loop turn longer than this is logged (the watchdog and the Last Will allow far more).
SLOW_TURN_S = 1.0
#: At most this long (seconds) the service still takes its own requests already on their way
#: once another installation is found to share its client id, before it stops: until none
#: came for SETTLE_QUIET_S while connected (the other installation takes the session from it
#: every second or two meanwhile).
SETTLE_S, SETTLE_QUIET_S = 30.0, 3.0


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
    except OSError as e:  # ENOLCK: a file system without locks (store/preflight.py checks it first)
        fh.close()
        raise ConfigError(no_locks(data_dir, e.strerror or str(e))) from e
    return fh


class Service:
    """edge-queue's service process (``edge-queue serve``): wires the rooms and runs the loop.

    Threads: one. The loop (:meth:`step`) waits in one ``select`` on the broker's socket, the
    worker pipes and process sentinels, and a wake socket; then :meth:`tick` acts on
    everything pending, within per-turn budgets, as one group commit.

    Implements :class:`~edge_queue.requests.ports.QueuePort` (for :mod:`.commands`) and
    :class:`~edge_queue.requests.ports.WatchPort` (for :mod:`.watch`).

    Args:
        settings: the validated configuration.
        client_id: MQTT client id; defaults to ``mqtt.client_id``.
        clock: Unix seconds; injectable for tests.
        rng: uniform draws in [0, 1) for the backoff's jitter; injectable for tests.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        client_id: str | None = None,
        clock: Callable[[], float] = time.time,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.settings, self.clock = settings, clock
        self.topics = Topics(settings.mqtt.base_topic)
        self.kinds = checked_kinds(settings)
        self.run_id = new_id()
        self.stopping = False
        self.stop_now = False  # a second SIGTERM/SIGINT: do not wait for running jobs
        self.store: Store | None = None
        self.supervisor = Supervisor(settings, lane=True)
        # payload_too_large from the size alone (bytes dropped); nothing over MAX_PACKET_BYTES (MQTT 5)
        self.bridge = Bridge(
            settings.mqtt,
            self.topics,
            client_id=client_id,
            max_packet_bytes=MAX_PACKET_BYTES,
            max_payload_bytes=settings.max_payload_bytes,
        )
        self.packet_limit = lambda: self.bridge.outbox.packet_limit  # (QueuePort's)
        self.notifier = Notifier()
        self.wake = WakeSocket()
        self.page: PageServer | None = None  # the queue page ([http]), started by run()
        self.api: ApiServer | None = None  # the HTTP API ([api]), started by run()
        self.voice: VoiceServer | None = None  # the Wyoming listener ([wyoming]), started by run()
        self.reply_areas = ReplyAreas([*settings.access.admins, *settings.access.users, *settings.access.nodes])
        self.commands = Commands(self)
        self.nodes = Nodes(settings, self.topics, self.bridge, kinds=self.kinds)  # worker nodes: docs/nodes.md
        self.watch_folders = WatchFolders(self)  # [[watch]] (edge_queue/watch/folders.py)
        self.control: QueueControl  # pause, resume, republish (below: it needs the publisher)
        self.publisher = Publisher(
            self.bridge,
            self.topics,
            self.job_store,
            self.supervisor,
            lambda: self.control.paused,
            ha_last=settings.homeassistant.discovery,
            nodes=self.nodes.summary,
            private=lambda job: is_voice_job(job, settings.voice_dir),  # no "Job finished" of a voice command
        )
        self.republisher = Republisher(self.publisher, clock)
        self.announcer = Announcer(
            settings,
            self.topics,
            self.kinds,
            self.bridge,
            self.job_store,
            self.watch_folders.info,
            lambda: self.page,
            iso(clock()),
            self.nodes.summary,
            self.publisher.ha_finished,
        )
        control = (self.job_store, self.supervisor, self.publisher, self.announcer, self.republisher, clock)
        self.control = QueueControl(*control)
        retry = settings.retry
        self.disk = DiskGuard(settings.data_dir, settings.limits.min_free_disk_mb)
        self.outcomes = Outcomes(
            self.job_store,
            self.publisher,
            self.disk,
            crash_loop_limit=settings.crash_loop_limit,
            backoff=lambda attempt: backoff_s(attempt, retry.backoff_base_s, retry.backoff_cap_s, rng),
            sources=(self.supervisor.poll, lambda: self.nodes.poll(self.bridge.connected)),
        )
        self.nodes.on_change = self.node_changed
        self.scheduler = Scheduler(
            settings,
            self.kinds,
            self.job_store,
            self.supervisor,
            self.run_id,
            self.publisher.publish_job,
            self.nodes,
            may_start=self.may_start,
        )
        self.retention = Retention(settings, self.job_store, self.publisher, holding=self.holding)
        self.ghosts = GhostClearing(settings, self.topics, self.bridge, self.job_store, self.wake.writer)
        areas = self.reply_areas
        self.dispatcher = Dispatcher(settings, self.topics, self.bridge, self.job_store, self.commands, clock, areas)
        self.dispatcher.on_shared_submit = self.announcer.submitted  # Home Assistant's <base>/ha/submit
        self.dispatcher.on_connected = self.on_connected
        self.dispatcher.on_request = self.publisher.request_seen  # <base>/events may have a reader
        queue, ended = self.commands.queue, self.publisher.turn_ended
        self.http_intake = HttpIntake(settings, queue, self.job_store, self.wake.writer, ended)  # [api]'s
        purge = self.retention.purge
        self.voice_intake = VoiceIntake(settings, queue, self.job_store, self.wake.writer, ended, purge)  # [wyoming]'s
        self.intakes: tuple[Intake, ...] = (self.dispatcher, self.watch_folders, self.http_intake, self.voice_intake)
        #: the turn's parts, in its order (docs/architecture.md, "The turn's parts")
        self.parts: tuple[Component, ...] = (
            *self.intakes,  # first: a job from any door is claimed in the turn that took it
            self.outcomes,
            self.nodes,
            self.scheduler,
            self.supervisor,  # hands the turn's claims to the workers once committed
            self.publisher,
            self.ghosts,
            self.retention,
            self.republisher,
        )
        # the ports' operations (edge_queue/requests/ports.py) that another room does
        self.publish_job, self.purge = self.publisher.publish_job, self.retention.purge
        self.info, self.publish_info = self.announcer.info, self.announcer.publish_info
        self.set_paused, self.republish = self.control.set_paused, self.control.republish
        self.disk_full = self.disk.why_full
        self.turn_log = TurnLog.attach()  # a turn's lines are logged once it is committed
        self._boot_changes: list[dict[str, Any]] = []  # events owed for changes made before connecting
        self._lock: Any = None
        self._commit_failures = RejectionLog("failed commit(s)", logging.ERROR, log)
        self.longest_turn_s = 0.0

    # -- boot ---------------------------------------------------------------------------

    def boot(self, *, connect_timeout_s: float = 30.0) -> None:
        """Open the store, requeue orphans, start workers, connect. Raises BrokerUnavailable."""
        check_data_dir(self.settings)
        s = self.settings
        self.ghosts.store_was_new = store_was_new = private_store_files(s)
        self._lock = lock_data_dir(s.data_dir)
        self.store = store = Store(s.db_path, s.durability)
        if store_was_new:
            os.chmod(s.db_path, 0o600)  # readable by the service's user only, whatever the umask
        self.announcer.instance_id = instance_id = store.instance_id()
        self.control.restore()  # a pause outlives restarts
        self.dispatcher.requests_seen = store.meta("requests_seen") or 0
        if not self.bridge.client_id:
            self.bridge.set_client_id(f"edge-queue-{instance_id}-{store.client_id_secret()}")
        self.bridge.foreign.recorded = store.meta_text(SESSION_KEY)
        claim_base_topic(s.mqtt, self.topics, instance_id, self.bridge.client_id, connect_timeout_s)
        note_base_topic(store, s.mqtt, self.topics)
        self.reply_areas.note_all(store.submitters(MAX_REPLY_AREAS))
        self._boot_changes = requeue_orphans(store, self.run_id, self.clock())
        self.nodes.adopt(store.on_nodes())  # jobs on worker nodes keep their lease
        self.supervisor.start()
        self.watch_folders.boot()
        self.announcer.listen()
        self.bridge.connect(connect_timeout_s)

    def request_stop(self, *_: Any) -> None:
        """Signal handler (SIGTERM, SIGINT): only sets a flag and wakes the loop. A second
        signal during the graceful stop ends the wait for running jobs at once."""
        if self.stopping:
            self.stop_now = True
        self.stopping = self.outcomes.stopping = True
        self.wake.wake()

    # -- the loop -----------------------------------------------------------------------

    def run(self) -> int:
        """Boot, serve until SIGTERM/SIGINT, stop gracefully. Returns 0."""
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        self.boot()
        # after the boot (the data_dir lock, the broker): a second service on the same data_dir
        # exits before it binds; before the first loop turn, which announces <base>/info
        self.page = start_page(self.settings, self.topics.base, package_version())
        self.api = start_api(self.settings, self.http_intake, package_version())
        self.voice = start_voice(self.settings, self.voice_intake, self.announcer.instance_id)
        where = log_serving(self.settings, self.topics.base)
        self.notifier.ready(f"serving on {where}, base topic {self.topics.base}")
        while not self.stopping and self.bridge.foreign.shared is None:
            self.step(max_wait_s=min(1.0, (self.notifier.watchdog_s or 2.0) / 4))
            self.notifier.tick()
        if self.bridge.foreign.shared is not None and self.bridge.connected:  # not when taken over
            settle_own_requests(self)
        self.notifier.stopping()
        self.shutdown()
        return 0 if self.bridge.foreign.shared is None else EXIT_SHARED_CLIENT_ID

    def step(self, max_wait_s: float = 1.0) -> None:
        """One loop turn: wait for something (at most ``max_wait_s`` s), then act on what is pending."""
        sock = self.bridge.fileno()
        readable: list[Any] = [self.wake.reader, *self.supervisor.wait_handles()]
        writable: list[Any] = []
        if sock is not None:
            readable.append(sock)
            if self.bridge.want_write():
                writable.append(sock)
        try:
            select.select(readable, writable, [], self._wait_s(max_wait_s))
        except InterruptedError:
            pass
        t0 = time.monotonic()
        self.wake.drain()
        self.bridge.pump(time.monotonic())
        self.tick(self.clock())
        self.bridge.pump(time.monotonic())
        self.bridge.settle()
        took = time.monotonic() - t0
        if took > self.longest_turn_s:
            self.longest_turn_s = took
            if took >= SLOW_TURN_S:
                log.warning("slow loop turn: %.2f s", took)

    def tick(self, now: float) -> None:
        """Act on everything pending at ``now``: each part's turn (:attr:`parts`, in order:
        requests, worker outcomes, due jobs, publishes), as one group commit (see the module's
        invariants); then each part is told whether the commit succeeded. Each part's time is
        the clock read as its turn begins (never before ``now``), so no part stamps a time
        before what an earlier part of the turn stamped (a job submitted and claimed in one
        turn starts no earlier than it was created)."""
        store = self.job_store()
        try:
            with self.turn_log.held((sqlite3.Error, OSError)), self.bridge.held(), store.group():
                for part in self.parts:
                    now = max(now, self.clock())
                    part.turn(now)
                if self.dispatcher.taken:
                    # last: a new job may be claimed before its row is written (Store.claim)
                    store.set_meta("requests_seen", self.dispatcher.requests_seen)
        except (sqlite3.Error, OSError) as e:
            full = disk_full_error(e)
            for part in self.parts:
                part.turn_failed(disk_full=full)
            self._commit_failures.warning(
                "could not commit to %s: %s; %d request(s) answered %s, "
                "the turn's job changes are kept for the next turn",
                self.settings.db_path,
                e,
                len(self.dispatcher.taken),
                "disk_full" if full else "internal_error",
            )
            return
        for part in self.parts:
            part.committed()

    def may_start(self) -> bool:
        """True when the scheduler may start jobs: not paused or stopping, the broker keeping
        up with us, the disk over its minimum (docs/operations.md)."""
        held = self.bridge.holding or self.bridge.backlog_high()
        return not (self.control.paused or self.stopping or held) and self.disk.allows_starts()

    def node_changed(self) -> None:
        """A worker node came, went or changed: ``<base>/info`` now, ``<base>/queue`` soon."""
        self.announcer.publish_info()
        self.publisher.queue_dirty = True

    def on_connected(self, item: Connected) -> None:
        """(Re)connected: ``online``, ``info``, the changes made before the first connect, and
        a republish of every job and batch, in pieces (:class:`~edge_queue.publish.publisher.Republisher`)."""
        if not item.session_present:  # a new session: nothing sent on it is a redelivery
            self.job_store().requests.forget_all_requests()
        self.bridge.foreign.record(self.job_store())
        self.publisher.wake_unheard()  # who reads <base>/events and <base>/ha/finished: asked again
        self.announcer.connected()
        for job in self._boot_changes:
            self.publisher.publish_job(job)
        self._boot_changes.clear()
        self.nodes.renew_all(time.monotonic())
        self.republisher.start()
        self.ghosts.start()

    def _wait_s(self, cap: float) -> float:
        now, waits = self.clock(), [cap, self.bridge.wait_s(time.monotonic())]
        for part in self.parts:
            wait = part.wait_s(now)
            if wait == 0.0:
                return 0.0
            waits.append(wait)
        return max(0.0, min(w for w in waits if w is not None))

    # -- the ports (edge_queue/requests/ports.py) ------------------------------------------------

    def job_store(self) -> Store:
        assert self.store is not None, "boot() first"
        return self.store

    def count_work(self, changes: int) -> None:
        self.dispatcher.turn_work += changes

    def cancel_running(self, job_id: str) -> None:
        if not self.nodes.cancel(job_id):
            self.supervisor.cancel(job_id, self.settings.cancel_grace_s)

    def wake_socket(self) -> socket.socket:
        return self.wake.writer

    def holding(self) -> bool:
        return self.bridge.holding

    def connected(self) -> bool:
        return self.bridge.connected

    def submit_as_service(self, request: SubmitRequest) -> dict[str, Any]:
        return self.commands.queue.answer("submit", request, SERVICE)

    # -- stop ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Graceful stop: no new jobs, no new HTTP calls (:func:`stop_http_calls`); running
        ones get ``cancel_grace_s`` to finish; the rest are ended and requeued without counting
        the attempt (:func:`~edge_queue.rules.lifecycle.after_graceful_stop`); ``offline``."""
        store = self.job_store()
        self.stopping = self.outcomes.stopping = True
        stop_http_calls(self)
        self.control.release_waiting()  # jobs waiting in a worker's queue go back to the queue now
        interrupted = let_running_finish(self)
        self.supervisor.stop()
        self.watch_folders.stop()
        now = self.clock()
        try:
            with self.bridge.held(), store.group():
                self.outcomes.graceful_stop(interrupted, now)
                self.publisher.publish_queue(now)
            self.publisher.publish_states(time.monotonic(), everything=True)
        except (sqlite3.Error, OSError) as e:
            log.error("could not record the graceful stop in %s: %s", self.settings.db_path, e)
        self.bridge.close(offline=True)
        self.publisher.ha_finished.step()  # the runs Home Assistant got before the last PUBACKs
        self.close()
        log.info("stopped (longest loop turn %.0f ms)", self.longest_turn_s * 1000)

    def close(self) -> None:
        """Release the store and the wake-up sockets (also for a service that never ran)."""
        self.watch_folders.stop()
        self.wake.close()
        self.notifier.close()
        self.turn_log.detach()
        stop_http_calls(self, wait=True)
        if self.page is not None:
            self.page.stop()
            self.page = None
        if self.store is not None:
            self.store.close()
        if self._lock is not None:
            self._lock.close()


def log_serving(settings: Settings, base: str) -> str:
    """Log the line that says the service is serving; returns the broker's ``host:port``."""
    where = f"{settings.mqtt.host}:{settings.mqtt.port}"
    log.info(
        "edge-queue %s serving on %s (base topic %s, %d workers); data in %s; media roots: %s",
        package_version(),
        where,
        base,
        settings.workers,
        settings.data_dir,
        roots_text(settings.media_roots),
    )
    return where


def stop_http_calls(service: Service, *, wait: bool = False) -> None:
    """The stop begins: the HTTP callers waiting for a job are answered 503 ``stopping`` now,
    not after the running jobs' grace (docs/http-api.md, "Errors"), and the API winds down
    meanwhile, so that a stop with callers waiting takes no longer than one without; with
    ``wait`` (the end of the stop), until the API's server is done."""
    service.http_intake.stop()  # first: the API answers its waiting callers while it stops
    service.voice_intake.stop()
    if service.voice is not None:  # (a voice command does not outlive the stop's grace)
        service.voice.stop()
        service.voice = None
    if service.api is not None:
        service.api.stop() if wait else service.api.begin_stop()


def let_running_finish(service: Service) -> set[str]:
    """The graceful stop's wait: the running jobs get ``cancel_grace_s`` to finish (a second
    stop signal ends the wait); returns the ids of those still running after it."""
    running, grace_s = len(service.supervisor.running_job_ids()), service.settings.cancel_grace_s
    if running:
        log.info("stopping: waiting up to %.0f s for %d running job(s)", grace_s, running)
    else:
        log.info("stopping: no job is running")
    end = time.monotonic() + grace_s
    while service.supervisor.running_job_ids() and time.monotonic() < end and not service.stop_now:
        service.step(min(0.5, max(0.0, end - time.monotonic())))
    interrupted = service.supervisor.running_job_ids()
    if service.stop_now and interrupted:
        log.warning("second stop signal: stopping now; %d running job(s) are queued again", len(interrupted))
    return interrupted


def settle_own_requests(service: Service) -> None:
    """Another installation shares our client id (:class:`~edge_queue.mqtt.takeover.ForeignMessages`):
    our request topics are unsubscribed; the requests of ours already on their way are taken
    and answered for up to :data:`SETTLE_S` seconds (until none came for :data:`SETTLE_QUIET_S`
    while connected), so the session holds none of ours for the other installation."""
    end = time.monotonic() + SETTLE_S
    quiet_since = time.monotonic()
    while time.monotonic() < end and not service.stopping and time.monotonic() - quiet_since < SETTLE_QUIET_S:
        seen = service.bridge.inbox.received
        service.step(max_wait_s=0.1)
        if service.bridge.inbox.received != seen or service.bridge.inbox or not service.bridge.connected:
            quiet_since = time.monotonic()


def disk_full_error(e: BaseException) -> bool:
    """True when ``e`` (an ``OSError`` or an ``sqlite3.Error``) says the disk is full."""
    if isinstance(e, OSError):
        return e.errno == errno.ENOSPC
    return "disk is full" in str(e) or getattr(e, "sqlite_errorcode", None) == 13  # SQLITE_FULL


def serve(settings: Settings, *, client_id: str | None = None) -> int:
    """Run the service until SIGTERM/SIGINT; the exit code for the process."""
    return Service(settings, client_id=client_id).run()
