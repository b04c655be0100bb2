"""Worker nodes for tests (docs/nodes.md): ``edge-queue worker`` as a real subprocess with its own
data folder and node id, the ``nodes`` fixture that ends them, a hub's settings, and waiting on a
hub's view of its nodes and jobs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from ..conftest import EXTRA_KINDS, ROOT, Broker, ServiceProcess, wait_until

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


def final(w: Any, hub: ServiceProcess, job_id: str, timeout: float = 120) -> dict[str, Any]:
    return w.wait_json(
        f"{hub.base}/jobs/{job_id}", lambda j: j["state"] in ("succeeded", "failed", "cancelled"), timeout
    )
