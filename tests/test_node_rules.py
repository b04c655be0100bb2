"""The rules of worker nodes as plain data, in milliseconds (docs/nodes.md): path maps, the
preference order of places, and the hub's leases (fencing by attempt, silence, the Last Will,
copies of outcomes), with a clock the test moves and a real store for the scheduler."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from edge_queue.config.settings import Settings
from edge_queue.jobs.scheduler import Scheduler, preferred
from edge_queue.mqtt.topics import Topics
from edge_queue.nodes.hub import HUB, Nodes
from edge_queue.nodes.pathmap import map_result, to_hub, to_local
from edge_queue.store import JobSpec, Store
from edge_queue.workers.supervisor import Supervisor

from .helpers.wire import Wire

MAP = [("/srv/media", "/mnt/nas"), ("/srv/media/video", "/mnt/video")]


@pytest.mark.parametrize(
    ("hub", "local"),
    [
        ("/srv/media/a.wav", "/mnt/nas/a.wav"),
        ("/srv/media/video/b.mkv", "/mnt/video/b.mkv"),  # the longest entry wins
        ("/srv/media2/c.wav", "/srv/media2/c.wav"),  # whole components only
        ("/srv/media", "/mnt/nas"),
        ("/elsewhere/d.wav", "/elsewhere/d.wav"),
    ],
)
def test_path_map(hub: str, local: str) -> None:
    assert to_local(hub, MAP) == local
    if local.startswith("/mnt"):
        assert to_hub(local, MAP) == hub


def test_result_paths_go_back_in_the_hubs_terms() -> None:
    result = {"text": "/mnt/nas is a path-like sentence", "outputs": {"txt": "/mnt/nas/a.txt"}, "n": 3}
    assert map_result(result, MAP) == {
        "text": "/mnt/nas is a path-like sentence",  # not a path under a mapped folder as a whole
        "outputs": {"txt": "/srv/media/a.txt"},
        "n": 3,
    }


@pytest.mark.parametrize(
    ("place", "free", "expected"),
    [
        ("hub", {"gpu": ["transcribe"], "hub": ["transcribe", "probe"]}, ["probe"]),  # the GPU is free: it waits
        ("hub", {"hub": ["transcribe", "probe"]}, ["transcribe", "probe"]),  # the GPU is busy: the hub takes it
        # the GPU does not run transcribe: it holds nothing back
        ("hub", {"gpu": ["probe"], "hub": ["transcribe", "probe"]}, ["transcribe", "probe"]),
        ("gpu", {"gpu": ["transcribe"], "hub": ["transcribe", "probe"]}, ["transcribe", "probe"]),
        ("other", {"gpu": ["transcribe"], "other": ["transcribe", "probe"]}, ["probe"]),  # not listed: last
    ],
)
def test_preferred_places(place: str, free: dict[str, list[str]], expected: list[str]) -> None:
    prefer = {"transcribe": ["gpu", "hub"]}
    assert preferred(["transcribe", "probe"], place, prefer, free) == expected


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def hub(tmp_path: Path, **settings: Any) -> tuple[Nodes, Wire, Clock]:
    settings = {"nodes": {"lease_s": 10}, **settings}
    s = Settings(data_dir=tmp_path, access={"nodes": ["n1", "n2"]}, **settings)
    wire, clock = Wire(), Clock()
    return Nodes(s, Topics("b"), wire, clock), wire, clock  # type: ignore[arg-type]


def say(nodes: Nodes, node_id: str, msg: dict[str, Any] | None, level: str = "up") -> None:
    topic = f"b/nodes/{node_id}" + ("/up" if level == "up" else "")
    nodes.inbox.on_message(topic, json.dumps(msg).encode() if msg is not None else b"", level != "up")


def online(nodes: Nodes, *ids: str, slots: int = 1) -> None:
    for node_id in ids:
        say(nodes, node_id, {"v": 1, "state": "online", "kinds": ["noop", "probe"], "slots": slots}, "announce")
    nodes.poll(True)


JOB = {"job_id": "j1", "attempt": 1, "kind": "noop", "input": None, "options": {}}


def test_a_hand_out_holds_a_lease_that_heartbeats_renew_and_silence_ends(tmp_path: Path) -> None:
    nodes, wire, clock = hub(tmp_path)
    online(nodes, "n1")
    assert nodes.free() == {"n1": 1}
    nodes.assign("n1", JOB, 120)
    assert wire.sent[-1] == ("b/nodes/n1/down", {**JOB, "v": 1, "op": "run", "timeout_s": 120, "lease_s": 10})
    assert nodes.free() == {}
    clock.t += 8
    say(nodes, "n1", {"op": "beat", "jobs": [["j1", 1]]})
    assert nodes.poll(True) == []
    clock.t += 8  # 16 s after the hand-out, 8 after the heartbeat: still held
    assert nodes.poll(True) == []
    clock.t += 3
    (lost,) = nodes.poll(True)
    assert (lost.op, lost.job_id, lost.attempt, lost.data["code"]) == ("lost", "j1", 1, "worker_lost")
    # silent past its lease: nothing more for it until it is heard from again
    assert nodes.free() == {}
    say(nodes, "n1", {"op": "beat", "jobs": []})
    nodes.poll(True)
    assert nodes.free() == {"n1": 1}


def test_a_hand_out_never_confirmed_goes_back_without_its_attempt(tmp_path: Path) -> None:
    nodes, _, clock = hub(tmp_path)
    online(nodes, "n1")
    nodes.assign("n1", JOB, None)
    clock.t += 11
    (out,) = nodes.poll(True)
    assert out.op == "unstarted"


def test_leases_do_not_run_out_while_the_hub_is_away_from_the_broker(tmp_path: Path) -> None:
    nodes, _, clock = hub(tmp_path)
    online(nodes, "n1")
    nodes.assign("n1", JOB, None)
    clock.t += 60
    assert nodes.poll(False) == []  # disconnected: leases start again
    clock.t += 9
    assert nodes.poll(True) == []
    clock.t += 2
    assert [o.op for o in nodes.poll(True)] == ["unstarted"]


def test_fencing_by_attempt_and_node(tmp_path: Path) -> None:
    nodes, wire, clock = hub(tmp_path)
    online(nodes, "n1", "n2")
    nodes.assign("n2", {**JOB, "attempt": 2}, None)
    # n1's outcome of attempt 1 (it came back after the job was handed on): refused, answered ok
    say(nodes, "n1", {"op": "done", "job_id": "j1", "attempt": 1, "result": {}})
    # n1 claiming n2's attempt: refused too
    say(nodes, "n1", {"op": "done", "job_id": "j1", "attempt": 2, "result": {}})
    assert nodes.poll(True) == []
    nodes.send_acks()
    assert [m for t, m in wire.sent if t == "b/nodes/n1/down"] == [
        {"v": 1, "op": "ok", "job_id": "j1", "attempt": 1},
        {"v": 1, "op": "ok", "job_id": "j1", "attempt": 2},
    ]
    # n2's own outcome is applied once; a copy is only answered
    say(nodes, "n2", {"op": "done", "job_id": "j1", "attempt": 2, "result": {"x": 1}})
    say(nodes, "n2", {"op": "done", "job_id": "j1", "attempt": 2, "result": {"x": 1}})
    (done,) = nodes.poll(True)
    assert (done.op, done.attempt, done.data) == ("done", 2, {"result": {"x": 1}})
    nodes.send_acks()
    assert [m["op"] for t, m in wire.sent if t == "b/nodes/n2/down"][-2:] == ["ok", "ok"]


def test_a_node_still_running_a_job_it_lost_has_that_slot_taken_and_is_told_to_stop(tmp_path: Path) -> None:
    nodes, wire, clock = hub(tmp_path)
    online(nodes, "n1")
    say(nodes, "n1", {"op": "beat", "jobs": [["old", 3]]})
    nodes.poll(True)
    assert wire.sent[-1] == ("b/nodes/n1/down", {"v": 1, "op": "cancel", "job_id": "old", "attempt": 3})
    assert nodes.free() == {}  # its one slot still runs the old job
    say(nodes, "n1", {"op": "lost", "job_id": "old", "attempt": 3, "code": "cancelled", "message": ""})
    assert nodes.poll(True) == []
    assert nodes.free() == {"n1": 1}


def test_the_last_will_ends_the_nodes_leases_within_seconds_unless_it_is_back(tmp_path: Path) -> None:
    nodes, _, clock = hub(tmp_path)
    online(nodes, "n1")
    nodes.assign("n1", {**JOB, "job_id": "j2"}, None)
    nodes.assign("n1", JOB, None)
    say(nodes, "n1", {"op": "beat", "jobs": [["j1", 1], ["j2", 1]]})
    nodes.poll(True)
    say(nodes, "n1", {"state": "offline", "kinds": ["noop"], "slots": 1}, "announce")
    assert nodes.poll(True) == [] and nodes.free() == {}
    clock.t += 2  # a broker restart sends every Will: the node is back, with j1 still running
    say(nodes, "n1", {"v": 1, "state": "online", "kinds": ["noop"], "slots": 2}, "announce")
    say(nodes, "n1", {"op": "beat", "jobs": [["j1", 1]]})
    assert nodes.poll(True) == []
    clock.t += 1.5
    (lost,) = nodes.poll(True)  # j2, which it no longer holds
    assert (lost.op, lost.job_id) == ("lost", "j2") and "went offline" in lost.data["message"]
    clock.t += 8
    assert nodes.poll(True) == []  # j1's lease was renewed for lease_s


def test_a_user_not_in_access_nodes_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    nodes, _, _ = hub(tmp_path)
    say(nodes, "phone", {"v": 1, "state": "online", "kinds": ["noop"], "slots": 4}, "announce")
    say(nodes, "phone", {"v": 1, "state": "online", "kinds": ["noop"], "slots": 4}, "announce")
    nodes.poll(True)
    assert nodes.free() == {} and nodes.summary() == []
    assert caplog.text.count("node phone is not in access.nodes") == 1


def test_input_unreachable_keeps_the_job_from_that_node(tmp_path: Path) -> None:
    nodes, _, _ = hub(tmp_path)
    online(nodes, "n1")
    nodes.assign("n1", JOB, None)
    say(nodes, "n1", {"op": "unstarted", "job_id": "j1", "attempt": 1, "code": "input_unreachable", "message": "x"})
    (out,) = nodes.poll(True)
    assert out.op == "unstarted"
    assert nodes.excluded_for("n1") == ["j1"] and nodes.excluded_for("n2") == []
    assert nodes.free() == {"n1": 1}  # it may take other jobs


def test_scheduler_fills_node_slots_in_preference_order(tmp_path: Path) -> None:
    settings = Settings(
        data_dir=tmp_path,
        workers=1,
        access={"nodes": ["n1", "n2"]},
        kinds={"probe": {"prefer": ["n2", "hub", "n1"]}},
    )
    store = Store(tmp_path / "q.db")
    sup = Supervisor(settings)
    for slot in sup.slots:
        slot.process = object()
    wire = Wire()
    nodes = Nodes(settings, Topics("b"), wire)  # type: ignore[arg-type]
    online(nodes, "n1", "n2")
    assigned: list[dict[str, Any]] = []
    scheduler = Scheduler(settings, ["noop", "probe"], lambda: store, sup, "run1", assigned.append, nodes)
    for i in range(4):
        store.submit([JobSpec("probe", f"p{i}", {})], 1000.0 + i)
    scheduler.schedule(2000.0)
    # n2 first, then the hub's one worker; n1 waits while the hub, ranked above it, is free
    assert {j["input"]: j["owner"] for j in assigned} == {"p0": "node:n2", "p1": "run1"}
    scheduler.schedule(2001.0)
    # n2 and the hub are busy now: n1 takes the next one
    assert {j["input"]: j["owner"] for j in assigned}["p2"] == "node:n1"
    assert store.counts()["queued"] == 1
    assert nodes.summary()[0]["running"] == 1 and HUB == "hub"


def test_a_job_no_place_can_run_is_said_once_on_a_hub_without_workers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    nodes, _, _ = hub(tmp_path, workers=0)
    online(nodes, "n1", "n2")
    for node_id in ("n1", "n2"):
        nodes.assign(node_id, JOB, None)
        say(nodes, node_id, {"op": "unstarted", "job_id": "j1", "attempt": 1, "code": "input_unreachable"})
        nodes.poll(True)
    assert caplog.text.count("job j1: no online node can run it (n1, n2) and this hub has no workers") == 1


def test_a_listed_node_sending_json_nested_too_deep_to_read_is_refused_not_fatal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a node account's announcement and up messages of 3,001 bytes: 1,500 nested arrays
    # (before, the hub died at once with RecursionError, and again at every start while the
    # announcement stayed retained)
    nodes, _, _ = hub(tmp_path)
    online(nodes, "n1")
    deep = b"[" * 1500 + b"]" * 1500
    nodes.inbox.on_message("b/nodes/n2", deep, True)
    nodes.inbox.on_message("b/nodes/n1/up", deep, False)
    # Then each is refused as not JSON, and the hub goes on with the nodes it knows
    assert nodes.poll(True) == []
    assert caplog.text.count("sent a message that is not JSON") == 2
    assert nodes.free() == {"n1": 1}


@pytest.mark.parametrize(
    "fields",
    [
        '"progress": 50, "eta_s": Infinity',
        '"progress": 50, "eta_s": 1e400',
        '"progress": 50, "eta_s": 10000000000000000000000',
        '"progress": NaN, "eta_s": 5',
        '"progress": 1e308, "eta_s": -5',
        '"progress": -50, "eta_s": 5',
        '"progress": true, "eta_s": 5',
        '"progress": 50, "eta_s": 5, "stage": "' + "s" * 200_000 + '"',
        '"progress": 50, "eta_s": 5, "stage": 7',
    ],
)
def test_a_nodes_progress_out_of_range_is_refused_and_the_lease_still_renewed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fields: str
) -> None:
    # Given a listed node holding a job, sending progress with a value out of docs/topics.md's
    # ranges (before, eta_s Infinity or 1e22 killed the hub: round() of infinity, SQLite's
    # 64-bit INTEGER; progress -50, 1e308 and a 200 KB stage were published as they came)
    nodes, _, clock = hub(tmp_path)
    online(nodes, "n1")
    nodes.assign("n1", JOB, None)
    raw = ('{"op": "progress", "job_id": "j1", "attempt": 1, ' + fields + "}").encode()
    nodes.inbox.on_message("b/nodes/n1/up", raw, False)
    # Then no progress reaches the job, the refusal is logged, and the node still holds its lease
    out = nodes.poll(True)
    assert [o.op for o in out] == []
    assert "n1 sent progress of job j1 out of range" in caplog.text
    clock.t += 9
    assert nodes.poll(True) == []  # the lease was renewed or is still within its first 10 s
    # And progress within the ranges is taken as it is
    say(nodes, "n1", {"op": "progress", "job_id": "j1", "attempt": 1, "progress": 42.5, "stage": "x", "eta_s": 31})
    (p,) = nodes.poll(True)
    assert (p.op, p.data) == ("progress", {"progress": 42.5, "stage": "x", "eta_s": 31})


def test_a_node_given_json_nested_too_deep_to_read_on_its_down_topic_ignores_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a worker node and a message of 1,500 nested arrays on its down topic (before, the
    # RecursionError ended paho's network thread: the node stayed alive, never reconnected,
    # and was handed a job it could not hear of)
    from types import SimpleNamespace

    from edge_queue.nodes.node import WorkerNode

    node = WorkerNode(Settings(data_dir=tmp_path, workers=1, nodes={"node_id": "n1"}))
    try:
        deep = SimpleNamespace(topic="edge-queue/nodes/n1/down", payload=b"[" * 1500 + b"]" * 1500)
        node._on_message(None, None, deep)  # type: ignore[arg-type]
        # Then it is ignored as not JSON, and the next message is read as usual
        assert "that is not JSON was ignored" in caplog.text
        ok = SimpleNamespace(topic=deep.topic, payload=b'{"op": "ok"}')
        node._on_message(None, None, ok)  # type: ignore[arg-type]
        assert node.inbox.get_nowait() == {"op": "ok"}
    finally:
        node._wake_r.close()
        node._wake_w.close()


def test_a_hand_out_carries_only_the_kept_chunks_that_fit_under_the_brokers_packet_limit(tmp_path: Path) -> None:
    # Given a job with three kept chunks of 5 MiB each (before, the run message carried all
    # 15 MiB and more: over mosquitto's max_packet_size, the broker closed the hub's connection
    # at every try and the hub stayed offline)
    from edge_queue.nodes.hub import KEPT_BUDGET_BYTES

    nodes, wire, _ = hub(tmp_path)
    online(nodes, "n1")
    big = [{"index": i, "attempt": 1, "data": {"text": "x" * (5 * 1024 * 1024)}} for i in range(3)]
    nodes.assign("n1", {**JOB, "kept": big}, None)
    # Then the hand-out carries the first chunk only: the node resumes after it, decodes the rest
    sent = wire.sent[-1][1]
    assert [c["index"] for c in sent["kept"]] == [0]
    assert len(json.dumps(sent)) < KEPT_BUDGET_BYTES + 1024


def test_a_node_flooding_the_hub_is_dropped_from_and_the_others_are_still_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a listed node sending 1 MB messages faster than the hub's turns read them (before:
    # all were held, 846 MB in the hub, and a submit waited 14.7 s for its answer), and one
    # message over the largest a node sends
    from edge_queue.nodes.hub_inbox import MESSAGE_MAX_BYTES, NODE_INBOX_BYTES_MAX

    nodes, _, _ = hub(tmp_path)
    online(nodes, "n1", "n2")
    nodes.assign("n2", JOB, None)
    filler = json.dumps({"op": "progress", "job_id": "j1", "attempt": 1, "pad": "x" * 1_000_000}).encode()
    nodes.inbox.on_message("b/nodes/n1/up", b"[" + b" " * MESSAGE_MAX_BYTES + b"]", False)
    for _ in range(200):
        nodes.inbox.on_message("b/nodes/n1/up", filler, False)
    # When the other node ends its job in the same turn
    say(nodes, "n2", {"op": "done", "job_id": "j1", "attempt": 1, "result": {"ok": True}})
    # Then the flood holds at most its node's share, the other node's outcome is read
    assert nodes.inbox.bytes <= NODE_INBOX_BYTES_MAX + 1_000
    assert [(o.op, o.job_id) for o in nodes.poll(True)] == [("done", "j1")]
    assert "node n1 sends faster than the hub reads" in caplog.text
    assert f"over {MESSAGE_MAX_BYTES}: dropped unread" in caplog.text
    # and the next turn reads n1 again
    say(nodes, "n1", {"op": "beat", "jobs": []})
    assert nodes.inbox and nodes.poll(True) == []


def test_a_node_s_result_must_be_its_kind_s_result(tmp_path: Path) -> None:
    """A node's done with a result that is not its kind's (null, nested 900 deep, a transcribe
    result with a wrong type or an extra field) is a failed attempt with invalid_result, never
    a succeeded job."""
    from edge_queue.kinds.transcribe import Transcribe
    from edge_queue.rules.results import MAX_RESULT_BYTES, result_problem

    deep: Any = []
    for _ in range(900):
        deep = [deep]
    good = {
        "language": "en", "language_probability": 1.0, "duration_s": 11.0, "text": "Ask not.",
        "text_truncated": False, "segments": 1, "chunks": 1, "chunks_resumed": 0,
        "outputs": {"txt": "/data/outputs/j1/a.txt"}, "model": "tiny.en", "realtime_factor": 0.05,
    }  # fmt: skip
    assert result_problem(good, Transcribe.Result) is None
    for bad in (None, [], {"deep": deep}, {"x": "y" * MAX_RESULT_BYTES}):
        assert result_problem(bad) is not None
    for wrong in ({**good, "segments": "1"}, {**good, "extra": 1}, {**good, "outputs": {"pdf": "/x"}}):
        assert result_problem(wrong, Transcribe.Result) is not None

    nodes, _, _ = hub(tmp_path)
    nodes.kind_classes = {"transcribe": Transcribe}
    online(nodes, "n1")
    for attempt, result in ((1, None), (2, {"deep": deep}), (3, {**good, "text": 5}), (4, good)):
        nodes.assign("n1", {**JOB, "kind": "transcribe", "attempt": attempt}, None)
        say(nodes, "n1", {"op": "done", "job_id": "j1", "attempt": attempt, "result": result})
        (out,) = nodes.poll(True)
        if attempt < 4:
            assert (out.op, out.data["code"], out.data["retryable"]) == ("failed", "invalid_result", True)
        else:
            assert (out.op, out.data) == ("done", {"result": good})


def test_the_hub_enforces_timeout_and_cancel_on_its_own_clock(tmp_path: Path) -> None:
    """A node that holds a job past its timeout_s and ignores the cancel, or ignores a cancel,
    loses it cancel_grace_s later: timeout and cancelled on time, whatever it keeps saying."""
    nodes, wire, clock = hub(tmp_path, cancel_grace_s=5)
    online(nodes, "n1", slots=2)
    nodes.assign("n1", JOB, 3)
    nodes.assign("n1", {**JOB, "job_id": "j2"}, None)
    clock.t += 2
    say(nodes, "n1", {"op": "beat", "jobs": [["j1", 1], ["j2", 1]]})
    assert nodes.poll(True) == []
    clock.t += 1.5  # past j1's 3 s: the node is asked to stop it
    assert nodes.poll(True) == []
    assert wire.sent[-1] == ("b/nodes/n1/down", {"v": 1, "op": "cancel", "job_id": "j1", "attempt": 1})
    assert nodes.cancel("j2")  # a user's cancel of the other job
    for _ in range(2):  # the node goes on beating for both, ignoring both
        clock.t += 2
        say(nodes, "n1", {"op": "beat", "jobs": [["j1", 1], ["j2", 1]]})
        assert nodes.poll(True) == []
    clock.t += 1.1  # cancel_grace_s after each was asked
    ended = {o.job_id: (o.op, o.data["code"]) for o in nodes.poll(True)}
    assert ended == {"j1": ("lost", "timeout"), "j2": ("lost", "cancelled")}
    assert nodes.running_job_ids() == set()
    say(nodes, "n1", {"op": "done", "job_id": "j1", "attempt": 1, "result": {}})  # too late: fenced
    assert nodes.poll(True) == []


def test_slots_are_bounded_by_the_hub(tmp_path: Path) -> None:
    nodes, _, _ = hub(tmp_path, nodes={"lease_s": 10, "max_slots": 4})
    online(nodes, "n1", slots=1024)
    assert nodes.free() == {"n1": 4}


def test_a_heartbeat_and_an_announcement_cost_bounded_work(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A heartbeat listing 200,000 jobs the node does not hold is read up to nodes.max_slots
    (before: 200,000 cancels); an announcement of a 3.4 MB kinds list keeps 64 names of at most
    64 characters; one node's 4 MB heartbeats are read 8 MiB a turn while another node's
    outcome is read in the same turn; every line they cause goes through the rate limit."""
    from edge_queue.nodes.hub_rules import POLL_BYTES_PER_NODE

    nodes, wire, _ = hub(tmp_path, nodes={"lease_s": 10, "max_slots": 4})
    online(nodes, "n2")
    kinds = ["noop"] + [f"k{i:07d}" * 4 for i in range(100_000)]
    say(nodes, "n1", {"v": 1, "state": "online", "slots": 2, "kinds": kinds,
                      "host": "h" * 10_000, "version": "0.1.0", "models": ["m"] * 1000}, "announce")  # fmt: skip
    nodes.poll(True)
    (n1,) = [n for n in nodes.summary() if n["node_id"] == "n1"]
    assert len(n1["kinds"]) == 64 and n1["host"] is None and len(n1["models"]) == 32
    assert len(json.dumps(nodes.summary())) < 10_000
    sent = len(wire.sent)
    beat = {"op": "beat", "jobs": [[f"j{i}", 1] for i in range(200_000)]}  # 3 MB: under the 4 MiB bound
    say(nodes, "n1", beat)
    assert nodes.poll(True) == []
    assert len(wire.sent) - sent == 4  # a cancel for each of the 4 listed jobs read, not 500,000
    big = json.dumps({"op": "beat", "jobs": [], "pad": "x" * 4_000_000}).encode()
    for _ in range(3):
        nodes.inbox.on_message("b/nodes/n1/up", big, False)
    nodes.assign("n2", JOB, None)
    say(nodes, "n2", {"op": "done", "job_id": "j1", "attempt": 1, "result": {}})
    assert [o.op for o in nodes.poll(True)] == ["done"]  # n2 read in the turn n1's flood is cut
    assert 0 < nodes.inbox.bytes <= len(big) and len(big) * 2 <= POLL_BYTES_PER_NODE + len(big)
    assert nodes.wait_s(0.0) == 0.0  # the rest is read in the next turn, at once
    nodes.poll(True)
    assert len(nodes.inbox) == 0
    refused = [r for r in caplog.records if r.name == "edge_queue.nodes.hub" and r.levelname == "WARNING"]
    assert len(refused) <= 20


def test_a_node_speaking_another_protocol_gets_no_job_and_is_shown_incompatible(tmp_path: Path) -> None:
    nodes, _, _ = hub(tmp_path)
    say(nodes, "n1", {"v": 2, "state": "online", "kinds": ["noop"], "slots": 2, "version": "0.0.1"}, "announce")
    online(nodes, "n2")
    (n1,) = [n for n in nodes.summary() if n["node_id"] == "n1"]
    assert "speaks node protocol 2" in n1["incompatible"] and nodes.free() == {"n2": 1}
    (n2,) = [n for n in nodes.summary() if n["node_id"] == "n2"]
    assert n2["incompatible"] is None


def test_a_node_whose_kind_cannot_run_the_options_gives_the_job_back() -> None:
    """A node's (older) kind that lacks an option, or bounds it lower, than the hub's: the node
    gives the job back with exclude (its attempt not counted, not offered to that node again),
    instead of failing it with internal_error."""
    from edge_queue.kinds.noop import Noop
    from edge_queue.nodes.node import options_problem

    assert options_problem(Noop, {"sleep_s": 1}, Settings()) is None
    assert "options.new_option" in (options_problem(Noop, {"new_option": 1}, Settings()) or "")
    assert "options.sleep_s" in (options_problem(Noop, {"sleep_s": 3600}, Settings()) or "")


def test_a_node_learns_why_it_gets_no_job_from_the_hub_s_info() -> None:
    from edge_queue.nodes.hub_view import node_problems

    info = {"state": "online", "media_roots": ["/srv/media"], "node_ids": ["gpu", "cpu"],
            "nodes": [{"node_id": "gpu", "incompatible": None}]}  # fmt: skip
    assert node_problems(info, "cpu", []) == []  # listed, not running yet
    assert node_problems(info, "gpu", [("/srv/media", "/mnt/nas")]) == []
    assert node_problems(info, "gpu", [("/srv/media/films", "/mnt/films")]) == []  # a folder inside a root
    (unlisted,) = node_problems(info, "laptop", [])
    assert "does not list this node ('laptop')" in unlisted and "access.nodes" in unlisted
    (wrong_map,) = node_problems(info, "gpu", [("/srv/medias", "/mnt/nas")])
    assert "path_map hub = /srv/medias is outside the hub's media roots (/srv/media)" in wrong_map
    odd = {**info, "nodes": [{"node_id": "gpu", "incompatible": "speaks node protocol 2"}]}
    assert node_problems(odd, "gpu", []) == ["the hub shows this node incompatible: speaks node protocol 2"]
    assert node_problems({"state": "offline"}, "laptop", []) == []


def test_one_outage_is_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    nodes, _, _ = hub(tmp_path)
    online(nodes, "n1")
    for _ in range(3):  # the Will, then the same retained offline seen again
        say(nodes, "n1", {"v": 1, "state": "offline", "kinds": ["noop"], "slots": 1}, "announce")
        nodes.poll(True)
    assert caplog.text.count("node n1 is offline") == 1


def test_what_the_hub_shows_of_a_node_follows_what_it_hears(tmp_path: Path) -> None:
    """A node behind a bridge during an outage: its retained announcement still says online,
    but the hub has heard nothing for a lease: info, queue and Home Assistant's sensor say
    offline (silent) until it is heard again."""
    nodes, _, clock = hub(tmp_path)
    online(nodes, "n1")
    nodes.end_turn()
    clock.t += 9
    nodes.poll(True)
    assert nodes.summary()[0]["online"] is True and not nodes.end_turn()
    clock.t += 2  # 11 s without a word, over lease_s (10)
    nodes.poll(True)
    assert nodes.summary()[0]["online"] is False
    assert nodes.summary()[0]["silent"] is True and nodes.end_turn()  # info and queue are due
    say(nodes, "n1", {"op": "beat", "jobs": []})
    nodes.poll(True)
    assert nodes.summary()[0]["online"] is True and nodes.end_turn()


def test_forged_outcomes_cost_the_broker_a_bounded_number_of_answers(tmp_path: Path) -> None:
    """20,000 forged outcomes in one turn: at most ACKS_PER_NODE answers (before: 20,000 QoS 1
    messages, whose backlog held every new job on the hub)."""
    from edge_queue.nodes.hub_rules import ACKS_PER_NODE

    nodes, wire, _ = hub(tmp_path)
    online(nodes, "n1")
    for i in range(20_000):
        say(nodes, "n1", {"op": "done", "job_id": f"forged{i}", "attempt": 1, "result": {}})
    assert nodes.poll(True) == []
    nodes.send_acks()
    assert len([t for t, _ in wire.sent if t == "b/nodes/n1/down"]) == ACKS_PER_NODE
