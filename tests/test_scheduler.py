"""Scheduling (edge_queue/jobs/scheduler.py): which due job goes to which worker, per-kind
``max_concurrency``, priority order. A real store on a temporary SQLite file and the real
supervisor's slots, without worker processes (a slot is given a placeholder process): each test
runs in milliseconds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from edge_queue.config import Settings
from edge_queue.jobs.scheduler import Scheduler, allowed_kinds
from edge_queue.mqtt.topics import Topics
from edge_queue.nodes.hub import Nodes
from edge_queue.store import JobSpec, Store
from edge_queue.workers.supervisor import Supervisor

NOW = 1_000_000.0


class Wire:
    """What the node room needs of the bridge: a place for its handler, and publish."""

    def __init__(self) -> None:
        self.on_node: Any = None
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        self.sent.append((topic, json.loads(payload)))


@pytest.mark.parametrize(
    ("busy", "fast_only", "expected"),
    [
        ({}, False, ["transcribe", "probe", "noop"]),
        ({"transcribe": 1}, False, ["probe", "noop"]),  # transcribe: one at a time
        ({"probe": 1}, False, ["transcribe", "probe", "noop"]),  # probe: two at a time, one free
        ({"probe": 2}, False, ["transcribe", "noop"]),
        ({"noop": 500}, False, ["transcribe", "probe", "noop"]),  # no limit
        ({}, True, ["noop"]),  # only short kinds wait in a busy worker's queue
    ],
)
def test_allowed_kinds(busy: dict[str, int], fast_only: bool, expected: list[str]) -> None:
    concurrency = {"transcribe": 1, "probe": 2, "noop": None}
    got = allowed_kinds(concurrency, busy, lambda k: k == "noop", fast_only=fast_only)
    assert got == expected


def pool(tmp_path: Path, workers: int, **kinds: Any) -> tuple[Scheduler, Store, Supervisor, list[dict[str, Any]]]:
    settings = Settings(data_dir=tmp_path, workers=workers, kinds=kinds)
    store = Store(tmp_path / "q.db")
    sup = Supervisor(settings)
    for slot in sup.slots:
        slot.process = object()  # a worker that is up, as far as hand-outs go
    assigned: list[dict[str, Any]] = []
    return (
        Scheduler(
            settings,
            ["noop", "probe", "transcribe"],
            lambda: store,
            sup,
            "run1",
            assigned.append,
            Nodes(settings, Topics("t"), Wire()),  # type: ignore[arg-type]
        ),
        store,
        sup,
        assigned,
    )


def test_one_job_to_each_idle_worker_in_priority_order(tmp_path: Path) -> None:
    scheduler, store, sup, assigned = pool(tmp_path, 2)
    for priority, name in ((0, "low"), (5, "high"), (1, "mid")):
        store.submit([JobSpec("probe", name, {}, priority=priority)], NOW)
    scheduler.schedule(NOW)
    assert [j["input"] for j in assigned] == ["high", "mid"]
    assert [len(s.jobs) for s in sup.slots] == [1, 1]
    assert all(j["state"] == "running" and j["attempt"] == 1 and j["owner"] == "run1" for j in assigned)


def test_max_concurrency_holds_across_workers(tmp_path: Path) -> None:
    # Given four idle workers and three transcriptions, at most one at a time
    scheduler, store, sup, assigned = pool(tmp_path, 4, transcribe={"max_concurrency": 1})
    for i in range(3):
        store.submit([JobSpec("transcribe", f"t{i}", {})], NOW)
    store.submit([JobSpec("probe", "p", {})], NOW + 1)
    scheduler.schedule(NOW + 2)
    # Then one transcription runs, and the probe goes to another worker
    assert sorted(j["input"] for j in assigned) == ["p", "t0"]
    # and a second pass starts no second transcription while the first holds its worker
    scheduler.schedule(NOW + 3)
    assert sorted(j["input"] for j in assigned) == ["p", "t0"]
    assert store.counts()["queued"] == 2


def test_a_job_not_due_yet_waits(tmp_path: Path) -> None:
    scheduler, store, _, assigned = pool(tmp_path, 1)
    store.submit([JobSpec("noop", "later", {}, run_at=NOW + 60)], NOW)
    scheduler.schedule(NOW)
    assert assigned == []
    scheduler.schedule(NOW + 60)
    assert [j["input"] for j in assigned] == ["later"]


def test_no_worker_up_no_hand_out(tmp_path: Path) -> None:
    scheduler, store, sup, assigned = pool(tmp_path, 2)
    for slot in sup.slots:
        slot.process = None  # both workers down (being restarted)
    store.submit([JobSpec("noop", "x", {})], NOW)
    scheduler.schedule(NOW)
    assert assigned == [] and store.counts()["queued"] == 1


def test_max_concurrency_caps_the_hub_and_a_node_adds_its_own(tmp_path: Path) -> None:
    # Given transcribe capped at 1, two idle hub workers and a node with 2 free slots
    # (before: the cap counted node jobs too, so the node could add no transcription)
    settings = Settings(
        data_dir=tmp_path, workers=2, kinds={"transcribe": {"max_concurrency": 1}}, access={"nodes": ["n1"]}
    )
    store = Store(tmp_path / "q.db")
    sup = Supervisor(settings)
    for slot in sup.slots:
        slot.process = object()
    nodes = Nodes(settings, Topics("t"), Wire())  # type: ignore[arg-type]
    announce = {"v": 1, "state": "online", "kinds": ["transcribe"], "slots": 2}
    nodes.on_message("t/nodes/n1", json.dumps(announce).encode(), True)
    nodes.poll(True)
    assert nodes.free() == {"n1": 2}
    assigned: list[dict[str, Any]] = []
    scheduler = Scheduler(settings, ["noop", "probe", "transcribe"], lambda: store, sup, "run1", assigned.append, nodes)
    for i in range(5):
        store.submit([JobSpec("transcribe", f"t{i}", {})], NOW)
    scheduler.schedule(NOW + 1)
    # Then the node takes 2 and the hub 1: three at once, one on the hub
    owners = sorted(j["owner"] for j in assigned)
    assert len(owners) == 3 and sum(o == "run1" for o in owners) == 1, owners
    assert sum(len(s.jobs) for s in sup.slots) == 1
    assert store.counts()["queued"] == 2
