"""The Home Assistant add-on's start (addon/edge-queue/run.py) as a real process, outside its
image: the settings it makes from /data/options.json and the Supervisor's API (a stand-in
answering as the Supervisor's API documents it), then the real service it starts, on the
shared mosquitto. tests/test_container.py runs the same in the add-on's image."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import ROOT, Broker, Watcher, clean_broker, descendants, need, wait_until
from .helpers.ports import free_port
from .helpers.supervisor import FakeSupervisor

RUN = ROOT / "addon" / "edge-queue" / "run.py"
SLUG = "a0d7b954_edge_queue"


@pytest.fixture
def addon_dir() -> Iterator[Path]:
    """A folder the service's user (uid 1000) can reach (pytest's ``tmp_path`` is root's own)."""
    path = Path(tempfile.mkdtemp(prefix="eq-addon-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def addon_env(mosquitto: Broker, folder: Path, supervisor: FakeSupervisor, token: str, base: str) -> dict[str, str]:
    options = {
        "media_roots": [str(folder / "media")],
        "workers": 1,
        "log_level": "INFO",
        "api_keys": [],
        "mqtt_host": mosquitto.host,
        "mqtt_port": mosquitto.port,
        "mqtt_websocket_port": 1884,
    }
    (folder / "media").mkdir(exist_ok=True)
    (folder / "options.json").write_text(json.dumps(options))
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "ADDON_OPTIONS": str(folder / "options.json"),
        "SUPERVISOR_API": supervisor.url,
        "SUPERVISOR_TOKEN": token,
        "EDGE_QUEUE_DATA_DIR": str(folder / "data"),
        "ADDON_PAGE_PORT": str(free_port()),
        "ADDON_WYOMING_PORT": str(free_port()),
        "EDGE_QUEUE_API__ENABLED": "false",
        "EDGE_QUEUE_MQTT__BASE_TOPIC": base,
        "EDGE_QUEUE_MQTT__CLIENT_ID": "svc-" + base,
        "EDGE_QUEUE_HOMEASSISTANT__PREFIX": base + "-ha",
    }


@pytest.fixture
def supervisor(mosquitto: Broker) -> Iterator[tuple[FakeSupervisor, str]]:
    token = uuid.uuid4().hex
    sup = FakeSupervisor(mosquitto, token, slug=SLUG)
    yield sup, token
    sup.close()


def test_the_add_on_names_its_device_plainly_and_links_the_ingress_panel(
    mosquitto: Broker, addon_dir: Path, supervisor: tuple[FakeSupervisor, str]
) -> None:
    # Given the add-on's start with the Supervisor's API (before: the device was named
    # "edge-queue <container host name>" and linked http://<container host name>:8099/)
    base = "eqa" + uuid.uuid4().hex[:8]
    env = addon_env(mosquitto, addon_dir, *supervisor, base)
    printed = subprocess.run(
        [sys.executable, str(RUN), "--print"], env=env, capture_output=True, text=True, timeout=30, check=True
    )
    made = json.loads(printed.stdout)
    assert made["EDGE_QUEUE_HOMEASSISTANT__NAME"] == "edge-queue"
    assert made["EDGE_QUEUE_HOMEASSISTANT__DEVICE_URL"] == f"homeassistant://hassio/ingress/{SLUG}"
    assert made["EDGE_QUEUE_WYOMING__ZEROCONF"] == "false"  # the Supervisor announces it, not mDNS too
    # When the service runs with them, then the device config Home Assistant reads says so
    proc = subprocess.Popen([sys.executable, str(RUN)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    w = Watcher(mosquitto.host, mosquitto.port, [f"{base}-ha/device/+/config", f"{base}/status"])
    try:
        device: dict[str, Any] = wait_until(
            lambda: next((json.loads(m)["dev"] for t, m, _, _ in w.messages if t.endswith("/config") and m), None),
            60,
            "the discovery config",
        )
        assert device["name"] == "edge-queue" and device["cu"] == f"homeassistant://hassio/ingress/{SLUG}", device
        # And the Wyoming listener is announced to the Supervisor (discovery: [wyoming]), by the
        # container's host name, and answers describe there
        sup = supervisor[0]
        port = int(env["ADDON_WYOMING_PORT"])
        assert sup.discovered == [{"service": "wyoming", "config": {"uri": f"tcp://{socket.gethostname()}:{port}"}}]
        wait_until(lambda: describe_answered(port), 30, "the Wyoming listener to answer describe")
    finally:
        w.close()
        proc.terminate()
        proc.wait(30)
        if proc.stderr:
            proc.stderr.close()
        clean_broker(mosquitto, base)
        clean_broker(mosquitto, base + "-ha")


def test_the_add_on_runs_the_service_as_uid_1000(
    mosquitto: Broker, addon_dir: Path, supervisor: tuple[FakeSupervisor, str]
) -> None:
    need(os.geteuid() == 0, "the add-on starts as root (as Home Assistant runs it): run the tests as root")
    # Given the add-on started as root, as the Supervisor starts it, with a data_dir an older
    # add-on wrote as root (before: the whole service, FFmpeg on uploads too, ran as root)
    base = "eqa" + uuid.uuid4().hex[:8]
    env = addon_env(mosquitto, addon_dir, *supervisor, base)
    (addon_dir / "data" / "outputs").mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, str(RUN)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    w = Watcher(mosquitto.host, mosquitto.port, [f"{base}/status"])
    try:
        wait_until(lambda: b"online" in w.on(f"{base}/status") or proc.poll() is not None, 60, "online")
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        # Then the service and every process under it run as uid and gid 1000, none as root
        tree = [proc.pid, *descendants(proc.pid)]
        ids = {pid: ids_of(pid) for pid in tree}
        assert all(v == (1000, 1000) for v in ids.values() if v is not None), ids
        assert ids[proc.pid] == (1000, 1000), ids
        # And the store is the service user's
        assert {p.stat().st_uid for p in (addon_dir / "data").iterdir()} == {1000}
    finally:
        w.close()
        proc.terminate()
        proc.wait(30)
        if proc.stderr:
            proc.stderr.close()
        clean_broker(mosquitto, base)
        clean_broker(mosquitto, base + "-ha")


def describe_answered(port: int) -> bool:
    """True when ``describe`` on ``port`` is answered with ``info`` (Home Assistant's check of a
    discovered Wyoming service, with the ``wyoming`` package's client)."""
    from wyoming.client import AsyncTcpClient
    from wyoming.info import Describe, Info

    async def ask() -> bool:
        async with AsyncTcpClient("127.0.0.1", port) as client:
            await client.write_event(Describe().event())
            event = await asyncio.wait_for(client.read_event(), 1)
            return event is not None and Info.is_type(event.type)

    try:
        return asyncio.run(ask())
    except OSError:
        return False


def ids_of(pid: int) -> tuple[int, int] | None:
    """The real uid and gid of ``pid`` (``/proc/<pid>/status``; all four of each must agree),
    or None when it has ended."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return None
    fields = {line.split(":")[0]: line.split()[1:] for line in status.splitlines() if line.startswith(("Uid", "Gid"))}
    uids, gids = {int(x) for x in fields["Uid"]}, {int(x) for x in fields["Gid"]}
    return (uids.pop() if len(uids) == 1 else -1, gids.pop() if len(gids) == 1 else -1)
