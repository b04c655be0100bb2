"""Worker nodes (docs/nodes.md): real hubs and real ``edge-queue worker`` processes, each node
an "other box" with its own data folder, its own path map onto the shared media and its own
node id, over a real mosquitto."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from .conftest import EXTRA_KINDS, REFERENCE, ROOT, Broker, ServiceProcess, wait_until, wer

pytestmark = pytest.mark.slow

LEASE_S = 4.0


class NodeProcess:
    """``edge-queue worker`` as a real subprocess: its own data folder and node id."""

    def __init__(
        self,
        hub: ServiceProcess,
        tmp: Path,
        node_id: str,
        media_roots: list[Path],
        path_map: list[dict[str, str]] | None = None,
        workers: int = 1,
        broker: Broker | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.node_id = node_id
        self.broker = broker or hub.broker
        self.log_path = tmp / f"node-{node_id}-{uuid.uuid4().hex[:4]}.log"
        self.env = {
            **os.environ,
            "EDGE_QUEUE_DATA_DIR": str(tmp / f"node-{node_id}"),
            "EDGE_QUEUE_MQTT__HOST": self.broker.host,
            "EDGE_QUEUE_MQTT__PORT": str(self.broker.port),
            "EDGE_QUEUE_MQTT__BASE_TOPIC": hub.base,
            "EDGE_QUEUE_NODES__NODE_ID": node_id,
            "EDGE_QUEUE_NODES__HEARTBEAT_S": "0.5",
            "EDGE_QUEUE_WORKERS": str(workers),
            "EDGE_QUEUE_MEDIA_ROOTS": json.dumps([str(p) for p in media_roots]),
            "EDGE_QUEUE_PATH_MAP": json.dumps(path_map or []),
            "EDGE_QUEUE_EXTRA_KINDS": EXTRA_KINDS,
            "EDGE_QUEUE_LOG_LEVEL": "DEBUG",
            "PYTHONPATH": str(ROOT),
            **(env or {}),
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> NodeProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "edge_queue", "worker"], env=self.env, stdout=subprocess.DEVNULL, stderr=log
            )
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def nodes(tmp_path: Path):
    made: list[NodeProcess] = []

    def make(hub: ServiceProcess, node_id: str, media_roots: list[Path], **kw: Any) -> NodeProcess:
        node = NodeProcess(hub, tmp_path, node_id, media_roots, **kw)
        made.append(node)
        return node.start()

    yield make
    for node in made:
        node.stop()
        # a node's worker processes end with it (their pipe closes); none is left behind
        if node.proc is not None:
            wait_until(lambda n=node: not _children_alive(n.proc.pid), 20, "the node's workers to end")


def _children_alive(pid: int) -> bool:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return bool(out.stdout.strip())


def hub_env(node_ids: list[str], **extra: str) -> dict[str, str]:
    return {
        "EDGE_QUEUE_WORKERS": "0",
        "EDGE_QUEUE_ACCESS__NODES": json.dumps(node_ids),
        "EDGE_QUEUE_NODES__LEASE_S": str(LEASE_S),
        **extra,
    }


def online(w: Any, hub: ServiceProcess, node_ids: list[str]) -> None:
    """Wait until the hub's ``<base>/info`` lists every node of ``node_ids`` online."""

    def seen() -> bool:
        infos = w.json_on(f"{hub.base}/info")
        if not infos:
            return False
        up = {n["node_id"] for n in infos[-1].get("nodes", []) if n["online"]}
        return set(node_ids) <= up

    wait_until(seen, 60, f"nodes {node_ids} online in {hub.base}/info")


def submit(hub: ServiceProcess, w: Any, payload: dict[str, Any]) -> list[str]:
    resp = hub.request("submit", payload, w)
    assert resp["status"] == "ok", resp
    return [j["job_id"] for j in resp["data"]["jobs"]]


def final(w: Any, hub: ServiceProcess, job_id: str, timeout: float = 120) -> dict[str, Any]:
    return w.wait_json(
        f"{hub.base}/jobs/{job_id}", lambda j: j["state"] in ("succeeded", "failed", "cancelled"), timeout
    )


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
        # distinct options: equal ones would be one job (docs/topics.md, duplicates)
        ids = [submit(hub, w, {"kind": "noop", "options": {"sleep_s": 0.05 + i / 10_000}})[0] for i in range(40)]
        assert len(set(ids)) == 40
        ends = [final(w, hub, job_id) for job_id in ids]
        assert [j["state"] for j in ends] == ["succeeded"] * 40
        spread = Counter(j["node"] for j in ends)
        assert set(spread) == {"n1", "n2"} and min(spread.values()) >= 5, spread
        assert all(j["attempt"] == 1 for j in ends)
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


def _lease_lines(log: str, job_id: str) -> list[str]:
    return [line for line in log.splitlines() if job_id in line]


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
        print("lease timeline:", *_lease_lines(hub.log(), job_id), sep="\n  ")
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
