"""Scheduling: which due jobs go to which worker, within each kind's ``max_concurrency``, in
priority order (docs/configuration.md, "[kinds.<name>]"; docs/topics.md, "`submit`").

First one job to each idle worker; then short jobs to workers that hold only short jobs, up
to :meth:`Prefetch.per_worker` each (see :class:`~edge_queue.workers.prefetch.Prefetch`). Lock
keys and ``run_at`` are the store's claim rules (``Store.claim``): a job whose lock is held,
or whose time has not come, is not claimable.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from edge_queue.component import Component
from edge_queue.config.settings import Settings
from edge_queue.logfmt import clip
from edge_queue.nodes.hub import HUB, NODE_OWNER, Nodes
from edge_queue.store import Store
from edge_queue.workers.supervisor import Supervisor, WorkerSlot

log = logging.getLogger(__name__)


def allowed_kinds(
    concurrency: Mapping[str, int | None],
    busy: Mapping[str, int],
    fast: Callable[[str], bool],
    *,
    fast_only: bool,
) -> list[str]:
    """The kinds that may start one more job: those under their ``max_concurrency`` (``None``:
    no limit) given ``busy`` (kind -> jobs handed out), and with ``fast_only`` only the short
    kinds (``fast(kind)``), which may wait in a worker's queue behind its current job."""
    return [k for k, lim in concurrency.items() if (lim is None or busy.get(k, 0) < lim) and (not fast_only or fast(k))]


#: The kinds the short lane runs (docs/configuration.md, ``short_lane_s``).
LANE_KINDS = ("transcribe",)


def lane_kinds(kinds: Iterable[str], idle_workers: int) -> list[str]:
    """The kinds the short lane may claim a job of now: those of :data:`LANE_KINDS` among
    ``kinds``, and only while no other worker is idle (``idle_workers``: a job that one of them
    can take goes there). Outside each kind's ``max_concurrency``: the lane exists so that a
    short transcription does not wait for a long one that holds the kind's only place."""
    if idle_workers:
        return []
    return [k for k in kinds if k in LANE_KINDS]


def preferred(
    kinds: Iterable[str], place: str, prefer: Mapping[str, list[str]], free: Mapping[str, Collection[str]]
) -> list[str]:
    """The kinds of ``kinds`` that ``place`` (a node id, or :data:`~edge_queue.nodes.hub.HUB`) may
    take now: a kind whose ``prefer`` list ranks above ``place`` another place with a free slot
    that runs the kind (``free``: place -> the kinds it runs) waits for that place. Places not
    in a kind's list rank after those in it, equal among themselves (docs/nodes.md,
    "Scheduling")."""

    def rank(order: list[str], p: str) -> int:
        return order.index(p) if p in order else len(order)

    out = []
    for kind in kinds:
        order = prefer.get(kind) or []
        mine = rank(order, place)
        if not any(rank(order, other) < mine and kind in runs for other, runs in free.items() if other != place):
            out.append(kind)
    return out


def with_kept_chunks(store: Store, job: dict[str, Any]) -> dict[str, Any]:
    """``job`` with ``kept``, the chunks its earlier attempts finished, when it has any (a
    transcription that resumes: docs/topics.md, "Long jobs resume"), and ``written``, the files
    they wrote (docs/topics.md, "Where outputs go")."""
    kept = store.kept_chunks(job["job_id"])  # (no statement for a job without kept chunks)
    job = {**job, "kept": kept} if kept else job
    options = job.get("options")
    if isinstance(options, dict) and options.get("output") == "beside":  # (data_dir: always replaced)
        # the files earlier attempts wrote (before a retry too): the job's own, replaced by this one
        written = store.output_files(job["job_id"])
        job = {**job, "written": written} if written else job
    return job


class Scheduler(Component):
    """Hands due jobs to the local worker pool.

    Args:
        settings: ``max_concurrency`` and ``timeout_s`` of each kind, ``outputs_dir``.
        kinds: the kind names.
        store: returns the open store (claims are its SQL).
        supervisor: the worker pool.
        owner: the run id the claims are made for (orphans are the jobs of other runs).
        on_assign: called with each job handed out (the service publishes it).
        nodes: the worker nodes (docs/nodes.md); their free slots are filled after the local ones.
        may_start: False while no job may start (paused, stopping, the broker's messages held
            or backlogged, the disk short of its minimum): the turn schedules nothing then.
    """

    def __init__(
        self,
        settings: Settings,
        kinds: Iterable[str],
        store: Callable[[], Store],
        supervisor: Supervisor,
        owner: str,
        on_assign: Callable[[dict[str, Any]], None],
        nodes: Nodes,
        may_start: Callable[[], bool] = lambda: True,
    ) -> None:
        self.may_start = may_start
        self.concurrency = {k: settings.kind(k).max_concurrency for k in kinds}
        self.prefer = {k: settings.kind(k).prefer for k in self.concurrency if settings.kind(k).prefer}
        self.nodes = nodes
        self.timeouts = {k: settings.kind(k).timeout_s for k in self.concurrency}
        self.outputs = str(settings.outputs_dir)
        self.store, self.supervisor, self.owner, self.on_assign = store, supervisor, owner, on_assign

    def wait_s(self, now: float) -> float | None:
        """Seconds until the next job waiting for its ``run_at`` (a retry's backoff) is due."""
        due = self.store().next_due(after=now)
        return None if due is None else due - now

    def turn(self, now: float) -> None:
        """Schedule (:meth:`schedule`) when jobs may start."""
        if self.may_start():
            self.schedule(now)

    def schedule(self, now: float) -> None:
        """Give jobs due at ``now`` (Unix seconds) to workers."""
        store, sup, owner = self.store(), self.supervisor, self.owner
        if not store.waiting():
            return
        # max_concurrency caps the hub's own workers: a node adds capacity of its own (its slots)
        busy = sup.busy_by_kind()
        free = self.nodes.free()
        places: dict[str, Collection[str]] = {n: self.nodes.kinds(n) for n in free}
        if sup.idle():
            places[HUB] = self.concurrency.keys()
        self.to_nodes(now, free, places)
        if not store.waiting():
            return
        for slot in sup.idle():
            kinds = allowed_kinds(self.concurrency, busy, sup.prefetch.fast, fast_only=False)
            job = store.claim(now, preferred(kinds, HUB, self.prefer, places), owner)
            if job is None:
                break
            self.assign(slot, job)
            busy[job["kind"]] += 1
            if not store.waiting():
                return  # nothing left to claim: no query for the other workers (P2's idle case)
        for slot in sup.lane_idle():  # every worker is busy: a short transcription goes here
            kinds = lane_kinds(self.concurrency, len(sup.idle()))
            job = store.claim(now, kinds, owner, exclude=list(sup.lane.long_jobs)) if kinds else None
            if job is not None:
                self.assign(slot, job)
                busy[job["kind"]] += 1
            if not store.waiting():
                return
        unlimited = [k for k, lim in self.concurrency.items() if lim is None]
        for slot in sup.prefetch.prefetching(sup.slots):
            if not store.waiting():
                return
            # kinds without a concurrency limit: up to the worker's room at once
            fast = preferred(
                allowed_kinds(self.concurrency, busy, sup.prefetch.fast, fast_only=True), HUB, self.prefer, places
            )
            jobs = store.claim_many(
                now, [k for k in fast if k in unlimited], owner, sup.prefetch.room(slot), started=False
            )
            for job in jobs:
                self.assign(slot, job)
            while sup.prefetch.room(slot) > 0 and (
                kinds := preferred(
                    allowed_kinds(self.concurrency, busy, sup.prefetch.fast, fast_only=True), HUB, self.prefer, places
                )
            ):
                claimed = store.claim_many(now, kinds, owner, 1, started=False)
                if not claimed:
                    break
                job = claimed[0]
                self.assign(slot, job)
                busy[job["kind"]] += 1

    def to_nodes(self, now: float, free: dict[str, int], places: dict[str, Collection[str]]) -> None:
        """Fill the worker nodes' free slots, one claim per slot, of the kinds each node runs
        (``max_concurrency`` does not apply: it caps the hub's own workers, and a node's slots
        are its own limit); the nodes a ``prefer`` list ranks first claim first. A node done
        claiming leaves ``places``: what it did not take may go to the places ranked after it."""

        def best_rank(node_id: str) -> int:
            return min((order.index(node_id) for order in self.prefer.values() if node_id in order), default=99)

        store = self.store()
        for node_id in sorted(free, key=best_rank):
            skip = self.nodes.excluded_for(node_id)
            for _ in range(free[node_id]):
                if not store.waiting():
                    return
                kinds = preferred([k for k in self.concurrency if k in places[node_id]], node_id, self.prefer, places)
                job = store.claim(now, kinds, NODE_OWNER + node_id, exclude=skip) if kinds else None
                if job is None:
                    break
                job = with_kept_chunks(store, job)
                self.nodes.assign(node_id, job, job["timeout_s"] or self.timeouts[job["kind"]])
                log.info(
                    "job %s handed to node %s: %s (attempt %d)", job["job_id"], node_id, job["kind"], job["attempt"]
                )
                self.on_assign(job)
            del places[node_id]

    def assign(self, slot: WorkerSlot, job: dict[str, Any]) -> None:
        """Give a claimed job to ``slot``'s worker (sent after the turn's commit)."""
        timeout = job["timeout_s"] or self.timeouts[job["kind"]]
        job = with_kept_chunks(self.store(), job)
        self.supervisor.assign(slot, job, f"{self.outputs}/{job['job_id']}", timeout)
        if log.isEnabledFor(logging.INFO):
            log.info(
                "job %s started: %s %s (attempt %d)",
                job["job_id"],
                job["kind"],
                clip(job["input"] or "(no input)"),
                job["attempt"],
            )
        self.on_assign(job)
