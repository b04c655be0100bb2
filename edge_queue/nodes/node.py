"""``edge-queue worker``: a worker node on another machine (docs/nodes.md).

The node takes jobs from the hub (the box running ``edge-queue serve``, whose store decides
every state) over the same MQTT broker, and runs them in the same supervised worker processes
as the hub's own pool (:class:`~edge_queue.workers.supervisor.Supervisor`: cancel, timeout, recycling,
crash handling). It keeps no store: what it must not lose, the outcomes of finished jobs, it
sends again until the hub answers ``ok``.

Topics (docs/nodes.md, "Topics"): the retained announcement ``<base>/nodes/<node_id>``, which
the node's Last Will turns ``offline``; ``<base>/nodes/<node_id>/up`` (heartbeats listing the
jobs held, progress, outcomes) and ``<base>/nodes/<node_id>/down`` (hand-outs, cancels, ``ok``).

Threads: the main thread runs the loop and owns every decision; paho's network thread only
queues what arrives and wakes it.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from pydantic import ValidationError

from edge_queue import package_version
from edge_queue.config.settings import Settings
from edge_queue.errors import EdgeQueueError, ErrorCode
from edge_queue.kinds import registry
from edge_queue.logfmt import clip
from edge_queue.mqtt.paho_client import configure_client, set_nodelay
from edge_queue.mqtt.probe import detect_protocol
from edge_queue.mqtt.topics import Topics
from edge_queue.rules.inputs import roots_text
from edge_queue.workers.supervisor import Outcome, Supervisor

from .hub_view import HUB_VIEW_AFTER_S, node_problems
from .pathmap import Entry, map_result, to_local

log = logging.getLogger(__name__)

#: Seconds the broker keeps the node's session (and the hand-outs sent to it) while it is away.
SESSION_EXPIRY_S = 3600
#: Progress of one job is sent at most this often (seconds).
PROGRESS_EVERY_S = 1.0


def node_id_of(settings: Settings) -> str:
    """This node's id: ``nodes.node_id``, else the broker user name, else the host name."""
    return settings.nodes.node_id or settings.mqtt.username or socket.gethostname().split(".")[0]


def readable_input(path: str, roots: list[Path]) -> str | None:
    """Why this machine cannot run a job on ``path`` (its path after the map), or None: the
    file must exist, be a regular file, lie inside one of ``roots`` once resolved, and open."""
    real = os.path.realpath(path)
    if not any(real == str(r) or real.startswith(str(r).rstrip("/") + "/") for r in roots):
        return f"{path} is not inside this node's media_roots ({roots_text(roots)})"
    if not os.path.isfile(real):
        return f"{path} does not exist on this node (check [[path_map]] and the share's mount)"
    try:
        with open(real, "rb"):
            pass
    except OSError as e:
        return f"{path} cannot be read on this node: {e.strerror}"
    return None


class WorkerNode:
    """One worker node: a broker connection, a worker pool, the jobs it holds.

    Args:
        settings: ``[mqtt]``, ``workers``, ``media_roots``, ``[[path_map]]``, ``[nodes]``, kinds.
        clock: monotonic seconds; injectable for tests.
    """

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings, self.clock = settings, clock
        self.node_id = node_id_of(settings)
        self.topics = Topics(settings.mqtt.base_topic)
        self.registry = registry(settings.extra_kinds)
        self.kinds = sorted(self.registry)
        self.told: set[str] = set()  # why the hub gives this node no job, as last logged
        self.hub_info: Any = None  # the hub's retained <base>/info, as last received
        self.connected_at = 0.0
        self.entries: list[Entry] = [(str(m.hub), str(m.local)) for m in settings.path_map]
        self.roots = [Path(os.path.realpath(r)) for r in settings.media_roots]
        self.supervisor = Supervisor(settings)
        self.inbox: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self.pending: dict[tuple[str, int], dict[str, Any]] = {}  # outcomes the hub has not answered
        self.progress_at: dict[str, float] = {}
        self.stopping = False
        self.connected = False
        self.next_beat = 0.0
        self.heartbeat_s = settings.nodes.heartbeat_s
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.client: mqtt.Client | None = None

    # -- the broker ---------------------------------------------------------------------

    def announcement(self, state: str) -> bytes:
        """The retained ``<base>/nodes/<node_id>`` object (docs/nodes.md, "The announcement")."""
        t = self.settings.transcribe
        return json.dumps(
            {
                "v": 1,
                "node_id": self.node_id,
                "state": state,
                "host": socket.gethostname(),
                "version": package_version(),
                "kinds": self.kinds,
                "slots": self.settings.workers,
                "device": t.device,
                "compute_type": t.compute_type,
                # the default model, then the names a job's "model" option may give
                "models": {"transcribe": [str(t.model) if t.model else "bundled", *sorted(t.models)]},
            },
            separators=(",", ":"),
        ).encode()

    def _make_client(self, protocol: str) -> mqtt.Client:
        v5 = protocol == "5"
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"edge-queue-node-{self.node_id}-{uuid.uuid4().hex[:8]}",
            protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311,
            # MQTT 3.1.1 has no session expiry: a clean session, so that a restarted node
            # leaves none behind (its outcomes are sent again anyway)
            clean_session=None if v5 else True,
        )
        configure_client(client, self.settings.mqtt)
        client.will_set(self.topics.node(self.node_id), self.announcement("offline"), qos=1, retain=True)
        client.reconnect_delay_set(1, 30)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        return client

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        if reason.is_failure:
            log.error("broker refused the connection: %s", reason)
            return
        set_nodelay(client)  # an outcome and the heartbeat after it leave at once (no Nagle wait)
        client.subscribe([(self.topics.node_down(self.node_id), 1), (self.topics.info, 1)])
        client.publish(self.topics.node(self.node_id), self.announcement("online"), qos=1, retain=True)
        self.inbox.put({"op": "connected"})
        self._wake()

    def _on_disconnect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        if not self.stopping:
            log.warning("disconnected from the broker (%s); reconnecting, running jobs go on", reason)
        self.inbox.put({"op": "disconnected"})
        self._wake()

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        try:
            obj = json.loads(msg.payload)
        except (ValueError, RecursionError):  # RecursionError: nested too deep to read
            log.warning("a message on %s that is not JSON was ignored", msg.topic)
            return
        if isinstance(obj, dict):
            self.inbox.put({"op": "hub_info", "info": obj} if msg.topic == self.topics.info else obj)
            self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass

    def _send(self, msg: dict[str, Any], qos: int = 1) -> None:
        if self.connected and self.client is not None:
            self.client.publish(self.topics.node_up(self.node_id), json.dumps({"v": 1, **msg}).encode(), qos=qos)

    # -- the loop -----------------------------------------------------------------------

    def request_stop(self, *_: Any) -> None:
        """Signal handler (SIGTERM, SIGINT): only sets a flag and wakes the loop."""
        self.stopping = True
        self._wake()

    def run(self) -> int:
        """Start the workers, connect, take jobs until SIGTERM/SIGINT, stop. Returns 0."""
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        s = self.settings
        protocol: str = s.mqtt.protocol
        if protocol == "auto":  # amqtt speaks MQTT 3.1.1 only
            protocol = detect_protocol(s.mqtt, f"edge-queue-node-{self.node_id}", 30.0)
        self.client = client = self._make_client(protocol)
        self.supervisor.start()
        if protocol == "5":
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = SESSION_EXPIRY_S
            # a new session for each start (hand-outs queued for an earlier process are stale),
            # kept across reconnects of this one
            client.connect_async(
                s.mqtt.host,
                s.mqtt.port,
                keepalive=s.mqtt.keepalive_s,
                clean_start=mqtt.MQTT_CLEAN_START_FIRST_ONLY,
                properties=props,
            )
        else:
            client.connect_async(s.mqtt.host, s.mqtt.port, keepalive=s.mqtt.keepalive_s)
        client.loop_start()
        log.info(
            "edge-queue %s worker node %s: %d slot(s), kinds %s, hub at %s:%s (base topic %s); media roots: %s",
            package_version(),
            self.node_id,
            s.workers,
            ", ".join(self.kinds),
            s.mqtt.host,
            s.mqtt.port,
            self.topics.base,
            roots_text(s.media_roots),
        )
        while not self.stopping:
            self.step(1.0)
        self.shutdown()
        return 0

    def step(self, max_wait_s: float) -> None:
        """Wait for a worker, the broker or the heartbeat, then act on what is pending."""
        wait = max(0.0, min(max_wait_s, self.next_beat - self.clock()))
        deadline = self.supervisor.next_deadline()
        if deadline is not None:
            wait = min(wait, deadline)
        self.supervisor.wait([self._wake_r], wait)
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                break
            self._handle(msg)
        for outcome in self.supervisor.poll():
            self._outcome(outcome)
        if self.clock() >= self.next_beat:
            self.beat()

    def beat(self) -> None:
        """The heartbeat: the jobs held (which renews their leases) and the free slots; and
        every outcome the hub has not answered, again."""
        self.next_beat = self.clock() + self.heartbeat_s
        held = [list(key) for key in self._held()]
        self._send({"op": "beat", "jobs": held, "free": len(self.supervisor.idle())})
        for msg in self.pending.values():
            self._send(msg)
        if self.connected and self.clock() - self.connected_at >= HUB_VIEW_AFTER_S:
            self._tell_why()

    def _tell_why(self) -> None:
        """Say, once each, why the hub's info shows this node gets no job (and when that ends)."""
        problems = node_problems(self.hub_info, self.node_id, self.entries)
        for problem in problems:
            if problem not in self.told:
                log.warning("this node gets no job: %s", problem)
        if self.told and not problems:
            log.info("the hub lists this node now")
        self.told = set(problems)

    def _held(self) -> list[tuple[str, int]]:
        """(job id, attempt) of every job a worker of this node holds."""
        return [(e.msg["job_id"], e.msg["attempt"]) for slot in self.supervisor.slots for e in slot.jobs]

    def _handle(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "connected":
            self.connected, self.connected_at = True, self.clock()
            log.info("connected to the broker; node %s online", self.node_id)
            self.beat()
        elif op == "disconnected":
            self.connected = False
        elif op == "run":
            self._run(msg)
        elif op == "cancel":
            job_id, attempt = msg.get("job_id"), msg.get("attempt")
            for slot in self.supervisor.slots:
                if any(e.msg["job_id"] == job_id and e.msg["attempt"] == attempt for e in slot.jobs):
                    log.info("job %s: the hub asks to stop it", job_id)
                    self.supervisor.cancel(str(job_id), self.settings.cancel_grace_s)
        elif op == "ok":
            self.pending.pop((str(msg.get("job_id")), int(msg.get("attempt") or 0)), None)
        elif op == "hub_info":  # the hub's retained info, looked at with the next heartbeats
            self.hub_info = msg.get("info")

    def _run(self, msg: dict[str, Any]) -> None:
        job_id, attempt = str(msg.get("job_id")), int(msg.get("attempt") or 0)
        lease_s = msg.get("lease_s")
        if isinstance(lease_s, (int, float)) and lease_s > 0 and self.heartbeat_s > lease_s / 3:
            # three heartbeats per lease, whatever nodes.heartbeat_s says: one lost message
            # must not cost a job
            self.heartbeat_s = lease_s / 3
            log.warning(
                "nodes.heartbeat_s %.1f s is over a third of the hub's lease (%.1f s): heartbeats every %.1f s",
                self.settings.nodes.heartbeat_s,
                lease_s,
                self.heartbeat_s,
            )
        if (job_id, attempt) in self.pending or (job_id, attempt) in self._held():
            return  # a copy of a hand-out (QoS 1 redelivery): the job runs or ran here already
        job = {k: msg.get(k) for k in ("job_id", "attempt", "kind", "input", "options")}
        if isinstance(msg.get("kept"), list):
            job["kept"] = msg["kept"]
        kind = self.registry.get(str(job["kind"]))
        if job["input"] and kind is not None and kind.needs_input:  # else the input is only a label
            job["input"] = to_local(str(job["input"]), self.entries)
            why = readable_input(job["input"], self.roots)
            if why is not None:
                log.warning("job %s: %s; given back to the hub", job_id, why)
                self._finish(
                    job_id, attempt, {"op": "unstarted", "code": str(ErrorCode.INPUT_UNREACHABLE), "message": why}
                )
                return
        model = (job["options"] or {}).get("model") if isinstance(job["options"], dict) else None
        if job["kind"] == "transcribe" and model and model not in self.settings.transcribe.models:
            why = f"this node has no model {model!r} in transcribe.models"
            log.warning("job %s: %s; given back to the hub", job_id, why)
            self._finish(job_id, attempt, {"op": "unstarted", "exclude": True, "message": why})
            return
        if job["kind"] not in self.kinds:
            self._finish(job_id, attempt, {"op": "unstarted", "message": f"this node does not run {job['kind']}"})
            return
        if kind is not None and (why := options_problem(kind, job["options"], self.settings)) is not None:
            # this node's version of the kind cannot run the job as asked: another place may
            why = f"this node's {job['kind']} cannot run the job as asked: {why}"
            log.warning("job %s: %s; given back to the hub", job_id, why)
            self._finish(job_id, attempt, {"op": "unstarted", "exclude": True, "message": why})
            return
        idle = self.supervisor.idle()
        if not idle:
            self._finish(job_id, attempt, {"op": "unstarted", "message": "no free worker slot on this node"})
            return
        output_dir = str(self.settings.outputs_dir / job_id)
        self.supervisor.assign(idle[0], job, output_dir, msg.get("timeout_s"))
        self.supervisor.dispatch()
        log.info("job %s started: %s %s (attempt %d)", job_id, job["kind"], job["input"] or "(no input)", attempt)
        self.beat()

    def _outcome(self, o: Outcome) -> None:
        if o.op == "progress":
            now = self.clock()
            if now - self.progress_at.get(o.job_id, 0.0) >= PROGRESS_EVERY_S:
                self.progress_at[o.job_id] = now
                self._send({"op": "progress", "job_id": o.job_id, "attempt": o.attempt, **o.data}, qos=0)
            return
        if o.op == "started":
            return
        if o.op == "outputs":  # a node keeps no record of its files: they are moved at once
            o.data["recorded"] = True
            self.supervisor.dispatch()
            return
        if o.op == "chunk":  # kept by the hub for the job's next attempt; a lost one is decoded again
            self._send({"op": "chunk", "job_id": o.job_id, "attempt": o.attempt, **o.data})
            return
        self.progress_at.pop(o.job_id, None)
        data = dict(o.data)
        if o.op == "done":
            data["result"] = map_result(data.get("result"), self.entries)
        log.info("job %s %s (attempt %d)", o.job_id, o.op, o.attempt)
        self._finish(o.job_id, o.attempt, {"op": o.op, **data})
        self.next_beat = 0.0  # a slot is free: say so now

    def _finish(self, job_id: str, attempt: int, msg: dict[str, Any]) -> None:
        msg = {**msg, "job_id": job_id, "attempt": attempt}
        self.pending[(job_id, attempt)] = msg
        self._send(msg)

    def shutdown(self) -> None:
        """Graceful stop: running jobs get ``cancel_grace_s`` to finish, the rest are given
        back (``unstarted``: not their fault, their attempt not counted); outcomes are sent
        until answered (at most 10 s); then ``offline``."""
        end = self.clock() + self.settings.cancel_grace_s
        while self.supervisor.running_job_ids() and self.clock() < end:
            self.step(0.5)
        interrupted = [(e.msg["job_id"], e.msg["attempt"]) for s in self.supervisor.slots for e in s.jobs]
        self.supervisor.stop()
        for job_id, attempt in interrupted:
            self._finish(job_id, attempt, {"op": "unstarted", "message": "the node stopped"})
        end = self.clock() + 10
        while self.pending and self.connected and self.clock() < end:
            self.step(0.5)
        client = self.client
        if client is not None:
            if self.connected:
                client.publish(self.topics.node(self.node_id), self.announcement("offline"), 1, True).wait_for_publish(
                    5
                )
            client.disconnect()
            client.loop_stop()
        log.info("worker node %s stopped", self.node_id)


def options_problem(kind: Any, options: Any, settings: Settings) -> str | None:
    """Why ``options`` are not ones this node's ``kind`` takes (its ``Options`` model and
    ``check_options``), or None."""
    try:
        kind.check_options(kind.Options.model_validate(options or {}), settings)
    except (ValidationError, EdgeQueueError) as e:
        return clip(str(e).splitlines()[0] if isinstance(e, EdgeQueueError) else _first_error(e), 300)
    return None


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    return f"options.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"


def run_node(settings: Settings) -> int:
    """Run a worker node until SIGTERM/SIGINT; the exit code for the process."""
    return WorkerNode(settings).run()
