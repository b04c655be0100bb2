"""The container image (container/, docs/install.md), built and run with podman: the image
builds from a clean clone, runs as a user of its own, transcribes a recording submitted with
mosquitto_pub from outside, keeps its jobs across a stop and a start, and runs a worker node
for a hub outside it.

No container registry is reachable here: the base image is built from Debian's packages
(``EDGE_QUEUE_BASE=debootstrap``). podman on these machines needs the runc runtime, cgroupfs
and ulimits no higher than the host's (tests/helpers/podman.py). Locally without podman,
debootstrap or root the tests skip with the reason; under ``CI=true`` they fail.

The same image is built and run with Docker too (``PODMAN=docker container/build.sh``), with a
dockerd started as docs/install.md says when none runs (vfs storage, no iptables, no bridge:
containers on the host's network).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import ROOT, SYSTEM_MQTT, Watcher, need, port_open, wait_until, wer
from .helpers.podman import LIMITS, PODMAN, podman, run_container

# (a cold image build is part of the first test that needs the image: minutes, not pytest's 300 s)
pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.container, pytest.mark.timeout(2400)]

JFK = "And so my fellow Americans, ask not what your country can do for you, ask what you can do for your country."


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The image, built by container/build.sh from a clean clone of this checkout's HEAD."""
    for tool in ("podman", "runc", "debootstrap", "git"):
        need(shutil.which(tool) is not None, f"{tool} is not installed (apt-get install podman runc debootstrap)")
    need(os.geteuid() == 0, "building the base image with debootstrap needs root")
    need(port_open(*SYSTEM_MQTT), "no mosquitto at 127.0.0.1:1883")
    clone = tmp_path_factory.mktemp("clone") / "edge-queue"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    tag = f"localhost/edge-queue-test:{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "PODMAN": " ".join(PODMAN),
        "BUILD_OPTS": " ".join(LIMITS),
        "EDGE_QUEUE_BASE": "debootstrap",
    }
    t0 = time.monotonic()
    built = subprocess.run(
        [str(clone / "container" / "build.sh"), tag], env=env, capture_output=True, text=True, timeout=1800
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    size = json.loads(podman("image", "inspect", tag).stdout)[0]["Size"]
    print(f"image {tag}: built in {time.monotonic() - t0:.0f} s, {size / 1e6:.0f} MB")
    yield tag
    podman("rmi", "-f", tag, check=False)


def test_the_image_runs_as_a_user_of_its_own(image: str) -> None:
    out = podman("run", "--rm", *LIMITS, image, "--version").stdout
    assert out.startswith("edge-queue ")
    ids = podman("run", "--rm", *LIMITS, "--entrypoint", "id", image).stdout
    assert ids.startswith("uid=1000(edge-queue)")
    health = json.loads(podman("image", "inspect", image).stdout)[0].get("Healthcheck")
    assert health and "edge-queue-healthcheck" in " ".join(health["Test"])


def wait_state(w: Watcher, topic: str, state: str, timeout: float) -> dict[str, Any]:
    wait_until(lambda: (w.json_on(topic) or [{}])[-1].get("state") == state, timeout, f"{topic} {state}")
    return w.json_on(topic)[-1]


def transcribes_jfk(w: Watcher, base: str) -> str:
    """``/media/jfk.flac`` submitted with ``mosquitto_pub`` from outside the container succeeds,
    its words JFK's; its job's topic."""
    subprocess.run(["mosquitto_pub", "-q", "1", "-t", f"{base}/request/submit", "-m", "/media/jfk.flac"], check=True)
    wait_until(lambda: any(t.startswith(f"{base}/jobs/") for t, *_ in w.messages), 30, "a job")
    job_topic = next(t for t, *_ in w.messages if t.startswith(f"{base}/jobs/"))
    job = wait_state(w, job_topic, "succeeded", 120)
    assert wer(JFK, job["result"]["text"]) < 0.15
    return job_topic


def test_a_recording_submitted_from_outside_and_a_restart(
    image: str, containers: list[str], tmp_path: Path, speech: Path
) -> None:
    media = tmp_path / "media"
    media.mkdir()
    shutil.copy(speech / "jfk.flac", media / "jfk.flac")
    os.chmod(tmp_path, 0o755)
    os.chmod(media, 0o755)
    base = "eqc" + uuid.uuid4().hex[:8]
    env = {
        "EDGE_QUEUE_MQTT__BASE_TOPIC": base,
        "EDGE_QUEUE_MQTT__CLIENT_ID": base,
        "EDGE_QUEUE_HOMEASSISTANT__DISCOVERY": "false",
        "EDGE_QUEUE_API__PORT": str(_free_port()),
        "EDGE_QUEUE_HTTP__PORT": str(_free_port()),
    }
    volume = f"eqtest-{uuid.uuid4().hex[:8]}"
    w = Watcher(*SYSTEM_MQTT, [f"{base}/status", f"{base}/jobs/+"])
    try:
        t0 = time.monotonic()
        name = run_container(
            image, containers, "-v", f"{volume}:/data", "-v", f"{media}:/media:ro", env=env, command=["serve"]
        )
        wait_until(lambda: b"online" in w.on(f"{base}/status"), 60, "the container online")
        print(f"start -> online: {time.monotonic() - t0:.1f} s")
        job_topic = transcribes_jfk(w, base)
        health = podman("healthcheck", "run", name, check=False)
        assert health.returncode == 0, health.stdout + health.stderr

        podman("stop", "-t", "30", name, timeout=60)
        wait_until(lambda: w.on(f"{base}/status")[-1:] == [b"offline"], 30, "offline on stop")
        podman("start", name)
        wait_until(lambda: w.on(f"{base}/status")[-1:] == [b"online"], 60, "online again")
        listed = subprocess.run(
            ["mosquitto_sub", "-t", job_topic, "-C", "1", "-W", "10"], capture_output=True, text=True, timeout=20
        ).stdout
        assert json.loads(listed)["state"] == "succeeded"  # the store in the volume kept it
    finally:
        w.close()
        podman("volume", "rm", "-f", volume, check=False)
        _clear(base)


def test_a_worker_container_takes_jobs_from_a_hub_outside_it(
    image: str, containers: list[str], service_factory: Any, mosquitto: Any, tmp_path: Path, speech: Path
) -> None:
    media = tmp_path / "media"
    media.mkdir()
    shutil.copy(speech / "jfk.flac", media / "jfk.flac")
    for p in (tmp_path, media):
        os.chmod(p, 0o755)
    os.chmod(media / "jfk.flac", 0o644)
    node = "box" + uuid.uuid4().hex[:6]
    hub = service_factory(
        mosquitto, [media], {"EDGE_QUEUE_WORKERS": "0", "EDGE_QUEUE_ACCESS__NODES": json.dumps([node])}
    ).start()
    env = {
        "EDGE_QUEUE_MQTT__BASE_TOPIC": hub.base,
        "EDGE_QUEUE_NODES__NODE_ID": node,
        "EDGE_QUEUE_MEDIA_ROOTS": json.dumps(["/media"]),
        "EDGE_QUEUE_PATH_MAP": json.dumps([{"hub": str(media), "local": "/media"}]),
        "EDGE_QUEUE_WORKERS": "1",
    }
    run_container(image, containers, "-v", f"{media}:/media:ro", env=env, command=["worker"])
    with hub.watcher("response/#", "jobs/#", "nodes/#") as w:
        wait_until(lambda: any(b'"online"' in m for m in w.on(f"{hub.base}/nodes/{node}")), 60, "the node online")
        resp = hub.request("submit", {"input": str(media / "jfk.flac")}, w)
        job_id = resp["data"]["jobs"][0]["job_id"]
        job = wait_state(w, f"{hub.base}/jobs/{job_id}", "succeeded", 120)
    assert job["node"] == node and "Americans" in job["result"]["text"]


def _free_port() -> int:
    from .helpers.ports import free_port

    return free_port()


def _clear(base: str) -> None:
    from .conftest import Broker, clean_broker

    clean_broker(Broker(*SYSTEM_MQTT, "mosquitto"), base)


def test_compose_brings_up_mosquitto_and_the_hub(image: str, tmp_path: Path, speech: Path) -> None:
    """compose.yaml with podman-compose, from the clean clone the image was built from: the
    shipped mosquitto configuration and ACL with passwords made on the first start, the hub,
    and a job submitted by a LAN user as the shipped ACL allows."""
    need(shutil.which("podman-compose") is not None or _venv_tool("podman-compose"), "pip install podman-compose")
    project = tmp_path / "compose-project"
    shutil.copytree(
        ROOT, project, ignore=shutil.ignore_patterns(".git", ".venv", "node_modules", "__pycache__", "bench")
    )
    media = project / "media"
    media.mkdir()
    shutil.copy(speech / "jfk.flac", media / "jfk.flac")
    for p in (tmp_path, project, media):
        os.chmod(p, 0o755)
    os.chmod(media / "jfk.flac", 0o644)
    ports = {name: _free_port() for name in ("MQTT_PORT", "MQTT_WEBSOCKET_PORT", "PAGE_PORT", "API_PORT")}
    env_file = "".join(f"{k}={v}\n" for k, v in ports.items())
    (project / ".env").write_text(
        "EDGE_QUEUE_MQTT_PASSWORD=pw-edge-queue-7f3a\nMQTT_USERS=phone:pw-phone-9c1d\nMEDIA_DIR=./media\n"
        f"EDGE_QUEUE_IMAGE={image}\n" + env_file
    )
    conf = tmp_path / "containers.conf"
    conf.write_text(
        '[containers]\ndefault_ulimits = ["nofile=4096:4096", "nproc=4096:4096"]\n'
        '[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\n'
    )
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}
    compose = [_venv_tool("podman-compose") or "podman-compose"]
    built = subprocess.run(
        ["podman", "build", "--format", "docker", "--network", "host", "-f", "container/mosquitto/Containerfile",
         "-t", "localhost/edge-queue-mosquitto:local", "."],
        cwd=project, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-2000:]
    config = subprocess.run([*compose, "config"], cwd=project, env=env, capture_output=True, text=True, timeout=60)
    assert config.returncode == 0 and "mosquitto" in config.stdout, config.stderr
    up = subprocess.run([*compose, "up", "-d"], cwd=project, env=env, capture_output=True, text=True, timeout=300)
    try:
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
        port = ports["MQTT_PORT"]
        login = ["-h", "127.0.0.1", "-p", str(port), "-u", "phone", "-P", "pw-phone-9c1d"]

        def online() -> bool:
            got = subprocess.run(
                ["mosquitto_sub", *login, "-t", "edge-queue/status", "-C", "1", "-W", "3"],
                capture_output=True, text=True, timeout=10,
            )  # fmt: skip
            return got.stdout.strip() == "online"

        wait_until(online, 90, "edge-queue online through compose's mosquitto")
        job: dict[str, Any] = {}
        with subprocess.Popen(
            ["mosquitto_sub", *login, "-v", "-t", "edge-queue/jobs/+", "-W", "120"], stdout=subprocess.PIPE, text=True
        ) as sub:
            time.sleep(0.5)  # mosquitto_sub has subscribed (a retained state would come anyway)
            subprocess.run(
                ["mosquitto_pub", *login, "-q", "1", "-t", "edge-queue/request/submit/phone", "-m", "/media/jfk.flac"],
                check=True, timeout=10,
            )  # fmt: skip
            assert sub.stdout is not None
            for line in sub.stdout:
                job = json.loads(line.split(" ", 1)[1])
                if job["state"] in ("succeeded", "failed"):
                    break
            sub.kill()
        assert job["state"] == "succeeded" and job["submitted_by"] == "phone" and "Americans" in job["result"]["text"]
        page = subprocess.run(
            ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", f"http://127.0.0.1:{ports['PAGE_PORT']}/"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
        assert page.stdout == "200"
    finally:
        subprocess.run([*compose, "down", "-v", "-t", "30"], cwd=project, env=env, capture_output=True, timeout=300)


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=check)


def _dockerd_answers() -> bool:
    return docker("info", timeout=30, check=False).returncode == 0


@pytest.fixture(scope="module")
def dockerd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A Docker daemon: the one running, else one started here as docs/install.md says for a box
    without iptables or a bridge (``dockerd --storage-driver vfs --iptables=false
    --ip6tables=false --bridge=none``), stopped after the module."""
    for tool in ("docker", "dockerd"):
        need(shutil.which(tool) is not None, f"{tool} is not installed (apt-get install docker.io)")
    need(os.geteuid() == 0, "dockerd needs root")
    if _dockerd_answers():
        yield
        return
    log = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["dockerd", "--storage-driver", "vfs", "--iptables=false", "--ip6tables=false", "--bridge=none"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        end = time.monotonic() + 60
        while proc.poll() is None and not _dockerd_answers() and time.monotonic() < end:
            time.sleep(0.5)
        need(proc.poll() is None and _dockerd_answers(), f"dockerd cannot run here: {log.read_text()[-1500:]}")
        yield
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.fixture(scope="module")
def docker_image(dockerd: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The image, built with Docker by ``PODMAN=docker container/build.sh`` from a clean clone
    of this checkout's HEAD (the base image from Debian's packages, as for podman)."""
    for tool in ("debootstrap", "git"):
        need(shutil.which(tool) is not None, f"{tool} is not installed (apt-get install debootstrap git)")
    need(port_open(*SYSTEM_MQTT), "no mosquitto at 127.0.0.1:1883")
    clone = tmp_path_factory.mktemp("docker-clone") / "edge-queue"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    tag = f"edge-queue-test:{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PODMAN": "docker", "EDGE_QUEUE_BASE": "debootstrap"}
    t0 = time.monotonic()
    built = subprocess.run(
        [str(clone / "container" / "build.sh"), tag], env=env, capture_output=True, text=True, timeout=3600
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    assert not (clone / "container" / "pip-cert" / "ca.pem").exists()  # the CA bundle went back out
    size = json.loads(docker("image", "inspect", tag).stdout)[0]["Size"]
    print(f"image {tag} (docker): built in {time.monotonic() - t0:.0f} s, {size / 1e6:.0f} MB")
    yield tag
    docker("rmi", "-f", tag, check=False)


def test_docker_builds_the_image_and_runs_a_transcription(docker_image: str, tmp_path: Path, speech: Path) -> None:
    config = json.loads(docker("image", "inspect", docker_image).stdout)[0]["Config"]
    assert config["User"] == "edge-queue" and "edge-queue-healthcheck" in " ".join(config["Healthcheck"]["Test"])
    # nothing of the install stage (the sources, the build's CA bundle) is in the image
    assert docker("run", "--rm", "--entrypoint", "ls", docker_image, "/src", check=False).returncode != 0
    media = tmp_path / "media"
    media.mkdir()
    shutil.copy(speech / "jfk.flac", media / "jfk.flac")
    for p in (tmp_path, media):
        os.chmod(p, 0o755)
    base = "eqd" + uuid.uuid4().hex[:8]
    env = {
        "EDGE_QUEUE_MQTT__BASE_TOPIC": base,
        "EDGE_QUEUE_MQTT__CLIENT_ID": base,
        "EDGE_QUEUE_HOMEASSISTANT__DISCOVERY": "false",
        "EDGE_QUEUE_API__PORT": str(_free_port()),
        "EDGE_QUEUE_HTTP__PORT": str(_free_port()),
    }
    name, volume = f"eqtest-{uuid.uuid4().hex[:8]}", f"eqtest-{uuid.uuid4().hex[:8]}"
    flags = [f"--env={k}={v}" for k, v in env.items()]
    w = Watcher(*SYSTEM_MQTT, [f"{base}/status", f"{base}/jobs/+"])
    try:
        t0 = time.monotonic()
        docker(
            "run", "-d", "--name", name, "--network", "host", "--stop-timeout", "30", *flags,
            "-v", f"{volume}:/data", "-v", f"{media}:/media:ro", docker_image, "serve",
        )  # fmt: skip
        wait_until(lambda: b"online" in w.on(f"{base}/status"), 60, "the container online")
        print(f"docker run -> online: {time.monotonic() - t0:.1f} s")
        transcribes_jfk(w, base)
        docker("stop", "-t", "30", name, timeout=60)
        wait_until(lambda: w.on(f"{base}/status")[-1:] == [b"offline"], 30, "offline on stop")
    finally:
        w.close()
        docker("rm", "-f", name, check=False, timeout=60)
        docker("volume", "rm", "-f", volume, check=False)
        _clear(base)


def _venv_tool(name: str) -> str | None:
    path = Path(sys.executable).parent / name  # the venv's own, beside its python
    return str(path) if path.exists() else None
