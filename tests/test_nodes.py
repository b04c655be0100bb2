"""Worker nodes (docs/nodes.md): real hubs and real ``edge-queue worker`` processes, each node
an "other box" with its own data folder, its own path map onto the shared media and its own
node id, over a real mosquitto."""

from __future__ import annotations

import json
import shutil
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from .conftest import REFERENCE, ServiceProcess, wait_until, wer
from .helpers.nodes import LEASE_S, NodeProcess, final, hub_env, online

pytestmark = pytest.mark.slow


def submit(hub: ServiceProcess, w: Any, payload: dict[str, Any]) -> list[str]:
    resp = hub.request("submit", payload, w)
    assert resp["status"] == "ok", resp
    return [j["job_id"] for j in resp["data"]["jobs"]]


def test_forty_noop_jobs_spread_over_two_nodes(mosquitto, service_factory, nodes, tmp_path: Path) -> None:
    """docs/nodes.md: a hub with ``workers = 0`` only coordinates; two nodes run everything."""
    media = tmp_path / "media"
    media.mkdir()
    hub = service_factory(mosquitto, [media], hub_env(["n1", "n2"])).start()
    w = hub.watcher("#")
    try:
        for n in ("n1", "n2"):
            nodes(hub, n, [media])
        online(w, hub, ["n1", "n2"])
        # distinct options: equal ones would be one job (docs/topics.md, duplicates); half of them
        # with an input, which a kind without input takes as a label (not a file to look for)
        ids = [
            submit(
                hub,
                w,
                {
                    "kind": "noop",
                    "options": {"sleep_s": 0.05 + i / 10_000},
                    **({"input": f"label-{i}"} if i % 2 else {}),
                },
            )[0]
            for i in range(40)
        ]
        assert len(set(ids)) == 40
        ends = [final(w, hub, job_id) for job_id in ids]
        assert [j["state"] for j in ends] == ["succeeded"] * 40
        spread = Counter(j["node"] for j in ends)
        assert set(spread) == {"n1", "n2"} and min(spread.values()) >= 5, spread
        assert all(j["attempt"] == 1 for j in ends)
    finally:
        w.close()


def test_nodes_on_the_embedded_amqtt_broker(amqtt, service_factory, nodes, tmp_path: Path) -> None:
    """``edge-queue up``'s broker speaks MQTT 3.1.1 only: a node finds that out
    (``mqtt.protocol = "auto"``) and runs jobs there as on mosquitto."""
    media = tmp_path / "media"
    media.mkdir()
    hub = service_factory(amqtt, [media], hub_env(["n1"])).start()
    w = hub.watcher("#")
    try:
        nodes(hub, "n1", [media])
        online(w, hub, ["n1"])
        ids = [submit(hub, w, {"kind": "noop", "options": {"sleep_s": 0.1 + i / 1000}})[0] for i in range(5)]
        ends = [final(w, hub, job_id) for job_id in ids]
        assert all(j["state"] == "succeeded" and j["node"] == "n1" for j in ends), ends
    finally:
        w.close()


def test_transcription_on_a_node_through_its_path_map(
    mosquitto, service_factory, nodes, tmp_path: Path, speech: Path, model_installed: None
) -> None:
    """The hub names ``/…/srv/media/jfk.flac``; the node sees the same share as ``/…/mnt/nas``
    (``[[path_map]]``): the transcript is right, the ``beside`` output lies next to the input
    as the hub names it, and ``node`` says where it ran."""
    share = tmp_path / "srv" / "media"
    share.mkdir(parents=True)
    shutil.copy(speech / "jfk.flac", share / "jfk.flac")
    mount = tmp_path / "mnt" / "nas"
    mount.parent.mkdir()
    mount.symlink_to(share, target_is_directory=True)
    hub = service_factory(mosquitto, [share], hub_env(["gpu1"])).start()
    w = hub.watcher("#")
    try:
        node = nodes(hub, "gpu1", [mount], path_map=[{"hub": str(share), "local": str(mount)}])
        online(w, hub, ["gpu1"])
        (job_id,) = submit(
            hub,
            w,
            {
                "kind": "transcribe",
                "input": str(share / "jfk.flac"),
                "options": {"output": "beside", "formats": ["txt", "srt"]},
            },
        )
        job = final(w, hub, job_id, timeout=180)
        assert job["state"] == "succeeded", (job, node.log())
        assert job["node"] == "gpu1"
        got = hub.request("get", {"job_id": job_id}, w)["data"]
        assert wer(REFERENCE["jfk.flac"], got["result"]["text"]) <= 0.1
        outputs = got["result"]["outputs"]
        assert outputs, got["result"]
        for path in outputs.values() if isinstance(outputs, dict) else outputs:
            assert path.startswith(str(share) + "/"), outputs  # the hub's name for the share
            assert Path(path).is_file()
        assert f"job {job_id} started: transcribe {mount}/jfk.flac" in node.log()
    finally:
        w.close()


def _timeline(w: Any, base: str, job_id: str, node_id: str, killed_at: float) -> list[str]:
    """The job's changes and its first node's messages, in seconds from the hand-out."""
    lines: list[tuple[float, str]] = [(killed_at, f"kill -9 of node {node_id}")]
    for topic, payload, _, t in list(w.messages):
        if topic == f"{base}/events" and job_id.encode() in payload:
            job = json.loads(payload)["job"]
            lines.append((t, f"{job['state']} attempt {job['attempt']} node {job['node']}"))
        elif topic == f"{base}/nodes/{node_id}/up" and payload:
            msg = json.loads(payload)
            lines.append((t, f"{node_id} {msg['op']} {msg.get('jobs', '')}"))
        elif topic == f"{base}/nodes/{node_id}" and payload:
            lines.append((t, f"{node_id} announcement: {json.loads(payload)['state']}"))
    lines.sort()
    start = next(t for t, what in lines if what.startswith("running attempt 1"))
    return [f"{t - start:+7.2f} s  {what}" for t, what in lines if t >= start - 0.01]


def test_kill_9_of_a_node_mid_job_hands_the_job_on_within_the_lease(
    mosquitto, service_factory, nodes, tmp_path: Path
) -> None:
    """docs/nodes.md, "Leases": a node killed mid-job loses it when its lease runs out (or its
    Last Will fires); the job succeeds on the other node at attempt 2."""
    media = tmp_path / "media"
    media.mkdir()
    hub = service_factory(mosquitto, [media], hub_env(["n1", "n2"])).start()
    w = hub.watcher("#")
    try:
        made = {n: nodes(hub, n, [media]) for n in ("n1", "n2")}
        online(w, hub, ["n1", "n2"])
        (job_id,) = submit(hub, w, {"kind": "noop", "options": {"sleep_s": 3}})
        running = w.wait_json(f"{hub.base}/jobs/{job_id}", lambda j: j["state"] == "running" and j["node"] is not None)
        first = running["node"]
        victim = made[first]
        wait_until(lambda: f"job {job_id} started" in victim.log(), 30, "the node to start the job")
        assert victim.proc is not None
        killed_at = time.monotonic()
        victim.proc.kill()
        job = final(w, hub, job_id, timeout=60)
        took = time.monotonic() - killed_at
        assert job["state"] == "succeeded" and job["attempt"] == 2, job
        assert job["node"] != first
        # the lease time, the second attempt's 3 s of work, and a little
        assert took <= LEASE_S + 3 + 4, took
        steps = [(e["state"], e["attempt"], e["node"]) for e in w.job_events(hub.base, job_id)]
        assert ("running", 1, first) in steps and steps[-1] == ("succeeded", 2, job["node"]), steps
        print("lease timeline:", *_timeline(w, hub.base, job_id, first, killed_at), sep="\n  ")
    finally:
        w.close()


def test_a_frozen_node_past_its_lease_has_its_late_outcome_refused(
    mosquitto, service_factory, nodes, tmp_path: Path
) -> None:
    """SIGSTOP a node past its lease, SIGCONT it: its outcome of the older attempt is refused
    and logged; the job's final state is the newer attempt's."""
    media = tmp_path / "media"
    media.mkdir()
    hub = service_factory(mosquitto, [media], hub_env(["n1", "n2"])).start()
    w = hub.watcher("#")
    try:
        made = {n: nodes(hub, n, [media]) for n in ("n1", "n2")}
        online(w, hub, ["n1", "n2"])
        (job_id,) = submit(hub, w, {"kind": "noop", "options": {"sleep_s": 2}})
        running = w.wait_json(f"{hub.base}/jobs/{job_id}", lambda j: j["state"] == "running" and j["node"] is not None)
        frozen = made[running["node"]]
        wait_until(lambda: f"job {job_id} started" in frozen.log(), 30, "the node to start the job")
        assert frozen.proc is not None
        frozen.proc.send_signal(signal.SIGSTOP)
        job = final(w, hub, job_id, timeout=60)
        assert job["state"] == "succeeded" and job["attempt"] == 2 and job["node"] != frozen.node_id, job
        frozen.proc.send_signal(signal.SIGCONT)
        refused = f"node {frozen.node_id}: done of job {job_id} attempt 1 refused"
        wait_until(lambda: refused in hub.log(), 30, "the late outcome to be refused")
        got = hub.request("get", {"job_id": job_id}, w)["data"]
        assert got["state"] == "succeeded" and got["attempt"] == 2 and got["node"] == job["node"]
        # the late outcome changed nothing: no event after the newer attempt's success
        assert w.job_events(hub.base, job_id)[-1]["attempt"] == 2
    finally:
        w.close()


def test_a_node_that_cannot_see_the_input_gives_the_job_to_another_with_its_attempts_intact(
    mosquitto, service_factory, nodes, tmp_path: Path, speech: Path
) -> None:
    """The preferred node's path map points at a share it has not mounted: it gives the job
    back (``input_unreachable``), and the job runs elsewhere at attempt 1."""
    share = tmp_path / "share"
    share.mkdir()
    shutil.copy(speech / "jfk.flac", share / "jfk.flac")
    unmounted = tmp_path / "n1-mnt"
    unmounted.mkdir()
    hub = service_factory(
        mosquitto, [share], hub_env(["n1", "n2"], EDGE_QUEUE_KINDS=json.dumps({"probe": {"prefer": ["n1", "n2"]}}))
    ).start()
    w = hub.watcher("#")
    try:
        n1 = nodes(hub, "n1", [unmounted], path_map=[{"hub": str(share), "local": str(unmounted)}])
        nodes(hub, "n2", [share])
        online(w, hub, ["n1", "n2"])
        (job_id,) = submit(hub, w, {"kind": "probe", "input": str(share / "jfk.flac")})
        job = final(w, hub, job_id, timeout=60)
        assert job["state"] == "succeeded" and job["node"] == "n2" and job["attempt"] == 1, job
        assert "does not exist on this node" in n1.log()
    finally:
        w.close()


def test_shipped_acl_gives_nodes_their_own_topics_only(
    request: pytest.FixtureRequest,
    service_factory,
    nodes,
    tmp_path: Path,
) -> None:
    """broker/edge-queue.acl: a node user reads only what is addressed to it and publishes only
    under its own node topics; an ordinary user cannot take a job, renew a lease or forge an
    outcome; a broker user not in ``access.nodes`` gets no job; a node user sends no request."""
    from .helpers.deploy import USERS, connect, service_env

    broker = request.getfixturevalue("mosquitto_with_acl")
    media = tmp_path / "media"
    media.mkdir()
    env = {**service_env("edge-queue", USERS["edge-queue"]), **hub_env(["n1"])}
    env["EDGE_QUEUE_HOMEASSISTANT__DISCOVERY"] = "false"
    hub = service_factory(broker, [media], env)
    hub.base = "edge-queue"  # the base topic the shipped ACL names
    hub.env["EDGE_QUEUE_MQTT__BASE_TOPIC"] = "edge-queue"
    hub.start(wait_online=False)
    creds = {n: {"EDGE_QUEUE_MQTT__USERNAME": n, "EDGE_QUEUE_MQTT__PASSWORD": USERS[n]} for n in ("n1", "n2")}
    n1 = nodes(hub, "n1", [media], env=creds["n1"])
    n2 = nodes(hub, "n2", [media], env=creds["n2"])
    reason, pair = connect(broker, "phone", USERS["phone"])
    assert reason == "Success"
    phone, box = pair
    box["subscriptions"] = [
        "edge-queue/nodes/+",
        "edge-queue/nodes/n1/down",
        "edge-queue/nodes/+/up",
        "edge-queue/jobs/+",
        "edge-queue/reply/phone/#",
    ]
    for topic in box["subscriptions"]:
        phone.subscribe(topic, 1)
    try:
        wait_until(lambda: "not in access.nodes" in hub.log(), 60, "the hub to ignore n2")
        wait_until(lambda: "node n1 online" in hub.log(), 60, "the hub to see n1")
        # the ordinary user announces itself as a node with free slots: the hub ignores it
        phone.publish(
            "edge-queue/nodes/phone", json.dumps({"v": 1, "state": "online", "kinds": ["noop"], "slots": 4}), 1, True
        )
        phone.publish(
            "edge-queue/request/submit/phone",
            json.dumps({"kind": "noop", "options": {"sleep_s": 3}, "transaction": "t"}),
            1,
        )

        def job_id() -> str | None:
            for t, p in box.get("messages", []):
                if t == "edge-queue/reply/phone/response/submit":
                    return json.loads(p)["data"]["jobs"][0]["job_id"]
            return None

        jid = wait_until(job_id, 30, "the submit's answer")
        wait_until(lambda: f"job {jid} started" in n1.log(), 30, "n1 to start the job")
        # forged heartbeat and outcome for n1's lease, from the ordinary user, on connections of
        # their own: mosquitto drops a client whose publish its ACL denies, and paho would send
        # the denied message again on every reconnect
        for forged in (
            {"v": 1, "op": "done", "job_id": jid, "attempt": 1, "result": {"forged": True}},
            {"v": 1, "op": "beat", "jobs": [[jid, 1]]},
        ):
            _, fpair = connect(broker, "phone", USERS["phone"])
            forger = fpair[0]
            try:
                forger.publish("edge-queue/nodes/n1/up", json.dumps(forged), 1).wait_for_publish(3)
            except (RuntimeError, ValueError):
                pass  # the broker dropped the connection of the client that broke the ACL
            forger.disconnect()
            forger.loop_stop()

        def ended() -> dict[str, Any] | None:
            for t, p in box.get("messages", []):
                if t == f"edge-queue/jobs/{jid}" and p and json.loads(p)["state"] == "succeeded":
                    return json.loads(p)
            return None

        job = wait_until(ended, 60, "the job to succeed")
        assert job["node"] == "n1" and job["result"] != {"forged": True}, job
        topics = {t for t, _ in box["messages"]}
        assert "edge-queue/nodes/n1/down" not in topics  # n1's hand-outs are n1's alone
        assert not any(t.endswith("/up") for t in topics)  # nobody reads a node's reports
        assert "edge-queue/nodes/n1" in topics  # announcements are readable
        assert "handed to node n2" not in hub.log() and "handed to node phone" not in hub.log()
        # a node user may not send requests (role none)
        reason, npair = connect(broker, "n1", USERS["n1"])
        nclient, nbox = npair
        nclient.subscribe("edge-queue/reply/n1/#", 1)
        time.sleep(0.2)
        nclient.publish("edge-queue/request/list/n1", json.dumps({"transaction": "n"}), 1)
        answer = wait_until(
            lambda: next((json.loads(p) for t, p in nbox.get("messages", []) if "/response/" in t), None),
            30,
            "n1's answer",
        )
        assert answer["status"] == "error" and answer["error"]["code"] == "forbidden", answer
        nclient.disconnect()
        nclient.loop_stop()
    finally:
        phone.publish("edge-queue/nodes/phone", b"", 1, True)
        phone.disconnect()
        phone.loop_stop()
        assert n2.proc is not None


def _started_counts(made: list[NodeProcess], job_ids: list[str]) -> Counter[str]:
    """How many times the nodes started each job (their logs)."""
    counts: Counter[str] = Counter()
    for node in made:
        for line in node.log().splitlines():
            for job_id in job_ids:
                if f"job {job_id} started" in line:
                    counts[job_id] += 1
    return counts


def test_a_node_behind_a_bridged_mosquitto_runs_jobs_as_a_direct_one(service_factory, nodes, tmp_path: Path) -> None:
    """docs/nodes.md, "Scaling the broker side": the node connects to a second mosquitto,
    bridged to the hub's with mosquitto's own ``connection``/``topic`` settings."""
    from .helpers.brokers import PrivateMosquitto

    media = tmp_path / "media"
    media.mkdir()
    site_a = PrivateMosquitto(tmp_path / "hub-broker")
    hub = service_factory(site_a, [media], hub_env(["far"]))
    base = hub.base
    bridge = (
        f"\nconnection edge-queue-hub\naddress 127.0.0.1:{site_a.port}\n"
        f"topic {base}/nodes/far out 1\ntopic {base}/nodes/far/up out 1\ntopic {base}/nodes/far/down in 1\n"
    )
    site_b = PrivateMosquitto(tmp_path / "site-broker", extra=bridge)
    try:
        hub.start()
        w = hub.watcher("#")
        try:
            far = nodes(hub, "far", [media], broker=site_b)
            online(w, hub, ["far"])
            ids = [submit(hub, w, {"kind": "noop", "options": {"sleep_s": 0.2 + i / 1000}})[0] for i in range(5)]
            ends = [final(w, hub, job_id) for job_id in ids]
            assert all(j["state"] == "succeeded" and j["node"] == "far" and j["attempt"] == 1 for j in ends), ends
            # its Last Will crosses the bridge too
            assert far.proc is not None
            far.proc.kill()
            wait_until(
                lambda: (
                    "node far is offline" in hub.log()
                    or "went offline" in hub.log()
                    or any(j.get("state") == "offline" for j in w.json_on(f"{base}/nodes/far"))
                ),
                90,
                "the node's Last Will through the bridge",
            )
        finally:
            w.close()
            hub.stop()
    finally:
        site_b.stop()
        site_a.stop()


def test_broker_restart_and_hub_kill_9_while_node_jobs_run_end_every_job_once(
    service_factory, nodes, tmp_path: Path
) -> None:
    """The broker restarted while node jobs run, then the hub killed with -9 and started again:
    every job ends exactly once, and nothing a node finished runs again."""
    from .helpers.brokers import PrivateMosquitto

    media = tmp_path / "media"
    media.mkdir()
    broker = PrivateMosquitto(tmp_path / "broker")
    try:
        hub = service_factory(broker, [media], hub_env(["n1", "n2"])).start()
        made = [nodes(hub, n, [media], workers=2) for n in ("n1", "n2")]
        w = hub.watcher("#")
        online(w, hub, ["n1", "n2"])
        ids = [submit(hub, w, {"kind": "noop", "options": {"sleep_s": 1.5 + i / 1000}})[0] for i in range(12)]
        wait_until(lambda: sum(f"job {j} started" in n.log() for n in made for j in ids) >= 4, 30, "jobs on nodes")
        w.close()
        broker.stop()
        time.sleep(1.0)  # the broker away while jobs finish on the nodes
        broker.start()
        w = hub.watcher("#")
        wait_until(lambda: sum(f"job {j} done" in n.log() for n in made for j in ids) >= 6, 60, "more jobs done")
        hub.kill()  # power cut of the hub while the nodes go on
        time.sleep(1.0)
        hub.start()
        ends = [final(w, hub, job_id, timeout=120) for job_id in ids]
        assert all(j["state"] == "succeeded" for j in ends), [(j["job_id"], j["state"]) for j in ends]
        assert max(_started_counts(made, ids).values()) == 1, _started_counts(made, ids)  # nothing ran twice
        w.close()
        assert hub.stop() == 0
        # exactly one terminal transition per job in the hub's store
        import sqlite3

        with sqlite3.connect(hub.db) as db:
            rows = db.execute(
                "SELECT job_id, count(*) FROM job_events WHERE to_state IN ('succeeded','failed','cancelled') "
                "GROUP BY job_id"
            ).fetchall()
        assert sorted(rows) == sorted((job_id, 1) for job_id in ids), rows
    finally:
        if broker.proc is not None and broker.proc.poll() is None:
            broker.stop()


def _cuda_devices() -> int:
    try:
        import ctranslate2

        return int(ctranslate2.get_cuda_device_count())
    except Exception:  # a CPU-only build or no driver
        return 0


@pytest.mark.gpu
def test_a_gpu_node_transcribes_on_cuda(
    mosquitto, service_factory, nodes, tmp_path: Path, speech: Path, model_installed: None
) -> None:
    """docs/nodes.md, "GPU nodes": ``[transcribe] device = "cuda"`` on a node with an NVIDIA
    GPU. Machines without one (this project's CI among them) skip it, with the reason."""
    if _cuda_devices() < 1:
        pytest.skip("no CUDA device visible to CTranslate2 (no NVIDIA GPU here): the GPU path is not tested")
    share = tmp_path / "media"
    share.mkdir()
    shutil.copy(speech / "jfk.flac", share / "jfk.flac")
    hub = service_factory(mosquitto, [share], hub_env(["gpu"])).start()
    w = hub.watcher("#")
    try:
        env = {"EDGE_QUEUE_TRANSCRIBE__DEVICE": "cuda", "EDGE_QUEUE_TRANSCRIBE__COMPUTE_TYPE": "float16"}
        nodes(hub, "gpu", [share], env=env)
        online(w, hub, ["gpu"])
        (job_id,) = submit(hub, w, {"kind": "transcribe", "input": str(share / "jfk.flac")})
        job = final(w, hub, job_id, timeout=180)
        assert job["state"] == "succeeded" and job["node"] == "gpu", job
        assert wer(REFERENCE["jfk.flac"], job["result"]["text"]) <= 0.1
    finally:
        w.close()


def test_a_node_beats_three_times_per_lease_whatever_its_heartbeat_setting(
    mosquitto, service_factory, nodes, tmp_path: Path
) -> None:
    """``nodes.heartbeat_s`` over a third of the hub's lease: the node beats three times per
    lease instead (and says so), so a job longer than the lease keeps it."""
    media = tmp_path / "media"
    media.mkdir()
    hub = service_factory(mosquitto, [media], hub_env(["n1"])).start()
    w = hub.watcher("#")
    try:
        node = nodes(hub, "n1", [media], env={"EDGE_QUEUE_NODES__HEARTBEAT_S": "30"})
        online(w, hub, ["n1"])
        # a kind that reports no progress: only heartbeats keep its lease
        (job_id,) = submit(hub, w, {"kind": "test_hang", "options": {"seconds": 3 * LEASE_S}})
        job = final(w, hub, job_id, timeout=60)
        assert job["state"] == "succeeded" and job["attempt"] == 1, job
        assert "is over a third of the hub's lease" in node.log()
    finally:
        w.close()


def test_cancel_timeout_and_crash_loop_on_a_node_as_on_the_hub(
    mosquitto, service_factory, nodes, tmp_path: Path
) -> None:
    """A node runs jobs in the same supervised worker processes as the hub: a cancel ends a
    running job, ``timeout_s`` ends an attempt, a job that kills its worker every time ends
    ``crash_loop``."""
    media = tmp_path / "media"
    media.mkdir()
    hub = service_factory(mosquitto, [media], hub_env(["n1"], EDGE_QUEUE_CRASH_LOOP_LIMIT="2")).start()
    w = hub.watcher("#")
    try:
        nodes(hub, "n1", [media], workers=3)
        online(w, hub, ["n1"])
        (hang,) = submit(hub, w, {"kind": "test_hang", "options": {"seconds": 60}})
        (slow,) = submit(hub, w, {"kind": "test_hang", "options": {"seconds": 61}, "timeout_s": 1, "max_attempts": 1})
        (crash,) = submit(hub, w, {"kind": "test_crash"})
        w.wait_json(f"{hub.base}/jobs/{hang}", lambda j: j["state"] == "running" and j["node"] == "n1")
        resp = hub.request("cancel", {"job_id": hang}, w)
        assert resp["status"] == "ok", resp
        assert final(w, hub, hang, timeout=30)["state"] == "cancelled"
        timed_out = final(w, hub, slow, timeout=30)
        assert timed_out["state"] == "failed" and timed_out["error"]["code"] == "timeout", timed_out
        crashed = final(w, hub, crash, timeout=60)
        assert crashed["state"] == "failed" and crashed["error"]["code"] == "crash_loop", crashed
        assert crashed["node"] == "n1" and crashed["attempt"] == 2
    finally:
        w.close()


def test_a_transcription_whose_node_dies_at_60_percent_resumes_on_another_node(
    mosquitto, service_factory, nodes, long_recording, model_installed: None
) -> None:
    """docs/nodes.md and docs/topics.md, "Long jobs resume": the chunks a node finished are
    kept by the hub, and the attempt that follows on another node decodes only the rest."""
    from .helpers.store_rows import kept_chunks

    path, reference = long_recording(300)
    chunked = {"EDGE_QUEUE_TRANSCRIBE__CHUNK_S": "30"}  # 5 minutes: 10 chunks or more
    hub = service_factory(mosquitto, [path.parent], hub_env(["n1", "n2"])).start()
    w = hub.watcher("#")
    try:
        made = {n: nodes(hub, n, [path.parent], env=chunked) for n in ("n1", "n2")}
        online(w, hub, ["n1", "n2"])
        (job_id,) = submit(hub, w, {"kind": "transcribe", "input": str(path)})
        running = w.wait_json(f"{hub.base}/jobs/{job_id}", lambda j: j["state"] == "running" and j["node"])
        first = made[running["node"]]
        # Given a node that finished 6 chunks, kept by the hub, when it is killed (kill -9)
        wait_until(lambda: kept_chunks(hub.db, job_id) >= 6, 600, "six chunks kept by the hub")
        assert first.proc is not None
        first.proc.kill()
        kept = kept_chunks(hub.db, job_id)
        # Then the job ends on the other node, at attempt 2, which decoded only the rest
        job = final(w, hub, job_id, timeout=600)
        assert job["state"] == "succeeded" and job["attempt"] == 2, job
        other = next(n for n in made.values() if n is not first)
        assert job["node"] == other.node_id
        result = hub.request("get", {"job_id": job_id}, w)["data"]["result"]
        assert result["chunks"] >= 10 and result["chunks_resumed"] == kept, (result, kept)
        assert f"resumed after {kept} kept chunk(s)" in other.log()
        assert wer(reference, result["text"]) < 0.05
        # and the kept chunks are gone once the job ended
        assert kept_chunks(hub.db, job_id) == 0
    finally:
        w.close()


def test_a_node_says_why_it_gets_no_job(mosquitto, service_factory, nodes, tmp_path: Path) -> None:
    """A node the hub does not list in access.nodes, and one whose path map names a folder the
    hub has no media root for, say so in their own log (before: "online" and nothing more)."""
    media = tmp_path / "media"
    media.mkdir()
    hub = service_factory(mosquitto, [media], hub_env(["listed"])).start()
    stranger = nodes(hub, "stranger", [media])
    wrong = nodes(hub, "listed", [media], path_map=[{"hub": str(tmp_path / "elsewhere"), "local": str(media)}])
    wait_until(lambda: "this node gets no job: the hub does not list this node ('stranger')" in stranger.log(), 30,
               "the stranger to say why")  # fmt: skip
    wait_until(lambda: "is outside the hub's media roots" in wrong.log(), 30, "the wrong path map to be said")
    assert "does not list this node" not in wrong.log()


def test_doctor_on_a_node_checks_what_a_node_needs(mosquitto, service_factory, tmp_path: Path) -> None:
    from .conftest import run_doctor

    media = tmp_path / "media"
    media.mkdir()
    hub = service_factory(mosquitto, [media], hub_env(["listed"])).start()
    env = {**hub.env, "EDGE_QUEUE_NODES__NODE_ID": "stranger", "EDGE_QUEUE_DATA_DIR": str(tmp_path / "node-data")}
    out = run_doctor(env, "--node")
    assert out.returncode == 1 and "FAIL  hub: the hub does not list this node ('stranger')" in out.stdout, out.stdout
    assert "database" not in out.stdout and "watch" not in out.stdout
    ok = run_doctor({**env, "EDGE_QUEUE_NODES__NODE_ID": "listed"}, "--node")
    assert ok.returncode == 0 and "ok    hub: the hub lists this node (listed)" in ok.stdout, ok.stdout
