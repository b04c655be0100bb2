"""The service: the composition root. Boot order, the main loop, outcomes of attempts.

Boot reads like a script (docs/cli.md, "`edge-queue serve`"): open the store and migrate, requeue the attempts a
dead run left ``running``, start the workers, connect to the broker, serve. One thread owns
the store and every decision; paho's thread and the worker pipes only wake it.

This module is the one place where the outcome of an attempt becomes a job state
(:meth:`Service.on_outcome`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import select
import shutil
import signal
import socket
import sqlite3
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from . import discovery, payloads
from .bridge import MAX_PROPERTY_BYTES, Bridge, Connected, Incoming
from .commands import BULK_LIMIT, Commands, RejectionLog, rejections, roots_text
from .config import Settings
from .errors import ConfigError, ErrorCode, NotFoundError
from .instance import claim_base_topic, describe
from .kinds import registry
from .notify import Notifier
from .page import PageServer
from .preflight import check_data_dir
from .scan import RetainedScan
from .states import JobState, cancelled_error, is_terminal
from .store import Store, iso, new_id
from .supervisor import Outcome, Supervisor, _Slot
from .topics import ONLINE, Topics
from .watch import WatchFolders

log = logging.getLogger(__name__)

#: At most one progress publish per job per second (docs/topics.md, "`<base>/jobs/<job_id>`").
PROGRESS_PUBLISH_INTERVAL_S = 1.0
#: At most one ``<base>/queue`` publish per this many seconds.
QUEUE_PUBLISH_INTERVAL_S = 1.0
#: At most one ``<base>/batches/<id>`` publish per batch per this many seconds.
BATCH_PUBLISH_INTERVAL_S = 0.5
#: Job ids from the read of retained job topics (:mod:`.scan`) checked against the store per turn.
SCAN_CHECK_PER_TURN = 5_000
#: MQTT 3.1.1: after clearing a retained request, the broker's echo of the clearing is expected
#: for this long.
ECHO_WINDOW_S = 5.0
#: Requests whose effect changes the store: their first response is kept, so that the same
#: request delivered again after a lost acknowledgement is answered with it, not run twice.
STATEFUL_COMMANDS = frozenset({"submit", "cancel", "retry", "pause", "resume", "purge"})
#: A redelivery comes within this many requests of the first delivery (at most RECEIVE_MAXIMUM,
#: 1,000, are in flight to us), and the broker reuses a packet identifier only after 65,535 others.
REDELIVERY_WINDOW = 10_000
#: The record of an executed request is kept this long (seconds): a broker redelivers only
#: within the service's session, which expires after ``mqtt.session_expiry_s`` (default a day).
DELIVERED_KEEP_S = 7 * 86400.0
#: How often terminal jobs past ``retention_days`` are purged.
RETENTION_INTERVAL_S = 600.0
#: Requests executed in one loop turn at most; the rest wait, in order, for the next turns.
TURN_REQUESTS = 500
#: Job changes one turn takes on through requests (jobs created, cancelled, purged) before it
#: stops taking requests: a submit of 1,000 inputs counts 1,000.
TURN_WORK = 2_000
#: A turn stops taking requests once what it is to publish reaches this many bytes (a
#: ``list`` of 500 jobs may answer with a megabyte).
TURN_BYTES = 8 * 2**20
#: The republish after a connect sends this many job states per turn, while fewer than
#: BACKLOG_LOW messages wait for the broker: it proceeds in pieces, between requests.
REPUBLISH_PAGE = 1_000
BACKLOG_LOW = 4_000
#: A job's non-terminal retained state is published once it has stood this long (seconds).
COALESCE_S = 0.02
#: The largest MQTT packet the broker may send us: the size limit of the shipped broker
#: configurations (mosquitto ``max_packet_size``); requests up to it get an answer.
MAX_PACKET_BYTES = 16 * 2**20
#: A loop turn longer than this is logged (the watchdog and the Last Will allow far more).
SLOW_TURN_S = 1.0
#: How often free disk space is measured for ``limits.min_free_disk_mb``.
DISK_CHECK_INTERVAL_S = 2.0


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

    Threads: one. The loop (:meth:`step`) waits in one ``select`` on the broker's socket, the
    worker pipes and process sentinels, and a signal socket; then :meth:`tick` acts on
    everything pending, within per-turn budgets, as one group commit. Nothing it decides
    (responses, PUBACKs, state publishes, job hand-outs) leaves before that commit.

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
        self._timeouts = {k: settings.kind(k).timeout_s for k in self.kinds}
        self._outputs = str(settings.outputs_dir)
        self.run_id = new_id()
        self.instance_id = ""  # the installation's id, from the store (boot)
        self._requests_seen = 0  # QoS 1 requests received, ever (kept in the store each turn)
        #: other installations seen announcing themselves on our base topic: id -> their info
        self.conflicts: dict[str, dict[str, Any]] = {}
        self.started_at = iso(clock())
        self.paused = False
        self.stopping = False
        self.stop_now = False  # a second SIGTERM/SIGINT: do not wait for running jobs
        self.store: Store | None = None
        self.supervisor = Supervisor(settings)
        # Requests over max_payload_bytes are answered payload_too_large from their size alone
        # (the bridge drops their bytes on arrival); the broker sends us nothing larger than
        # MAX_PACKET_BYTES (MQTT 5 Maximum Packet Size).
        self.bridge = Bridge(
            settings.mqtt,
            self.topics,
            client_id=client_id,
            max_packet_bytes=MAX_PACKET_BYTES,
            max_payload_bytes=settings.max_payload_bytes,
        )
        self.commands = Commands(self)
        self.notifier = Notifier()
        self._sig_r, self._sig_w = socket.socketpair()
        self._sig_r.setblocking(False)
        self._sig_w.setblocking(False)
        self.watch_folders = WatchFolders(self)  # [[watch]] (edge_queue/watch.py)
        self._pending_progress: dict[str, dict[str, Any]] = {}
        self._last_progress_pub: dict[str, float] = {}
        self._published_stage: dict[str, str | None] = {}
        self._queue_dirty = True
        self._last_queue_pub = 0.0
        self._dirty_batches: set[str] = set()
        self._last_batch_pub: dict[str, float] = {}
        # Retained job state is coalesced: job id -> (latest state, is terminal) decided this
        # turn, and job id -> (latest state, monotonic time it changed first) of committed
        # non-terminal states held back for COALESCE_S (see _publish_job_states).
        self._turn_jobs: dict[str, tuple[bytes, bool]] = {}
        self._held_jobs: dict[str, tuple[bytes, float]] = {}
        self._turn_purged: list[str] = []
        #: ids of the turn's taken messages that were not requests (clearings of retained requests,
        #: echoes of ours): acknowledged without an answer, also when the turn fails
        self._turn_not_requests: set[int] = set()
        self._ha_last: dict[str, Any] | None = None  # the turn's last finished job, for <base>/ha/last
        #: MQTT 3.1.1 only: topic -> (echoes of our clearing still expected, monotonic deadline)
        self._echoes: dict[str, tuple[int, float]] = {}
        #: retained requests answered lately: (topic, payload digest) -> monotonic deadline
        self._answered_retained: dict[tuple[str, bytes], float] = {}
        self._boot_changes: list[dict[str, Any]] = []  # events owed for changes made before connecting
        self._lock: Any = None
        self._scan: RetainedScan | None = None
        self._rescan = False  # a connect happened while a read was running: read again after it
        self._scan_ids: list[str] = []  # job ids read, still to check against the store
        self._scan_cleared = 0
        self._store_was_new = False
        self._next_retention = 0.0
        self._republish_at: tuple[str, str] | None = None  # (phase, cursor) of the republish
        self._republish_started = 0.0
        self._republish_count = 0
        self._carried: list[Outcome] = []  # outcomes of a turn whose commit failed
        self._commit_failures = RejectionLog("failed commit(s)", logging.ERROR, log)
        self._tokens = 0.0
        self._tokens_at = time.monotonic()
        self._disk_checked = 0.0
        self._disk_free_mb: float | None = None
        self.longest_turn_s = 0.0
        self.turn_work = 0  # job changes requests made in this turn (see TURN_WORK)
        self.page: PageServer | None = None  # the queue page ([http]), started by run()

    # -- boot ---------------------------------------------------------------------------

    def boot(self, *, connect_timeout_s: float = 30.0) -> None:
        """Open the store, requeue orphans, start workers, connect. Raises BrokerUnavailable."""
        check_data_dir(self.settings)
        s = self.settings
        s.data_dir.mkdir(parents=True, mode=0o700, exist_ok=True)  # the store holds every transcript
        # The store and its -wal and -shm files readable by the service's user only, whatever
        # the umask (SQLite gives the -wal and -shm files the mode of the database file).
        try:
            os.close(os.open(s.db_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            pass
        for path in (s.db_path, Path(f"{s.db_path}-wal"), Path(f"{s.db_path}-shm")):
            if path.exists() and path.stat().st_mode & 0o077:
                os.chmod(path, 0o600)
        self._lock = lock_data_dir(s.data_dir)
        self._store_was_new = not s.db_path.exists() or s.db_path.stat().st_size == 0
        self.store = Store(s.db_path, s.durability)
        if self._store_was_new:
            os.chmod(s.db_path, 0o600)  # readable by the service's user only, whatever the umask
        self.instance_id = self.store.instance_id()
        self.paused = bool(self.store.meta("paused"))  # a pause outlives restarts
        self._requests_seen = self.store.meta("requests_seen") or 0
        if self.paused:
            log.warning("the queue is paused (since before this start): no job starts until a resume")
        if not self.bridge.client_id:
            self.bridge.set_client_id(f"edge-queue-{self.instance_id}-{self.store.client_id_secret()}")
        claim_base_topic(s.mqtt, self.topics, self.instance_id, self.bridge.client_id, connect_timeout_s)
        self.requeue_orphans()
        self.supervisor.start()
        self.watch_folders.boot()
        # another installation announcing itself: live messages only (a retained one is our
        # own, or was checked by claim_base_topic before we connected)
        self.bridge.watch[self.topics.info] = lambda payload, retained: (
            None if retained else self.on_foreign_info(payload)
        )
        ha = s.homeassistant
        if ha.discovery:
            # Home Assistant's birth message (not retained): it has just started, send the config
            self.bridge.watch[f"{ha.prefix}/status"] = self.on_homeassistant_status
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
                    error=cancelled_error(),
                )
                log.warning("job %s: cancelled (the service ended while it was cancelling)", job_id)
            elif job["started_at"] is None and job["state"] == JobState.RUNNING:
                # Still in its worker's queue when the service ended: the attempt never began.
                job = store.transition(
                    job_id,
                    JobState.QUEUED,
                    now,
                    detail={"reason": "service restart before its worker started it"},
                    owner=None,
                    attempt=job["attempt"] - 1,
                )
            elif job["attempt"] >= job["max_attempts"]:
                # The attempt counts; with none left, the job fails: a job that takes the whole
                # service down cannot loop forever.
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
        """Signal handler (SIGTERM, SIGINT): only sets a flag and wakes the loop. A second
        signal during the graceful stop ends the wait for running jobs at once."""
        if self.stopping:
            self.stop_now = True
        self.stopping = True
        try:
            self._sig_w.send(b"\0")
        except OSError:
            pass

    # -- the loop -----------------------------------------------------------------------

    def run(self) -> int:
        """Boot, serve until SIGTERM/SIGINT, stop gracefully. Returns 0."""
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        self.boot()
        # after the boot (the data_dir lock, the broker): a second service on the same data_dir
        # exits before it binds; before the first loop turn, which announces <base>/info
        self.start_page()
        where = f"{self.settings.mqtt.host}:{self.settings.mqtt.port}"
        log.info(
            "edge-queue %s serving on %s (base topic %s, %d workers); data in %s; media roots: %s",
            package_version(),
            where,
            self.topics.base,
            self.settings.workers,
            self.settings.data_dir,
            roots_text(self.settings.media_roots),
        )
        self.notifier.ready(f"serving on {where}, base topic {self.topics.base}")
        while not self.stopping:
            self.step(max_wait_s=min(1.0, (self.notifier.watchdog_s or 2.0) / 4))
            self.notifier.tick()
        self.notifier.stopping()
        self.shutdown()
        return 0

    # -- the queue page ([http]) -------------------------------------------------------

    def start_page(self) -> None:
        """Serve the queue page (:mod:`.page`) when ``http.enabled``. An address that cannot be
        bound costs the page, not the queue: logged as an error, and ``<base>/info`` says
        ``"http_port": null``."""
        http = self.settings.http
        if not http.enabled:
            return
        try:
            self.page = PageServer(http, self.topics.base, package_version()).start()
        except OSError as e:
            log.error("queue page: cannot listen on %s:%d (%s); the queue runs without it", http.host, http.port, e)
            return
        if (why := page_broker_problem(self.settings)) is not None:
            log.warning("queue page: %s", why)

    def page_url(self) -> str | None:
        """The page's address for Home Assistant's device link, or ``None`` without a page:
        ``http://<http.host, or this machine's name for a wildcard address>:<port>/``."""
        if self.page is None:
            return None
        host = self.page.host if self.page.host not in ("0.0.0.0", "::", "") else socket.gethostname()
        return f"http://{f'[{host}]' if ':' in host else host}:{self.page.port}/"

    def step(self, max_wait_s: float = 1.0) -> None:
        """One turn of the loop: wait for something (at most ``max_wait_s`` seconds), then act
        on what is pending, within the turn's budgets."""
        sock = self.bridge.fileno()
        readable: list[Any] = [self._sig_r, *self.supervisor.wait_handles()]
        writable: list[Any] = []
        if sock is not None:
            readable.append(sock)
            if self.bridge.want_write():
                writable.append(sock)
        timeout = self._wait_s(max_wait_s)
        try:
            select.select(readable, writable, [], timeout)
        except InterruptedError:
            pass
        t0 = time.monotonic()
        try:
            while self._sig_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
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
        """Act on everything pending at ``now``: messages, worker outcomes, due jobs, publishes.

        All of it is one group commit (one fsync); nothing it publishes, answers, acknowledges
        or hands to a worker leaves before that commit. When the commit fails (a full disk, a
        damaged file), the turn's requests are answered with the error and its worker outcomes
        are kept for the next turn: none is lost and the service keeps serving.
        """
        store = self._store()
        taken: list[Incoming] = []
        self._turn_not_requests.clear()
        self.turn_work = 0
        outcomes = self._carried + self.supervisor.poll()
        self._carried = []
        try:
            with self.bridge.held(), store.group():
                self._take_inbox(taken)
                self.on_outcomes(outcomes, self.clock())
                self.schedule(self.clock())
                self.flush(self.clock())
                self.housekeeping(self.clock())
                self._republish_step()
                self.watch_folders.step(self.clock())
                if taken:
                    # last: a new job may be claimed before its row is written (Store.claim)
                    store.set_meta("requests_seen", self._requests_seen)
        except (sqlite3.Error, OSError) as e:
            self._turn_failed(e, taken, outcomes)
            return
        self.watch_folders.committed()
        self.supervisor.dispatch()
        self._publish_job_states(time.monotonic())
        self._remove_outputs()

    def _remove_outputs(self) -> None:
        """Delete the output folders (under ``data_dir``) of jobs whose purge was committed."""
        for job_id in self._turn_purged:
            out_dir = self.settings.outputs_dir / job_id
            if out_dir.is_dir():
                shutil.rmtree(out_dir, ignore_errors=True)
        self._turn_purged.clear()

    def _turn_failed(self, e: Exception, taken: list[Incoming], outcomes: list[Outcome]) -> None:
        self.supervisor.unassign()
        self.watch_folders.turn_failed()
        self._turn_jobs.clear()
        self._turn_purged.clear()
        self._carried = [o for o in outcomes if o.op != "progress"]
        full = _disk_full(e)
        code = ErrorCode.DISK_FULL if full else ErrorCode.INTERNAL_ERROR
        self._commit_failures.warning(
            "could not commit to %s: %s; %d request(s) answered %s, the turn's job changes are kept for the next turn",
            self.settings.db_path,
            e,
            len(taken),
            code,
        )
        message = (
            "the disk holding the job store is full; free space and retry"
            if full
            else "the job store could not be written; see the service log"
        )
        with self.bridge.held():
            for msg in taken:
                if id(msg) in self._turn_not_requests:  # a clearing or an echo: no answer (_on_message)
                    self.bridge.ack(msg)
                    continue
                transaction, reply_to = payloads.peek_envelope(msg.payload)
                self.answer(msg, payloads.error(code, message, transaction), reply_to)

    def _take_inbox(self, taken: list[Incoming]) -> None:
        """Take what arrived, within the turn's budget: at most :data:`TURN_REQUESTS`
        requests, none while the broker has :data:`~edge_queue.bridge.BACKLOG_HIGH` of our messages to
        acknowledge, and at most ``limits.max_requests_per_s``. What is left stays in the
        inbox, unacknowledged, so the broker holds back the rest (MQTT flow control)."""
        inbox = self.bridge.inbox
        budget = TURN_REQUESTS
        rate = self.settings.limits.max_requests_per_s
        if rate:
            mono = time.monotonic()
            # a bucket of at least one token, so that a rate under 1/s still lets requests through
            self._tokens = min(max(rate, 1.0), self._tokens + (mono - self._tokens_at) * rate)
            self._tokens_at = mono
            budget = min(budget, int(self._tokens))
        while inbox:
            item = inbox[0]
            if isinstance(item, Incoming):
                if budget <= 0 or self.turn_work >= TURN_WORK or self.bridge.held_bytes >= TURN_BYTES:
                    break
                if not self.bridge.connected:
                    # Its PUBACK could not be sent: the broker would deliver it again, and it
                    # would run twice. It waits for the reconnect (which drops the copies the
                    # broker redelivers: Bridge._on_connect).
                    break
                if not self._backlog_low():
                    break
                budget -= 1
                if rate:
                    self._tokens -= 1
                inbox.popleft()
                self.bridge.inbox_bytes -= len(item.payload)
                taken.append(item)
                self.on_message(item)
            else:
                inbox.popleft()
                self.on_connected(item)

    def _backlog_low(self) -> bool:
        """True unless :meth:`Bridge.backlog_high`: requests are taken only then."""
        return not self.bridge.backlog_high()

    def on_connected(self, item: Connected) -> None:
        """(Re)connected: ``online``, ``info``, the changes made before the first connect, and
        a republish of every job and batch, in pieces (:meth:`_republish_step`)."""
        if not item.session_present:
            # A new session: nothing the broker sends on it is a redelivery of an earlier message.
            self._store().forget_all_requests()
        self.bridge.publish(self.topics.status, ONLINE, retain=True)
        self.bridge.publish(self.topics.info, payloads.encode(self.info()), retain=True)
        self.publish_discovery()
        for job in self._boot_changes:
            self.publish_job(job)
        self._boot_changes.clear()
        self.start_republish()
        self._start_scan()

    def _start_scan(self) -> None:
        """Read the retained job topics on a connection of the scan's own (:mod:`.scan`)."""
        if self._scan is not None:
            self._rescan = True
            return
        self._rescan = False
        self._scan_ids = []
        self._scan_cleared = 0
        self._scan = RetainedScan(
            self.settings.mqtt, self.topics, self.bridge.client_id, self.bridge.protocol, self._sig_w
        )
        self._scan.start()

    def _scan_step(self) -> None:
        """Take the scan's result when it has ended; check its job ids in pieces, one per turn."""
        scan = self._scan
        if scan is not None and not scan.is_alive():
            self._scan = None
            if scan.result is None:
                log.warning("could not read the retained job topics to clear unknown ones: %s", scan.error)
            else:
                log.debug(
                    "read %d retained job and %d batch topics in %.1f s",
                    len(scan.result),
                    len(scan.batches),
                    scan.seconds,
                )
                self._scan_ids = sorted(scan.result)
                self.on_retained_batches(sorted(scan.batches))
            if self._rescan:
                self._start_scan()
        if self._scan_ids:
            piece, self._scan_ids = self._scan_ids[:SCAN_CHECK_PER_TURN], self._scan_ids[SCAN_CHECK_PER_TURN:]
            self.on_retained_jobs(piece)
            if not self._scan_ids and self._scan_cleared:
                log.info("cleared the retained state of %d job(s) this store does not know", self._scan_cleared)

    def housekeeping(self, now: float) -> None:
        """Clear retained job topics the store does not know; purge jobs past ``retention_days``."""
        self._scan_step()
        if now >= self._next_retention and not self.bridge.holding:
            self._next_retention = now + RETENTION_INTERVAL_S
            self._store().forget_requests(now - max(DELIVERED_KEEP_S, self.settings.mqtt.session_expiry_s))
            expired = self._store().finished_before(now - self.settings.retention_days * 86400, limit=BULK_LIMIT)
            if len(expired) == BULK_LIMIT:
                self._next_retention = now + 1.0  # more to purge: the rest in later turns
            if expired:
                log.info(
                    "retention: purging %d job(s) finished more than %g days ago",
                    len(expired),
                    self.settings.retention_days,
                )
                self.purge(expired)

    def purge(self, job_ids: list[str]) -> list[str]:
        """Delete terminal jobs, their output folders under ``data_dir`` (outputs written beside
        the input are the user's and are kept), and clear their retained topics (and those of
        batches left empty; a batch that keeps some jobs is published again without them)."""
        gone, batches, shrunk = self._store().delete(job_ids)
        for job_id in gone:
            self._turn_jobs.pop(job_id, None)
            self._held_jobs.pop(job_id, None)
            self.bridge.publish(self.topics.job(job_id), b"", retain=True)
            self._turn_purged.append(job_id)  # their output folders go once this is committed
        for batch_id in batches:
            self._dirty_batches.discard(batch_id)
            self.bridge.publish(self.topics.batch(batch_id), b"", retain=True)
        self._dirty_batches.update(shrunk)
        if gone:
            self._queue_dirty = True
            log.info("purged %d job(s)", len(gone))
        return gone

    def on_retained_batches(self, batch_ids: list[str]) -> None:
        """Retained ``<base>/batches/<id>`` seen after a connect: clear those the store does not
        know (a fresh ``data_dir``, a broker save older than a purge)."""
        store = self._store()
        cleared = 0
        for start in range(0, len(batch_ids), 500):
            chunk = batch_ids[start : start + 500]
            known = store.batch_ids_in(chunk)
            for batch_id in chunk:
                if batch_id not in known:
                    cleared += 1
                    self.bridge.publish(self.topics.batch(batch_id), b"", retain=True)
        if cleared:
            log.info("cleared the retained state of %d batch(es) this store does not know", cleared)

    def on_retained_jobs(self, job_ids: list[str]) -> None:
        """Retained ``<base>/jobs/<id>`` seen after a connect: clear those the store does not
        know. A store created at this start that finds job state on the broker says so first:
        it may be a store replaced by mistake (restore a backup before it is cleared)."""
        store = self._store()
        for start in range(0, len(job_ids), 500):
            chunk = job_ids[start : start + 500]
            known = store.job_ids_in(chunk)
            for job_id in chunk:
                if job_id in known:
                    continue
                if self._scan_cleared == 0:
                    if self._store_was_new:
                        log.error(
                            "the job store %s was created at this start, but the broker holds job state on %s: "
                            "clearing the retained state of jobs it does not know (if the store was replaced by "
                            "mistake, stop edge-queue and restore a backup; see docs/operations.md)",
                            self.settings.db_path,
                            self.topics.all_jobs,
                        )
                    else:
                        log.warning("clearing the retained state of jobs this store does not know")
                self._scan_cleared += 1
                log.debug("clearing retained state of unknown job %s", job_id)
                self.bridge.publish(self.topics.job(job_id), b"", retain=True)

    def _wait_s(self, cap: float) -> float:
        if self.bridge.inbox and self._inbox_has_takeable():
            return 0.0
        waits = [cap]
        if (b := self.bridge.wait_s(time.monotonic())) is not None:
            waits.append(b)
        if (d := self.supervisor.next_deadline()) is not None:
            waits.append(d)
        if self._pending_progress or self._dirty_batches:
            waits.append(BATCH_PUBLISH_INTERVAL_S / 2)
        if self._republish_at is not None or self._carried:
            waits.append(0.05)
        if self._held_jobs:
            waits.append(COALESCE_S)
        now = self.clock()
        if (due := self._store().next_due(after=now)) is not None:
            waits.append(max(0.0, due - now))
        if (watch := self.watch_folders.wait_s(self.clock())) is not None:
            waits.append(watch)
        return max(0.0, min(waits))

    def _inbox_has_takeable(self) -> bool:
        if not self._backlog_low() or not self.bridge.connected:
            return False
        rate = self.settings.limits.max_requests_per_s
        return not rate or self._tokens + (time.monotonic() - self._tokens_at) * rate >= 1

    # -- requests -----------------------------------------------------------------------

    def on_message(self, msg: Incoming) -> None:
        """Execute one request and answer it; the PUBACK follows the commit."""
        try:
            self._on_message(msg)
        except sqlite3.Error:
            raise  # the whole turn fails over (see tick)
        except Exception:  # a bug costs one request, never the service
            log.exception("request on %s: internal error", _clip(msg.topic))
            self.answer(msg, payloads.error(ErrorCode.INTERNAL_ERROR, "internal error; see the service log"), None)

    def _on_message(self, msg: Incoming) -> None:
        """Checks in the order of docs/topics.md, "Order of checks"."""
        if msg.qos:
            self._requests_seen += 1
        now = time.monotonic()
        limit = self.settings.max_payload_bytes
        if not msg.size and (msg.retain or self._take_echo(msg.topic, now)):
            # Someone clearing a retained request, or (MQTT 3.1.1) the broker echoing our own
            # clearing of one: not a request.
            self._turn_not_requests.add(id(msg))
            self.bridge.ack(msg)
            return
        if msg.retain:
            retained_key = (msg.topic, hashlib.sha256(msg.payload).digest() + msg.size.to_bytes(8))
            if self._answered_retained.get(retained_key, 0.0) > now:
                # The same retained message again (an MQTT 3.1.1 broker sends it from the
                # session's queue and again for the subscription): answered once.
                self.bridge.ack(msg)
                return
            if len(self._answered_retained) >= 1000:
                self._answered_retained = {k: t for k, t in self._answered_retained.items() if t > now}
            self._answered_retained[retained_key] = now + ECHO_WINDOW_S
            rejections.warning(
                "retained request on %s not executed; cleared it (publish requests without the retain flag)",
                _clip(msg.topic),
            )
            self._expect_echo(msg.topic, now)
            self.bridge.publish(msg.topic, b"", retain=True)
            transaction, reply_to = payloads.peek_envelope(msg.payload) if msg.size <= limit else (None, None)
            self.answer(
                msg,
                payloads.error(ErrorCode.INVALID_REQUEST, "retained requests are not executed", transaction),
                reply_to,
            )
            return
        if msg.property_bytes:
            # Its MQTT 5 properties were too many to decode: answered on our topic only.
            rejections.warning(
                "request on %s rejected: invalid_request (%d bytes of properties)", _clip(msg.topic), msg.property_bytes
            )
            self.answer(
                msg,
                payloads.error(
                    ErrorCode.INVALID_REQUEST,
                    f"the request's MQTT 5 properties take {msg.property_bytes} bytes; "
                    f"the limit is {MAX_PROPERTY_BYTES}",
                    field="(properties)",
                ),
                None,
            )
            return
        if msg.size > limit:
            # Its bytes were dropped on arrival: refused from its size, nothing echoed back.
            rejections.warning("request on %s rejected: payload_too_large (%d bytes)", _clip(msg.topic), msg.size)
            self.answer(
                msg,
                payloads.error(
                    ErrorCode.PAYLOAD_TOO_LARGE,
                    f"payload is {msg.size} bytes; the limit is {limit} (max_payload_bytes)",
                ),
                None,
            )
            return
        key = request_key(msg) if msg.qos and msg.command in STATEFUL_COMMANDS else None
        if key is not None and msg.dup:
            first = self._store().recall_request(key)
            # Only a record of one of the last REDELIVERY_WINDOW requests can be for this very
            # message: the broker numbers its messages to us on, 1..65535, and may reuse a
            # number only after it had our PUBACK for it.
            if first is not None and self._requests_seen - first[2] <= REDELIVERY_WINDOW:
                # Delivered again after its acknowledgement was lost: it took effect already.
                log.info(
                    "request %s on %s delivered again after a lost acknowledgement: answered with its first "
                    "response, not executed again",
                    msg.mid,
                    _clip(msg.topic),
                )
                self.answer(msg, json.loads(first[0]), first[1])
                return
        response, reply_to = self.commands.execute(msg.command, msg.payload, msg.user)
        if key is not None:  # errors too: delivered again, it gets the same answer
            store = self._store()
            store.remember_request(key, payloads.encode(response), reply_to, self.clock(), self._requests_seen)
        self.answer(msg, response, reply_to)

    def _expect_echo(self, topic: str, now: float) -> None:
        """We clear a retained request on ``topic``. MQTT 5: our subscription has No Local, so
        the broker does not send the clearing back. MQTT 3.1.1 has no such option: the broker
        sends it back as a plain empty message, which is counted here and not answered; an empty
        request beyond that count (a client's) is answered as any other."""
        if self.bridge.protocol_name == "5":
            return
        if len(self._echoes) >= 1000:
            self._echoes = {t: e for t, e in self._echoes.items() if e[1] > now}
        count, _ = self._echoes.get(topic, (0, 0.0))
        self._echoes[topic] = (count + 1, now + ECHO_WINDOW_S)

    def _take_echo(self, topic: str, now: float) -> bool:
        """True when an empty message on ``topic`` is the echo of our own clearing (see
        :meth:`_expect_echo`); counts it."""
        count, deadline = self._echoes.get(topic, (0, 0.0))
        if count <= 0 or deadline < now:
            self._echoes.pop(topic, None)
            return False
        if count == 1:
            del self._echoes[topic]
        else:
            self._echoes[topic] = (count - 1, deadline)
        return True

    def answer(self, msg: Incoming, response: dict[str, Any], reply_to: str | None) -> None:
        """Publish the response (on ``<base>/response/<command>``, or for a request on a user's
        own request topic on ``<base>/reply/<user>/response/<command>``), acknowledge the
        request, then publish the copies for the topics the client named (``reply_to``, the
        MQTT 5 Response Topic; for a user, under its own ``<base>/reply/<user>/``), in that order.

        A copy on a client-named topic goes out after the PUBACK and is never sent twice
        (:meth:`Bridge.respond` with ``once=True``): whatever the broker does with it (refuse
        it, close our connection), the request is not delivered again and the service goes on.
        """
        body = payloads.encode(response)
        user = msg.user
        if user is None:
            self.bridge.respond(self.topics.response(msg.command), body)
        else:  # a user's own request topic: the response is for that user only
            self.bridge.respond(self.topics.user_response(user, msg.command), body, once=True)
        self.bridge.ack(msg)
        if _ours_only(response):
            return
        if msg.response_topic and self.topics.valid_reply_to(msg.response_topic, user):
            self.bridge.respond(msg.response_topic, body, correlation_data=msg.correlation_data, once=True)
        if reply_to and self.topics.valid_reply_to(reply_to, user):
            self.bridge.respond(reply_to, body, once=True)

    def disk_full(self) -> str | None:
        """Why new work is refused for lack of disk space (``limits.min_free_disk_mb``), or None.
        Free space is measured at most every :data:`DISK_CHECK_INTERVAL_S` seconds."""
        limit = self.settings.limits.min_free_disk_mb
        if not limit:
            return None
        mono = time.monotonic()
        if self._disk_free_mb is None or mono - self._disk_checked >= DISK_CHECK_INTERVAL_S:
            self._disk_checked = mono
            try:
                self._disk_free_mb = shutil.disk_usage(self.settings.data_dir).free / 2**20
            except OSError:
                self._disk_free_mb = None
                return None
        if self._disk_free_mb < limit:
            return (
                f"only {self._disk_free_mb:.0f} MiB free in {self.settings.data_dir} "
                f"(limits.min_free_disk_mb is {limit}); free space, or purge old jobs and their outputs"
            )
        return None

    # -- outcomes -----------------------------------------------------------------------

    def on_outcomes(self, outcomes: list[Outcome], now: float) -> None:
        """:meth:`on_outcome` for each of a turn's outcomes, in order; each run of successes
        and starts (many short jobs) is stored at once (:meth:`Store.succeed_many`). A start
        whose job succeeded in the same run is stored with the success."""
        run: list[Outcome] = []
        for outcome in outcomes:
            if outcome.op in ("done", "started"):
                run.append(outcome)
                continue
            self._on_successes(run, now)
            run = []
            self.on_outcome(outcome, now)
        self._on_successes(run, now)

    def _on_successes(self, run: list[Outcome], now: float) -> None:
        if not run:
            return
        store = self._store()
        reports = [(o.job_id, o.attempt, o.data.get("result")) for o in run if o.op == "done"]
        finished = {(job_id, attempt) for job_id, attempt, _ in reports}
        store.mark_started_many(
            [(o.job_id, o.attempt) for o in run if o.op == "started" and (o.job_id, o.attempt) not in finished], now
        )
        started = [(o.job_id, o.attempt) for o in run if o.op == "started" and (o.job_id, o.attempt) in finished]
        done = store.succeed_many(reports, now, started=[job_id for job_id, _ in started]) if reports else {}
        store.mark_started_many([(job_id, attempt) for job_id, attempt in started if job_id not in done], now)
        others: list[Outcome] = []
        for outcome in run:
            if outcome.op != "done":
                continue
            job = done.get(outcome.job_id)
            if job is None:  # not running on that attempt: the general path decides, below
                others.append(outcome)
                continue
            self._pending_progress.pop(outcome.job_id, None)
            self._last_progress_pub.pop(outcome.job_id, None)
            self._published_stage.pop(outcome.job_id, None)
            log.info("job %s succeeded (attempt %d)", outcome.job_id, outcome.attempt)
            self.publish_job(job)
        # After the run's successes: their events have the lower ids (succeed_many numbered
        # them), and <base>/events goes out in event_id order (docs/topics.md, "Events").
        for outcome in others:
            self.on_outcome(outcome, now)

    def on_outcome(self, outcome: Outcome, now: float) -> None:
        """Turn what a worker reported (or its death) into the job's next state: the general
        path, which checks the job's state and attempt and explains what it refuses (the usual
        successes are stored by :meth:`on_outcomes` at once)."""
        store = self._store()
        job_id, attempt, data = outcome.job_id, outcome.attempt, outcome.data
        if outcome.op == "started":  # a job from a worker's queue became its current one
            store.mark_started_many([(job_id, attempt)], now)
            return
        if outcome.op == "progress":
            # Every stage is published; within a stage, at most once per second.
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
        except NotFoundError:
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
        if outcome.op == "unstarted" and not cancelling:
            # Its worker died before it started it, or gave it back (a pause, a stop, a job that
            # overran): back to the queue, the attempt not counted, not started (a cancelled
            # one ends cancelled, below).
            job = store.transition(
                job_id,
                JobState.QUEUED,
                now,
                expect_attempt=attempt,
                current=job,
                detail={"reason": data.get("reason", "its worker ended before it started")},
                attempt=attempt - 1,
                owner=None,
                started_at=None,
            )
            self.publish_job(job)
            return
        if outcome.op == "done":
            job = store.transition(
                job_id,
                JobState.SUCCEEDED,
                now,
                expect_attempt=attempt,
                current=job,
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
        # Consecutive worker deaths: any other outcome breaks the run.
        crashes = job["crashes"] + 1 if outcome.op == "lost" and code == ErrorCode.WORKER_LOST else 0
        retryable = bool(data.get("retryable", code not in (ErrorCode.CANCELLED,)))
        # While cancelling: a cancel seen at a checkpoint, or the worker ended after the grace
        # period, is "cancelled"; a failure the job reported by itself stays a failure.
        if code == ErrorCode.CANCELLED or (cancelling and outcome.op in ("lost", "unstarted")):
            # a job cancelled before its worker started it never had that attempt
            unstarted: dict[str, Any] = (
                {"attempt": attempt - 1, "started_at": None} if outcome.op == "unstarted" else {}
            )
            job = store.transition(
                job_id,
                JobState.CANCELLED,
                now,
                expect_attempt=attempt,
                current=job,
                crashes=crashes,
                error=cancelled_error(),
                **unstarted,
            )
            log.info("job %s cancelled", job_id)
        elif crashes >= self.settings.crash_loop_limit:
            job = store.transition(
                job_id,
                JobState.FAILED,
                now,
                expect_attempt=attempt,
                current=job,
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
                current=job,
                crashes=crashes,
                retry_at=now + delay,
                error={"code": code, "message": message, "retryable": True},
            )
            log.warning(
                "job %s attempt %d failed (%s: %s); retry in %.1f s", job_id, attempt, code, _clip(message), delay
            )
        else:
            job = store.transition(
                job_id,
                JobState.FAILED,
                now,
                expect_attempt=attempt,
                current=job,
                crashes=crashes,
                error={"code": code, "message": message, "retryable": retryable},
            )
            log.error("job %s failed: %s: %s", job_id, code, _clip(message))
        self.publish_job(job)

    # -- scheduling ---------------------------------------------------------------------

    def schedule(self, now: float) -> None:
        """Give due jobs to workers, within each kind's ``max_concurrency``, in priority order:
        first one job to each idle worker, then short jobs to workers that hold only short jobs,
        up to :meth:`Supervisor.prefetch` each (see :class:`Supervisor`)."""
        if self.paused or self.stopping or self.bridge.holding or self.bridge.backlog_high():
            return
        store, sup = self._store(), self.supervisor
        if not store.waiting():
            return
        busy = sup.busy_by_kind()

        def allowed(fast_only: bool) -> list[str]:
            return [
                k
                for k, lim in self._concurrency.items()
                if (lim is None or busy[k] < lim) and (not fast_only or sup.fast(k))
            ]

        for slot in sup.idle():
            job = store.claim(now, allowed(False), self.run_id)
            if job is None:
                break
            self._assign(slot, job)
            busy[job["kind"]] += 1
            if not store.waiting():
                return  # nothing left to claim: no query for the other workers (P2's idle case)
        unlimited = [k for k, lim in self._concurrency.items() if lim is None]
        for slot in sup.prefetching():
            if not store.waiting():
                return
            # kinds without a concurrency limit: up to the worker's room at once
            jobs = store.claim_many(
                now, [k for k in allowed(True) if k in unlimited], self.run_id, sup.room(slot), started=False
            )
            for job in jobs:
                self._assign(slot, job)
            while sup.room(slot) > 0 and (kinds := allowed(True)):
                claimed = store.claim_many(now, kinds, self.run_id, 1, started=False)
                if not claimed:
                    break
                job = claimed[0]
                self._assign(slot, job)
                busy[job["kind"]] += 1

    def _assign(self, slot: _Slot, job: dict[str, Any]) -> None:
        timeout = job["timeout_s"] or self._timeouts[job["kind"]]
        self.supervisor.assign(slot, job, f"{self._outputs}/{job['job_id']}", timeout)
        if log.isEnabledFor(logging.INFO):
            log.info(
                "job %s started: %s %s (attempt %d)",
                job["job_id"],
                job["kind"],
                _clip(job["input"] or "(no input)"),
                job["attempt"],
            )
        self.publish_job(job)

    # -- publishing ---------------------------------------------------------------------

    def publish_job(self, job: dict[str, Any], event: str | None = None) -> None:
        """An event now; the retained job topic once per turn with the job's latest state (a
        job that changes several times in one turn is published once, ``seq`` only grows);
        the job's batch; marks ``<base>/queue`` for update."""
        body = payloads.encode(payloads.job_object(job))
        terminal = is_terminal(job["state"])
        self._turn_jobs[job["job_id"]] = (body, terminal)
        if event is None:
            event = "end" if terminal else "update"
        # The event embeds the very bytes of the retained state: encoded once. event_id: the
        # state change's id in the store's event log (the events request's cursor); progress
        # is not a state change and has none.
        event_id = job.get("event_id")
        self.bridge.publish(
            self.topics.events,
            b'{"v":1,"type":"%s","event_id":%s,"job":%s}'
            % (event.encode(), b"null" if event_id is None else str(int(event_id)).encode(), body),
        )
        if job.get("batch_id"):
            self._dirty_batches.add(job["batch_id"])
        self._queue_dirty = True
        if terminal and event == "end" and self.settings.homeassistant.discovery:
            self._ha_last = job  # Home Assistant's "last result": once per turn, the turn's last

    def _publish_job_states(self, mono: float, *, everything: bool = False) -> None:
        """Publish the retained job states committed by the turns so far: a terminal state at
        once; any other state once it has stood for :data:`COALESCE_S` (a job that goes
        queued -> running -> succeeded within that window is published once, as succeeded;
        ``seq`` only grows, and ``<base>/events`` carries every transition)."""
        if self._ha_last is not None:
            last = payloads.encode(discovery.last_payload(self._ha_last))
            self.bridge.publish(discovery.last_topic(self.topics), last, retain=True)
            self._ha_last = None
        held = self._held_jobs
        for job_id, (body, terminal) in self._turn_jobs.items():
            if terminal:
                held.pop(job_id, None)
                self.bridge.publish(self.topics.job(job_id), body, retain=True)
            else:
                since = held[job_id][1] if job_id in held else mono
                held[job_id] = (body, since)
        self._turn_jobs.clear()
        if not held:
            return
        due = [j for j, (_, since) in held.items() if everything or mono - since >= COALESCE_S]
        for job_id in due:
            body, _ = held.pop(job_id)
            self.bridge.publish(self.topics.job(job_id), body, retain=True)

    def publish_batch(self, batch_id: str) -> None:
        try:
            batch = self._store().batch(batch_id)
        except NotFoundError:
            return
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
        if len(self._last_batch_pub) > 10_000:  # forget the times of batches long quiet
            self._last_batch_pub = {b: t for b, t in self._last_batch_pub.items() if now - t < 60}
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
                    "progress": None if j["progress"] is None else round(float(j["progress"]), 1),
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
            "instance_id": self.instance_id,
            "host": socket.gethostname(),
            **({"conflict": list(self.conflicts.values())} if self.conflicts else {}),
            "kinds": {  # the options' JSON Schemas: the kinds request
                name: {
                    "description": k.description,
                    "needs_input": k.needs_input,
                    "options": sorted(k.Options.model_fields),
                }
                for name, k in self.kinds.items()
            },
            "default_kind": self.settings.default_kind,
            "media_roots": [str(r) for r in self.settings.media_roots],
            **({"watch": self.watch_folders.info()} if self.settings.watch else {}),
            "workers": self.settings.workers,
            "broker_protocol": self.bridge.protocol_name,
            "http_port": self.page.port if self.page is not None else None,
        }

    def publish_discovery(self) -> None:
        """The Home Assistant device config (retained), or an empty one that removes the device
        when discovery is off (docs/home-assistant.md)."""
        ha = self.settings.homeassistant
        topic = discovery.config_topic(ha.prefix, self.instance_id)
        store = self._store()
        if not ha.discovery:
            # Cleared once, only when this installation published one: with discovery off the
            # broker's ACL need not let the service write there (mosquitto 2.0.11 closes the
            # connection of a client whose publish it denies).
            if store.meta("discovery_published"):
                self.bridge.publish(topic, b"", retain=True)
                store.set_meta("discovery_published", 0)
            return
        config = discovery.device_config(
            self.topics, self.instance_id, socket.gethostname(), package_version(), configuration_url=self.page_url()
        )
        self.bridge.publish(topic, payloads.encode(config), retain=True)
        if not store.meta("discovery_published"):
            store.set_meta("discovery_published", 1)

    def on_homeassistant_status(self, payload: bytes, retained: bool) -> None:
        if payload.strip() == b"online":
            log.info("Home Assistant came online: sending the discovery config again")
            self.publish_discovery()

    def set_paused(self, paused: bool) -> None:
        """Pause (no job starts; running ones go on) or resume the queue, kept in the store.

        On pause, the jobs handed to workers in advance and not started yet are asked back
        (:meth:`Supervisor.release`): they go back to ``queued``, their attempt not counted, and
        none starts after the pause is acknowledged (docs/topics.md, ``pause``)."""
        self._store().set_meta("paused", int(paused))
        self.paused = paused
        if paused:
            for slot in self.supervisor.slots:
                if len(slot.jobs) > 1:
                    self.supervisor.release(slot)
        self.publish_queue(self.clock())

    def on_foreign_info(self, payload: bytes) -> None:
        """A live ``<base>/info`` from another installation: two services on one base topic.
        Logged, and shown in our own ``info`` (``conflict``), once per other installation."""
        try:
            info = json.loads(payload)
        except ValueError:
            return
        if not isinstance(info, dict):
            return
        other = info.get("instance_id")
        if not other or other == self.instance_id or other in self.conflicts:
            return
        self.conflicts[str(other)] = {k: info.get(k) for k in ("instance_id", "host", "version", "started_at")}
        log.error(
            "another edge-queue announced itself on our base topic %s: %s; both take the same requests. Give each "
            "box its own mqtt.base_topic, and stop one of them",
            self.topics.base,
            describe(info),
        )
        self.bridge.publish(self.topics.info, payloads.encode(self.info()), retain=True)

    def republish(self) -> bool:
        """Republish ``status``, ``info``, ``queue``, every job and batch from the store.

        Proceeds in pieces between requests (:meth:`_republish_step`). Returns False when a
        republish was already in progress: then that one covers this request too (state that
        changes meanwhile is published by the change itself)."""
        if self._republish_at is not None:
            return False
        self.bridge.publish(self.topics.status, ONLINE, retain=True)
        self.bridge.publish(self.topics.info, payloads.encode(self.info()), retain=True)
        self.publish_discovery()
        self.start_republish()
        return True

    def start_republish(self) -> None:
        self._republish_at = ("jobs", "")
        self._republish_started = time.monotonic()
        self._republish_count = 0

    def _republish_step(self) -> None:
        """Send the next piece of the republish when the broker keeps up (the backlog of our
        unacknowledged messages is under :data:`BACKLOG_LOW`)."""
        if self._republish_at is None or self.bridge.backlog >= BACKLOG_LOW or not self.bridge.connected:
            return
        phase, cursor = self._republish_at
        store = self._store()
        if phase == "jobs":
            page = store.iter_job_page(cursor, REPUBLISH_PAGE)
            for job in page:
                if job["job_id"] not in self._held_jobs and job["job_id"] not in self._turn_jobs:
                    self.bridge.publish(
                        self.topics.job(job["job_id"]), payloads.encode(payloads.job_object(job)), retain=True
                    )
            self._republish_count += len(page)
            self._republish_at = ("jobs", page[-1]["job_id"]) if len(page) == REPUBLISH_PAGE else ("batches", "")
        elif phase == "batches":
            ids = store.batch_id_page(cursor, REPUBLISH_PAGE // 10)
            for batch_id in ids:
                self.publish_batch(batch_id)
            if len(ids) == REPUBLISH_PAGE // 10:
                self._republish_at = ("batches", ids[-1])
            else:
                self._republish_at = None
                self.publish_queue(self.clock())
                log.info(
                    "republished the retained state of %d job(s) in %.1f s",
                    self._republish_count,
                    time.monotonic() - self._republish_started,
                )

    # -- stop ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Graceful stop: no new jobs; running ones get ``cancel_grace_s`` to finish; the rest
        are ended and requeued without counting the attempt; ``offline``."""
        store = self._store()
        self.stopping = True
        for slot in self.supervisor.slots:
            if len(slot.jobs) > 1:  # jobs waiting in a worker's queue go back to the queue now
                self.supervisor.release(slot)
        running = len(self.supervisor.running_job_ids())
        if running:
            log.info("stopping: waiting up to %.0f s for %d running job(s)", self.settings.cancel_grace_s, running)
        else:
            log.info("stopping: no job is running")
        end = time.monotonic() + self.settings.cancel_grace_s
        while self.supervisor.running_job_ids() and time.monotonic() < end and not self.stop_now:
            self.step(min(0.5, max(0.0, end - time.monotonic())))
        interrupted = self.supervisor.running_job_ids()
        if self.stop_now and interrupted:
            log.warning("second stop signal: stopping now; %d running job(s) are queued again", len(interrupted))
        self.supervisor.stop()
        self.watch_folders.stop()
        now = self.clock()
        try:
            with self.bridge.held(), store.group():
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
            self._publish_job_states(time.monotonic(), everything=True)
        except (sqlite3.Error, OSError) as e:
            log.error("could not record the graceful stop in %s: %s", self.settings.db_path, e)
        self.bridge.close(offline=True)
        self.close()
        log.info("stopped (longest loop turn %.0f ms)", self.longest_turn_s * 1000)

    def close(self) -> None:
        """Release the store and the wake-up sockets (also for a service that never ran)."""
        self.watch_folders.stop()
        for sock in (self._sig_r, self._sig_w):
            sock.close()
        self.notifier.close()
        if self.page is not None:
            self.page.stop()
            self.page = None
        if self.store is not None:
            self.store.close()
        if self._lock is not None:
            self._lock.close()


def page_broker_problem(settings: Settings) -> str | None:
    """Why the queue page cannot reach the broker from this box, or None: without
    ``http.websocket_url`` the page connects to the box's ``http.websocket_port``, and nothing
    accepts connections there (a broker without a WebSocket listener; docs/operations.md,
    "The queue page")."""
    http = settings.http
    if http.websocket_url is not None:
        return None
    from .embedded_broker import port_open

    host = settings.mqtt.host if settings.mqtt.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    if port_open(host, http.websocket_port, 1.0) or port_open("127.0.0.1", http.websocket_port, 1.0):
        return None
    return (
        f"nothing listens on port {http.websocket_port} (http.websocket_port), where the page looks for the "
        "broker's MQTT over WebSocket listener: the page cannot connect until the broker has one "
        '(broker/mosquitto.conf: listener 9001 with protocol websockets; docs/operations.md, "The queue page")'
    )


def _ours_only(response: dict[str, Any]) -> bool:
    """True for the errors docs/topics.md ("Where the response goes", "Order of checks") sends
    to ``<base>/response/<command>`` only, without the copies for a Response Topic or
    ``reply_to``: ``payload_too_large``, and ``invalid_request`` for the ``reply_to`` itself or
    for MQTT 5 properties too large to read. Decided from the response, so a request delivered
    again is answered the same way."""
    error = response.get("error")
    if not isinstance(error, dict):
        return False
    code = error.get("code")
    return code == ErrorCode.PAYLOAD_TOO_LARGE or (
        code == ErrorCode.INVALID_REQUEST and error.get("field") in ("reply_to", "(properties)")
    )


def request_key(msg: Incoming) -> bytes:
    """What identifies one delivery of a request to this service: the packet identifier the
    broker gave it on our session (kept when the broker sends it again, MQTT 5.0 4.4), its
    topic and payload (SHA-256). The same publish delivered again after a lost PUBACK has the
    same key; the broker numbers new messages on, so two requests share a key only when they
    are equal and 65,536 messages apart, and then only a redelivery (DUP) is looked up."""
    digest = hashlib.sha256()
    digest.update(msg.mid.to_bytes(2, "big"))
    digest.update(msg.topic.encode())
    digest.update(b"\0")
    digest.update(msg.payload)
    return digest.digest()


def _disk_full(e: BaseException) -> bool:
    if isinstance(e, OSError):
        return e.errno == errno.ENOSPC
    return "disk is full" in str(e) or getattr(e, "sqlite_errorcode", None) == 13  # SQLITE_FULL


def _clip(text: str, n: int = 200) -> str:
    """Text from a client or the file system, for a log line: one line, at most ``n`` characters."""
    return text[:n].encode("unicode_escape").decode("ascii")


def serve(settings: Settings, *, client_id: str | None = None) -> int:
    """Run the service until SIGTERM/SIGINT; the exit code for the process."""
    return Service(settings, client_id=client_id).run()
