"""Scheduling (edge_queue/jobs/scheduler.py): which due job goes to which worker, per-kind
``max_concurrency``, priority order. A real store on a temporary SQLite file and the real
supervisor's slots, without worker processes (a slot is given a placeholder process): each test
runs in milliseconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from multiprocessing import Pipe
from pathlib import Path
from typing import Any

import pytest

from edge_queue.config.settings import Settings
from edge_queue.jobs.scheduler import Scheduler, allowed_kinds, lane_kinds
from edge_queue.mqtt.topics import Topics
from edge_queue.nodes.hub import Nodes
from edge_queue.rules.states import JobState
from edge_queue.store import JobSpec, Store
from edge_queue.workers.lane import PAUSE_S, ShortLane, holding_locks, to_pause, warm
from edge_queue.workers.processes import JobEntry, WorkerSlot
from edge_queue.workers.supervisor import Outcome, Supervisor
from edge_queue.workers.worker import fits_lane

from .helpers.wire import Wire

NOW = 1_000_000.0


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


def pool(
    tmp_path: Path, workers: int, lane: bool = False, **kinds: Any
) -> tuple[Scheduler, Store, Supervisor, list[dict[str, Any]]]:
    settings = Settings(data_dir=tmp_path, workers=workers, kinds=kinds)
    store = Store(tmp_path / "q.db")
    sup = Supervisor(settings, lane=lane)
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
    nodes.inbox.on_message("t/nodes/n1", json.dumps(announce).encode(), True)
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


def test_the_short_lane_s_rules() -> None:
    assert lane_kinds(["noop", "probe", "transcribe"], idle_workers=0) == ["transcribe"]
    assert lane_kinds(["noop", "transcribe"], idle_workers=1) == []  # an idle worker takes it
    assert lane_kinds(["noop"], idle_workers=0) == []
    assert fits_lane(11.0, 120.0) and fits_lane(120.0, 120.0)
    assert not fits_lane(120.5, 120.0) and not fits_lane(None, 120.0)  # unknown: not short


def test_a_transcription_waiting_behind_a_film_goes_to_the_short_lane(tmp_path: Path) -> None:
    # Given one worker (transcribe one at a time) running a film, and the short lane
    scheduler, store, sup, assigned = pool(tmp_path, 1, lane=True, transcribe={"max_concurrency": 1})
    assert [s.lane for s in sup.slots] == [False, True]
    store.submit([JobSpec("transcribe", "film", {})], NOW)
    scheduler.schedule(NOW)
    assert [j["input"] for j in assigned] == ["film"] and sup.slots[0].jobs
    # When a clip and a second film are submitted
    store.submit([JobSpec("transcribe", "film2", {})], NOW + 1)
    store.submit([JobSpec("transcribe", "clip", {})], NOW + 2)
    scheduler.schedule(NOW + 3)
    # Then the lane takes the first waiting one (film2) with a bound on its input's length...
    lane = sup.slots[1]
    assert lane.job is not None and lane.job["input"] == "film2" and lane.job["within_s"] == 120.0
    # ...which its worker gives back as too long: passed over by the lane from now on
    film2 = lane.job
    sup._handle(lane, {"op": "unstarted", "job_id": film2["job_id"], "attempt": 1, "reason": "long"}, out := [])
    assert out == [Outcome("unstarted", film2["job_id"], 1, {"reason": "long"})] and not lane.jobs
    store.transition(film2["job_id"], JobState.QUEUED, NOW + 4, attempt=0, owner=None, started_at=None)
    scheduler.schedule(NOW + 5)
    assert lane.job is not None and lane.job["input"] == "clip"
    assert sup.slots[0].job is not None and sup.slots[0].job["input"] == "film"
    # and the worker's own jobs carry no bound
    assert "within_s" not in sup.slots[0].job


def test_the_short_lane_stops_a_film_s_worker_only_while_its_job_runs(tmp_path: Path) -> None:
    # Given a worker running a film (a real process stands for it) and the lane running a clip
    film = subprocess.Popen(["sleep", "60"])
    try:
        worker, lane = WorkerSlot(0), WorkerSlot(1, lane=True)
        worker.process, worker.pid, lane.process = object(), film.pid, object()
        worker.jobs.append(JobEntry({"job_id": "film"}, None))
        worker.jobs[0].started = 0.0
        assert to_pause([worker, lane], 0.5, 1.0) == []  # a job of half a second is left alone
        lane.jobs.append(JobEntry({"job_id": "clip"}, None))
        short = ShortLane()
        short.turn([worker, lane], 2.0, 1.0)
        assert _stopped(film.pid, True) and short.next_time() == 2.0 + PAUSE_S
        # When the clip ends, the film's worker is continued, and not stopped for as long again
        lane.jobs.clear()
        short.turn([worker, lane], 5.0, 1.0)
        assert _stopped(film.pid, False) and short.next_time() is None
        lane.jobs.append(JobEntry({"job_id": "clip2"}, None))
        short.turn([worker, lane], 6.0, 1.0)
        assert _stopped(film.pid, False)  # quiet until 8.0
        short.turn([worker, lane], 8.0, 1.0)
        assert _stopped(film.pid, True)
        # and never longer than PAUSE_S for one job
        short.turn([worker, lane], 8.0 + PAUSE_S, 1.0)
        assert _stopped(film.pid, False)
    finally:
        os.kill(film.pid, signal.SIGCONT)
        film.kill()
        film.wait()


def test_the_short_lane_never_stops_a_worker_holding_the_models_lock(tmp_path: Path) -> None:
    """A film's worker that makes a model's int8 copy holds ``<data_dir>/models/.int8.lock``;
    stopped then, the lane's own job, needing a model of that folder, would wait for the lock
    until the film's worker is continued (PAUSE_S later): the first voice command of a new
    install waited 30-36 s so."""
    # Given a film's worker (a real process) holding the models folder's lock as int8_models does
    lock = tmp_path / ".int8.lock"
    film = subprocess.Popen(
        ["python3", "-c", f"import fcntl,time; f=open({str(lock)!r},'w'); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert film.stdout is not None and film.stdout.readline() == "held\n"
        assert film.pid in holding_locks()
        worker, lane = WorkerSlot(0), WorkerSlot(1, lane=True)
        worker.process, worker.pid, lane.process = object(), film.pid, object()
        worker.jobs.append(JobEntry({"job_id": "film"}, None))
        worker.jobs[0].started = 0.0
        lane.jobs.append(JobEntry({"job_id": "clip"}, None))
        # When the lane runs a clip while the film's worker holds the lock
        short = ShortLane()
        short.turn([worker, lane], 2.0, 1.0)
        # Then the worker is not stopped (its lock is let go as soon as the copy is made)
        assert _stopped(film.pid, False) and short.stopped == {}
        # and a process that only waits for a lock holds none
        waiter = subprocess.Popen(
            ["python3", "-c", f"import fcntl; f=open({str(lock)!r},'w'); fcntl.flock(f, fcntl.LOCK_EX)"]
        )
        wait_for_waiter = time.monotonic() + 5
        while time.monotonic() < wait_for_waiter and waiter.pid not in _waiting_pids():
            time.sleep(0.05)
        assert waiter.pid in _waiting_pids() and waiter.pid not in holding_locks()
        waiter.kill()
        waiter.wait()
    finally:
        film.kill()
        film.wait()
        if film.stdout is not None:
            film.stdout.close()


def _waiting_pids() -> set[int]:
    with open("/proc/locks") as fh:
        return {int(f[5]) for f in (line.split() for line in fh) if len(f) > 5 and f[1] == "->"}


def _stopped(pid: int, expected: bool) -> bool:
    """True when the process is stopped (state ``T``) as ``expected`` says, once a signal just
    sent to it has reached it (waited for up to 5 s)."""

    def state() -> bool:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "T"

    deadline = time.monotonic() + 5
    while state() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return state() == expected


def test_a_voice_command_does_not_warm_the_short_lane_and_a_film_does(tmp_path: Path) -> None:
    """The lane's models are loaded ahead for a film (docs/configuration.md, ``short_lane_s``),
    not for a voice command: it ends in seconds, and the loading beside it took the cores the
    commands after it decode on."""
    voice_dir = tmp_path / "voice"
    worker, lane = WorkerSlot(0), WorkerSlot(1, lane=True)
    lane.conn, lane_end = Pipe()
    # Given a worker running a voice command's transcription
    worker.jobs.append(JobEntry({"job_id": "a", "kind": "transcribe", "input": f"{voice_dir}/c-1.wav"}, 60))
    # When the supervisor dispatches it
    warm([worker, lane], voice_dir)
    # Then the lane is not asked to load its models
    assert not lane_end.poll(0) and not lane.warmed
    # When a film's transcription comes to the worker
    worker.jobs.append(JobEntry({"job_id": "b", "kind": "transcribe", "input": str(tmp_path / "film.mkv")}, None))
    warm([worker, lane], voice_dir)
    # Then it is, once
    assert lane_end.recv() == {"op": "warm"} and lane.warmed
    warm([worker, lane], voice_dir)
    assert not lane_end.poll(0)
