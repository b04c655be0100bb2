"""The hub's side of worker nodes (docs/nodes.md): which nodes are online, the leases of the
jobs handed to them, and what they report, turned into the same :class:`Outcome` records the
local worker pool gives.

A job handed to a node is ``running`` in the store with ``owner`` ``node:<node_id>``; the hub
keeps its **lease** here: the node renews it with each heartbeat, and a lease not renewed for
``nodes.lease_s`` (the node lost power or its network), or a node whose Last Will says
``offline``, loses the job: ``lost`` (``worker_lost``, counted like a local worker's death)
once the node confirmed it holds the job, ``unstarted`` (its attempt not counted) before.
The **attempt number is the fencing token**: a report is applied only for the lease the hub
holds now, on the same node and attempt; a report of an earlier lease is refused and logged.
Leases do not run out while the hub itself is away from the broker: they start again at each
(re)connect and at boot (:meth:`Nodes.adopt`).

Delivery: a node sends each outcome again until the hub's ``ok`` for it, and the hub sends
that ``ok`` only after the turn that applied the outcome committed (the bridge holds it), so
nothing a node sends is lost; a copy of an outcome already applied finds no lease and is only
answered ``ok`` again.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from edge_queue.component import Component
from edge_queue.config.settings import Settings
from edge_queue.errors import ErrorCode
from edge_queue.logfmt import clip
from edge_queue.mqtt.bridge import Bridge
from edge_queue.mqtt.topics import Topics
from edge_queue.rules.rates import RejectionLog
from edge_queue.workers.supervisor import Outcome

from .announcements import Node, announced
from .hub_inbox import NodeInbox
from .hub_rules import ACKS_PER_NODE, capped, summary_of
from .reports import report_outcome

log = logging.getLogger(__name__)

#: The owner column of a job running on a node: this prefix and the node id.
NODE_OWNER = "node:"
#: The name of the hub's own workers in ``[kinds.<name>] prefer`` and in a job's ``node``.
HUB = "hub"
#: (job, attempt, node) of outcomes applied lately: a copy of one is answered ``ok`` quietly.
RECENT_MAX = 10_000
#: Jobs remembered with the nodes that could not read their input.
EXCLUDED_MAX = 10_000
#: Seconds the jobs of a node whose Last Will said ``offline`` stay its own: a broker that
#: restarts sends every client's Will, and its nodes are back within seconds with their jobs.
OFFLINE_GRACE_S = 3.0
#: What a node sends on its ``up`` topic: the operations the hub acts on.
#: The kept chunks a ``run`` message carries, as JSON: half of mosquitto's shipped
#: ``max_packet_size`` (16 MiB). A hand-out over it was refused by the broker, which closed the
#: hub's connection at every try and took the hub offline.
KEPT_BUDGET_BYTES = 8 * 1024 * 1024


def kept_within(kept: list[dict[str, Any]], budget: int) -> list[dict[str, Any]]:
    """The first of ``kept`` (a job's kept chunks in index order) whose JSON adds up to at
    most ``budget`` bytes: a new attempt resumes after them and decodes the rest again."""
    out, used = [], 0
    for item in kept:
        used += len(json.dumps(item, separators=(",", ":")))
        if used > budget:
            break
        out.append(item)
    return out


UP_OPS = frozenset({"beat", "progress", "chunk", "done", "failed", "lost", "unstarted"})


@dataclass(slots=True)
class Lease:
    """A job handed to a node: ``expires`` in monotonic seconds; ``confirmed`` once the node
    said it holds the job (a heartbeat, progress or an outcome)."""

    job_id: str
    attempt: int
    node_id: str
    kind: str
    expires: float
    confirmed: bool = False
    new: bool = field(default=True)  # handed out in this turn, not committed yet
    why: str | None = None  # why it runs out early (its node went offline)
    #: the attempt's end by its ``timeout_s``, on the hub's monotonic clock (None: no timeout)
    ends: float | None = None
    #: when the hub asked the node to stop it (a cancel, or the timeout), and why
    stop_asked: float | None = None
    stop_code: str = ErrorCode.TIMEOUT


def overdue(lease: Lease, now: float, grace_s: float) -> str | None:
    """What the hub does about ``lease`` at ``now`` (monotonic seconds), by its own clock
    (docs/nodes.md, "Leases"): ``"ask"`` the node to stop it (its ``timeout_s`` passed), ``"end"``
    it (the node did not stop within ``cancel_grace_s`` of being asked), or None."""
    if lease.stop_asked is not None:
        return "end" if now - lease.stop_asked >= grace_s else None
    return "ask" if lease.ends is not None and now >= lease.ends else None


def node_of(owner: str | None) -> str | None:
    """The node a job's ``owner`` names (``node:<id>``), or None for the hub's own workers."""
    return owner[len(NODE_OWNER) :] if owner and owner.startswith(NODE_OWNER) else None


class Nodes(Component):
    """Worker nodes and their leases, for the service's loop (one thread; no locking).

    Args:
        settings: ``access.nodes`` (who may be a node), ``nodes.lease_s``.
        topics: the installation's topics.
        bridge: the hub's broker connection: it hands us the messages on node topics, and holds
            what we publish until the turn's commit.
        clock: monotonic seconds; injectable for tests.
    """

    def __init__(
        self,
        settings: Settings,
        topics: Topics,
        bridge: Bridge,
        clock: Callable[[], float] = time.monotonic,
        kinds: Mapping[str, Any] | None = None,
    ) -> None:
        self.on_change: Callable[[], None] = lambda: None  # a node came, went or changed
        self.kind_classes = kinds or {}  # name -> kind class: the result shapes (Kind.Result)
        self.publish = bridge.publish
        self.lease_s, self.grace_s, self.max_slots = (
            settings.nodes.lease_s,
            settings.cancel_grace_s,
            settings.nodes.max_slots,
        )
        self.local_workers = settings.workers
        self.topics, self.clock = topics, clock
        self.nodes: dict[str, Node] = {}
        self.leases: dict[str, Lease] = {}
        self.acks: list[tuple[str, dict[str, Any]]] = []
        self.recent: OrderedDict[tuple[str, int, str], None] = OrderedDict()
        self.excluded: OrderedDict[str, set[str]] = OrderedDict()
        self.refused = RejectionLog("node message(s) refused", logging.WARNING, log)
        self.inbox = NodeInbox(settings.access.nodes, topics, self.refused)  # what nodes sent, for the next turn
        bridge.on_node = self.inbox.on_message
        self.heard, self.silent = dict[str, float](), set[str]()  # when each was last heard; not for lease_s
        self.changed = False  # a node came or went: <base>/info and <base>/queue are due

    # -- from the broker ----------------------------------------------------------------

    def poll(self, connected: bool) -> list[Outcome]:
        """The outcomes of what nodes sent since the last call, then of leases that ran out
        (none while the hub is not ``connected`` to the broker: then they start again)."""
        out: list[Outcome] = []
        now = self.clock()
        for node_id, level, payload in self.inbox.take():  # the rest waits for the next turn
            self.heard[node_id] = now
            try:
                msg = json.loads(payload) if payload else None
            except (ValueError, RecursionError):  # RecursionError: nested too deep to read
                self.refused.warning("node %s sent a message that is not JSON", node_id)
                continue
            if level == "":
                self._announced(node_id, msg)
            elif isinstance(msg, dict) and msg.get("op") in UP_OPS:
                self._up(node_id, msg, out)
            else:
                self.refused.warning("node %s sent a message with no known op", node_id)
        # what the hub shows of a node follows what it hears of it (a bridge's outage)
        silent = {n for n, at in self.heard.items() if now - at > self.lease_s} if connected else self.silent
        self.changed, self.silent = self.changed or silent != self.silent, silent
        if not connected:
            self.renew_all(now)
        for lease in list(self.leases.values()):  # timeouts and cancels, on the hub's clock
            if (todo := overdue(lease, now, self.grace_s)) == "ask":
                lease.stop_asked = now
                self._send(lease.node_id, {"op": "cancel", "job_id": lease.job_id, "attempt": lease.attempt})
            elif todo == "end":
                why = "its timeout_s passed" if lease.stop_code == ErrorCode.TIMEOUT else "it was cancelled"
                lease.why = f"node {lease.node_id} did not stop the job within cancel_grace_s after {why}"
                self._lose(lease, lease.why, out, code=lease.stop_code)
        for lease in [lease for lease in self.leases.values() if lease.expires <= now]:
            if (node := self.nodes.get(lease.node_id)) is not None:
                node.hold = True  # silent: nothing more for it until it is heard from again
            self._lose(
                lease, lease.why or f"node {lease.node_id} did not renew its lease for {self.lease_s:.0f} s", out
            )
        return out

    def _announced(self, node_id: str, msg: Any) -> None:
        if not isinstance(msg, dict):  # the announcement was cleared: the node was removed
            self.changed = self.nodes.pop(node_id, None) is not None or self.changed
            self._offline(node_id, "its announcement was cleared")
            return
        node = announced(node_id, msg, self.max_slots, self.refused)
        online, was = node.online, self.nodes.get(node_id)
        if was is not None:
            node.strays, node.hold = was.strays, was.hold
        self.nodes[node_id] = node
        self.changed = True
        if online and (was is None or not was.online):
            log.info("node %s online: %d slot(s), kinds %s", node_id, node.slots, ", ".join(sorted(node.kinds)))
        if not online and (was is None or was.online):  # once per outage, however often it is said
            self._offline(node_id, "its Last Will or its stop says offline")

    def _offline(self, node_id: str, why: str) -> None:
        held = [lease for lease in self.leases.values() if lease.node_id == node_id]
        self.refused.warning(  # a node's doing: through the rate limit
            "node %s is offline (%s): its %d job(s) go back to the queue unless it is back within %.0f s",
            node_id,
            why,
            len(held),
            OFFLINE_GRACE_S,
        )
        expires = self.clock() + OFFLINE_GRACE_S
        for lease in held:
            lease.expires, lease.why = min(lease.expires, expires), f"node {node_id} went offline ({why})"

    def _up(self, node_id: str, msg: dict[str, Any], out: list[Outcome]) -> None:
        op = msg["op"]
        now = self.clock()
        node = self.nodes.get(node_id)
        if op == "beat":
            held = msg.get("jobs")
            if not isinstance(held, list):
                self.refused.warning("node %s sent a heartbeat without a list of jobs", node_id)
            elif len(held) > self.max_slots:  # a node holds at most its slots: the rest is not read
                self.refused.warning(
                    "node %s listed %d jobs in a heartbeat: %d read", node_id, len(held), self.max_slots
                )
                held = held[: self.max_slots]
            strays: set[tuple[str, int]] = set()
            for item in held if isinstance(held, list) else []:
                if not (isinstance(item, list) and len(item) == 2):
                    continue
                job_id, attempt = item
                lease = self.leases.get(job_id) if isinstance(job_id, str) else None
                if lease is not None and lease.node_id == node_id and lease.attempt == attempt:
                    lease.expires, lease.confirmed, lease.why = now + self.lease_s, True, None
                elif isinstance(job_id, str) and isinstance(attempt, int):
                    # the node runs a job it no longer holds (it came back after the job was handed on)
                    strays.add((job_id, attempt))
                    self._send(node_id, {"op": "cancel", "job_id": job_id, "attempt": attempt})
            if node is not None:
                node.strays, node.hold = strays, False
            return
        job_id, attempt = msg.get("job_id"), msg.get("attempt")
        if not isinstance(job_id, str) or not isinstance(attempt, int):
            self.refused.warning("node %s sent %s without a job id and attempt", node_id, op)
            return
        lease = self.leases.get(job_id)
        if lease is None or lease.node_id != node_id or lease.attempt != attempt:
            if op in ("progress", "chunk"):
                return
            if node is not None:
                node.strays.discard((job_id, attempt))
                node.hold = node.hold or op == "unstarted"
            if (job_id, attempt, node_id) not in self.recent:
                self._remember(job_id, attempt, node_id)
                self.refused.warning(  # outside input: through the rate limit
                    "node %s: %s of job %s attempt %d refused: its lease is not held (now %s)",
                    node_id,
                    op,
                    clip(job_id),
                    attempt,
                    f"attempt {lease.attempt} on node {lease.node_id}" if lease else "not handed to a node",
                )
            self.acks.append((node_id, {"op": "ok", "job_id": job_id, "attempt": attempt}))
            return
        lease.expires, lease.confirmed, lease.why = now + self.lease_s, True, None
        if op not in ("progress", "chunk"):  # the attempt's end: its lease is done, answered ``ok``
            del self.leases[job_id]
            self._remember(job_id, attempt, node_id)
            self.acks.append((node_id, {"op": "ok", "job_id": job_id, "attempt": attempt}))
        if op == "unstarted":
            if msg.get("code") == ErrorCode.INPUT_UNREACHABLE or msg.get("exclude") is True:
                self._exclude(job_id, node_id)
            elif node is not None:  # it had no room: no more until its next heartbeat says it has
                node.hold = True
        outcome = report_outcome(node_id, msg, lease.kind, self.kind_classes.get(lease.kind), self.refused)
        if outcome is not None:
            out.append(outcome)

    def _lose(self, lease: Lease, why: str, out: list[Outcome], code: str = ErrorCode.WORKER_LOST) -> None:
        del self.leases[lease.job_id]
        if lease.confirmed or code != ErrorCode.WORKER_LOST:
            log.warning("job %s lost on node %s (attempt %d): %s", lease.job_id, lease.node_id, lease.attempt, why)
            data = {"code": str(code), "message": f'{why} (docs/nodes.md, "Leases")'}
            out.append(Outcome("lost", lease.job_id, lease.attempt, data))
        else:
            log.warning(
                "job %s never started on node %s: %s; it goes back to the queue", lease.job_id, lease.node_id, why
            )
            out.append(Outcome("unstarted", lease.job_id, lease.attempt, {"reason": why}))

    def _remember(self, job_id: str, attempt: int, node_id: str) -> None:
        self.recent[(job_id, attempt, node_id)] = None
        while len(self.recent) > RECENT_MAX:
            self.recent.popitem(last=False)

    def _exclude(self, job_id: str, node_id: str) -> None:
        nodes = self.excluded.setdefault(job_id, set())
        nodes.add(node_id)
        online = {n.node_id for n in self.nodes.values() if n.online}
        if not self.local_workers and online <= nodes:
            log.warning(
                "job %s: no online node can run it (%s) and this hub has no workers: it waits in the queue "
                'until a node that can is online (docs/nodes.md, "Files")',
                job_id,
                ", ".join(sorted(nodes)),
            )
        self.excluded.move_to_end(job_id)
        while len(self.excluded) > EXCLUDED_MAX:
            self.excluded.popitem(last=False)

    # -- the loop's turn ----------------------------------------------------------------

    def turn(self, now: float) -> None:
        """The turn's ``ok`` answers (:meth:`end_turn`); ``on_change`` once a node came, went
        or changed."""
        if self.end_turn():
            self.on_change()

    def end_turn(self) -> bool:
        """Publish the turn's ``ok`` answers (:meth:`send_acks`); True once after a node came,
        went or changed (``<base>/info`` and ``<base>/queue`` are due)."""
        self.send_acks()
        changed, self.changed = self.changed, False
        return changed

    def wait_s(self, now: float) -> float | None:
        """Seconds until the first lease runs out or timeout or cancel is due (0 while messages
        wait to be read), or None."""
        if self.inbox:
            return 0.0
        if not self.leases:
            return None
        due = [lease.expires for lease in self.leases.values()]
        due += [lease.ends for lease in self.leases.values() if lease.ends is not None and lease.stop_asked is None]
        due += [lease.stop_asked + self.grace_s for lease in self.leases.values() if lease.stop_asked is not None]
        return max(0.0, min(due) - self.clock())

    def send_acks(self) -> None:
        """Publish the turn's ``ok`` answers after its commit, :data:`ACKS_PER_NODE` a node at most."""
        for node_id, msg in capped(self.acks, ACKS_PER_NODE):
            self._send(node_id, msg)
        self.acks.clear()

    def committed(self) -> None:
        """The turn's hand-outs are committed: their leases stand."""
        for lease in self.leases.values():
            lease.new = False

    def turn_failed(self, *, disk_full: bool = False) -> None:
        """The turn's commit failed: its hand-outs were rolled back (their messages dropped)."""
        for job_id in [j for j, lease in self.leases.items() if lease.new]:
            del self.leases[job_id]
        self.acks.clear()

    def renew_all(self, now: float) -> None:
        """Every lease starts again at ``now`` (a (re)connect: nodes could not reach us)."""
        for lease in self.leases.values():
            lease.expires = max(lease.expires, now + self.lease_s)

    def adopt(self, jobs: Iterable[dict[str, Any]]) -> None:
        """At boot: the jobs a node held when the hub stopped keep their lease, from now."""
        now = self.clock()
        for job in jobs:
            node_id = node_of(job.get("owner"))
            if node_id is not None:
                lease = Lease(job["job_id"], job["attempt"], node_id, job["kind"], now + self.lease_s, True, False)
                self.leases[job["job_id"]] = lease

    # -- scheduling ---------------------------------------------------------------------

    def free(self) -> dict[str, int]:
        """node id -> free slots, for online nodes in ``access.nodes`` with any."""
        held = Counter(lease.node_id for lease in self.leases.values())
        for n in self.nodes.values():
            held[n.node_id] += len(n.strays)
        return {
            n.node_id: n.slots - held[n.node_id]
            for n in self.nodes.values()
            if n.online and not n.hold and n.slots > held[n.node_id]
        }

    def kinds(self, node_id: str) -> frozenset[str]:
        """The kinds ``node_id`` announced it runs."""
        node = self.nodes.get(node_id)
        return node.kinds if node is not None else frozenset()

    def excluded_for(self, node_id: str) -> list[str]:
        """Jobs whose input ``node_id`` could not read: not offered to it again."""
        return [job_id for job_id, nodes in self.excluded.items() if node_id in nodes]

    def busy_by_kind(self) -> Counter[str]:
        return Counter(lease.kind for lease in self.leases.values())

    def assign(self, node_id: str, job: dict[str, Any], timeout_s: float | None) -> None:
        """Hand a claimed job to ``node_id`` (the message leaves after the turn's commit)."""
        now = self.clock()
        ends = now + timeout_s if timeout_s else None
        self.leases[job["job_id"]] = Lease(
            job["job_id"], job["attempt"], node_id, job["kind"], now + self.lease_s, ends=ends
        )
        msg = {k: job[k] for k in ("job_id", "attempt", "kind", "input", "options")}
        msg.update(op="run", timeout_s=timeout_s, lease_s=self.lease_s)
        if job.get("kept"):
            msg["kept"] = kept_within(job["kept"], KEPT_BUDGET_BYTES)
        self._send(node_id, msg)

    def cancel(self, job_id: str) -> bool:
        """Ask the node holding ``job_id`` to stop it. False: no node holds it."""
        lease = self.leases.get(job_id)
        if lease is None:
            return False
        self._send(lease.node_id, {"op": "cancel", "job_id": job_id, "attempt": lease.attempt})
        lease.stop_asked, lease.stop_code = lease.stop_asked or self.clock(), ErrorCode.CANCELLED
        return True

    def _send(self, node_id: str, msg: dict[str, Any]) -> None:
        self.publish(self.topics.node_down(node_id), _encode(msg))

    def running_job_ids(self) -> set[str]:
        return set(self.leases)

    def summary(self) -> list[dict[str, Any]]:
        """The nodes for ``<base>/info`` and ``<base>/queue`` (:func:`summary_of`)."""
        return summary_of(self.nodes.values(), self.leases.values(), self.silent)


def _encode(msg: dict[str, Any]) -> bytes:
    return json.dumps({"v": 1, **msg}, separators=(",", ":")).encode()
