"""The Home Assistant add-on's image (addon/edge-queue/), built as the Supervisor builds it: its
folder the only build context, ``BUILD_FROM`` a Debian bookworm image and ``BUILD_VERSION``
config.yaml's version (the Supervisor's build arguments), and edge-queue's source tarball from
``SOURCE_URL``. No registry and no GitHub can be reached here: the base is Debian
bookworm built from Debian's packages (container/debian-base.sh; Home Assistant's
``base-debian:bookworm`` is that with s6-overlay and bashio), and the source is this checkout's
HEAD as GitHub serves a tag's tarball (``git archive``, one ``edge-queue-<version>/`` folder),
on a local HTTP server. Then the image runs with /data/options.json and the Supervisor's
answers (tests/helpers/supervisor.py), as tests/test_addon_start.py runs its start outside it.

Locally without podman, debootstrap or root the tests skip with the reason; under ``CI=true``
they fail.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import ROOT, descendants, need, port_open, wait_until
from .helpers.brokers import PrivateMosquitto
from .helpers.figures import figures
from .helpers.podman import LIMITS, PODMAN, podman, run_container
from .helpers.ports import free_port
from .helpers.supervisor import FakeSupervisor

#: the first test builds the image (pip's install of about 1 GB: minutes, more under load)
pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.container, pytest.mark.timeout(2400)]

ADDON = ROOT / "addon" / "edge-queue"
#: the Debian bookworm image container/debian-base.sh makes (the name container/build.sh starts from)
BASE = "docker.io/library/debian:bookworm-slim"
VERSION = yaml.safe_load((ADDON / "config.yaml").read_text())["version"]
#: The Supervisor's MQTT service user (what it hands the add-on) and a Home Assistant user's
#: login, as the Mosquitto add-on takes both; it takes no client without a login.
SERVICE_LOGIN = ("addons", "supervisor-made-secret")
PERSON_LOGIN = ("phone", "phone-secret")


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *a: Any) -> None:
        pass


@pytest.fixture(scope="module")
def source_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """This checkout's HEAD as GitHub serves the tag ``v<version>``'s source (``git archive``,
    everything under ``edge-queue-<version>/``), on a local HTTP server: its address."""
    need(shutil.which("git") is not None, "git is not installed")
    folder = tmp_path_factory.mktemp("source")
    name = f"v{VERSION}.tar.gz"
    subprocess.run(
        ["git", "archive", "--format=tar.gz", f"--prefix=edge-queue-{VERSION}/", "-o", str(folder / name), "HEAD"],
        cwd=ROOT, check=True, timeout=120,
    )  # fmt: skip
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(folder)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/{name}"
    httpd.shutdown()
    httpd.server_close()


def build_addon(context: Path, tag: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``podman build`` of the add-on folder ``context`` as the Supervisor builds it (the folder
    the only context), on :data:`BASE`, with the further build ``args``."""
    return podman(
        "build", "--format", "docker", "--network", "host", "--force-rm", *LIMITS, "--build-arg", f"BUILD_FROM={BASE}",
        *args, "-t", tag, str(context), timeout=3600, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def addon_context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the add-on folder alone (nothing of the repository around it), with pip's CA
    bundle in ``pip-cert/ca.pem`` when pip has one here (a proxy that re-signs TLS); Debian
    bookworm's base image in podman."""
    for tool in ("podman", "runc", "debootstrap"):
        need(shutil.which(tool) is not None, f"{tool} is not installed (apt-get install podman runc debootstrap)")
    need(os.geteuid() == 0, "building the base image with debootstrap needs root")
    base = subprocess.run(
        [str(ROOT / "container" / "debian-base.sh")], env={**os.environ, "PODMAN": " ".join(PODMAN)},
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert base.returncode == 0, base.stderr[-3000:]
    context = tmp_path_factory.mktemp("addon") / "edge-queue"
    shutil.copytree(ADDON, context, ignore=shutil.ignore_patterns("*.pem", "__pycache__"))
    cert = (
        os.environ.get("PIP_CERT")
        or subprocess.run(
            ["python3", "-m", "pip", "config", "get", "global.cert"], capture_output=True, text=True, timeout=60
        ).stdout.strip()
    )
    if cert and Path(cert).is_file():
        shutil.copy(cert, context / "pip-cert" / "ca.pem")
    return context


@pytest.fixture(scope="module")
def addon_image(addon_context: Path, source_url: str) -> Iterator[str]:
    """The add-on's image, built from :func:`addon_context` with the Supervisor's build
    arguments and :func:`source_url` as ``SOURCE_URL``."""
    tag = f"localhost/edge-queue-addon-test:{uuid.uuid4().hex[:8]}"
    t0 = time.monotonic()
    built = build_addon(addon_context, tag, "--build-arg", f"BUILD_VERSION={VERSION}",
                        "--build-arg", f"SOURCE_URL={source_url}")  # fmt: skip
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    size = json.loads(podman("image", "inspect", tag).stdout)[0]["Size"]
    figures(addon_image_build_s=round(time.monotonic() - t0), addon_image_mb=round(size / 1e6))
    yield tag
    podman("rmi", "-f", tag, check=False)


def test_the_add_on_builds_from_its_folder_alone_at_its_version(
    addon_image: str, addon_context: Path, source_url: str
) -> None:
    run = ["run", "--rm", *LIMITS]
    version = podman(*run, "--entrypoint", "/opt/edge-queue/bin/edge-queue", addon_image, "--version").stdout
    assert version.split() == ["edge-queue", VERSION]
    config = json.loads(podman("image", "inspect", addon_image).stdout)[0]["Config"]
    assert config["Entrypoint"][:2] == ["/usr/bin/tini", "--"]  # whatever the base's entry point
    assert podman(*run, "--entrypoint", "id", addon_image, "edge-queue").stdout.startswith(
        "uid=1000(edge-queue) gid=1000(edge-queue)"
    )
    # nothing of the install stage (the sources, the build's CA bundle) is in the image
    assert podman(*run, "--entrypoint", "ls", addon_image, "/src", check=False).returncode != 0
    # a source that is not the add-on's version is refused, not installed
    tag = f"localhost/edge-queue-addon-test:{uuid.uuid4().hex[:8]}"
    other = build_addon(addon_context, tag, "--build-arg", "BUILD_VERSION=0.0.1",
                        "--build-arg", f"SOURCE_URL={source_url}")  # fmt: skip
    podman("rmi", "-f", tag, check=False)
    assert other.returncode != 0 and f"{source_url} is not edge-queue 0.0.1" in other.stderr + other.stdout


@pytest.fixture
def login_ws_mosquitto(tmp_path: Path) -> Iterator[PrivateMosquitto]:
    """A private mosquitto as the Mosquitto add-on is: no client without a login (users
    :data:`SERVICE_LOGIN` and :data:`PERSON_LOGIN`), and a WebSocket listener."""
    need(shutil.which("mosquitto_passwd") is not None, "mosquitto_passwd not installed (apt-get install mosquitto)")
    passwd = tmp_path / "mosquitto.passwd"
    for i, (user, password) in enumerate((SERVICE_LOGIN, PERSON_LOGIN)):
        subprocess.run(["mosquitto_passwd", *(["-c"] if i == 0 else []), "-b", str(passwd), user, password], check=True)
    ws = free_port()
    extra = f"allow_anonymous false\npassword_file {passwd}\nlistener {ws}\nprotocol websockets\n"
    broker = PrivateMosquitto(tmp_path / "mosquitto", extra=extra)
    broker.ws_port = ws  # type: ignore[attr-defined]
    wait_until(lambda: port_open("127.0.0.1", ws), 10, "the WebSocket listener")
    yield broker
    if broker.proc is not None and broker.proc.poll() is None:
        broker.stop()


def uid_gid(pid: int) -> tuple[int, int] | None:
    """The real uid and gid of ``pid`` (``/proc/<pid>/status``), or None when it has ended."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return None
    fields = {line.split(":")[0]: line.split()[1:] for line in status.splitlines() if line.startswith(("Uid", "Gid"))}
    return int(fields["Uid"][0]), int(fields["Gid"][0])


def final_job(login: list[str]) -> dict[str, Any] | None:
    """The retained job on ``edge-queue/jobs/+`` once it is final, else None."""
    got = subprocess.run(
        ["mosquitto_sub", *login, "-t", "edge-queue/jobs/+", "-C", "1", "-W", "3"],
        capture_output=True, text=True, timeout=10,
    )  # fmt: skip
    job: dict[str, Any] = json.loads(got.stdout) if got.stdout.strip() else {}
    return job if job.get("state") in ("succeeded", "failed") else None


def test_the_home_assistant_add_on(
    addon_image: str, containers: list[str], tmp_path: Path, login_ws_mosquitto: Any, speech: Path
) -> None:
    """The add-on's image with /data/options.json as the Supervisor writes it and the
    Supervisor's MQTT service (a broker that takes no client without a login, as the Mosquitto
    add-on): the settings it makes, the service as uid 1000, a recording transcribed, then the
    queue page as ingress serves it, in Chromium, its MQTT through the page's own WebSocket relay
    with a person's login."""
    from .helpers.page import Browser, browser_ready

    ws_mosquitto = login_ws_mosquitto
    data = tmp_path / "addon-data"
    media = tmp_path / "media"
    data.mkdir()
    media.mkdir()
    shutil.copy(speech / "jfk.flac", media / "jfk.flac")
    for p in (tmp_path, media):
        os.chmod(p, 0o755)
    os.chmod(media / "jfk.flac", 0o644)
    options = {
        "media_roots": ["/media", "/share"],
        "workers": 1,
        "log_level": "INFO",
        "api_anonymous_user": "",
        "api_keys": [{"user": "bazarr", "key": "0123456789abcdef0123456789abcdef"}],
        "mqtt_host": "",
        "mqtt_port": 1883,
        "mqtt_username": "",
        "mqtt_password": "",
        "mqtt_websocket_port": ws_mosquitto.ws_port,
    }
    (data / "options.json").write_text(json.dumps(options))
    token = uuid.uuid4().hex
    supervisor = FakeSupervisor(ws_mosquitto, token, login=SERVICE_LOGIN)
    page_port = free_port()
    env = {
        "SUPERVISOR_TOKEN": token,
        "SUPERVISOR_API": supervisor.url,
        "ADDON_PAGE_PORT": str(page_port),
        "EDGE_QUEUE_API__PORT": str(free_port()),
    }
    flags = [f"--env={k}={v}" for k, v in env.items()]
    mounts = ["-v", f"{data}:/data", "-v", f"{media}:/media"]
    login = ["-h", ws_mosquitto.host, "-p", str(ws_mosquitto.port), "-u", PERSON_LOGIN[0], "-P", PERSON_LOGIN[1]]
    try:
        printed = podman("run", "--rm", "--network", "host", *LIMITS, *flags, *mounts, addon_image, "--print").stdout
        made = json.loads(printed)
        assert made["EDGE_QUEUE_MQTT__HOST"] == ws_mosquitto.host
        assert made["EDGE_QUEUE_MQTT__PORT"] == str(ws_mosquitto.port)
        assert made["EDGE_QUEUE_MEDIA_ROOTS"] == '["/media"]'  # /share is not mapped here
        assert made["EDGE_QUEUE_HTTP__WEBSOCKET_PROXY"] == "true"
        assert made["EDGE_QUEUE_HTTP__FRAME_ANCESTORS"] == "[\"'self'\"]"
        assert made["EDGE_QUEUE_API__KEYS"] == "***"
        t0 = time.monotonic()
        name = run_container(addon_image, containers, *mounts, env=env, command=[])
        wait_until(lambda: _answers(page_port), 60, "the add-on's page")
        online = subprocess.run(
            ["mosquitto_sub", *login, "-t", "edge-queue/status", "-C", "1", "-W", "60"],
            capture_output=True, text=True, timeout=70,
        )  # fmt: skip
        assert online.stdout.strip() == "online"
        figures(addon_start_to_online_s=round(time.monotonic() - t0, 1))
        # the service runs as uid and gid 1000 under the image's init (tini, root, pid 1)
        init = int(podman("inspect", "-f", "{{.State.Pid}}", name).stdout)
        ids = {pid: uid_gid(pid) for pid in descendants(init)}
        assert ids and all(v == (1000, 1000) for v in ids.values() if v is not None), ids
        assert {p.stat().st_uid for p in (data / "edge-queue").iterdir()} == {1000}
        # a person's recording, submitted with mosquitto_pub, is transcribed in the add-on
        subprocess.run(
            ["mosquitto_pub", *login, "-q", "1", "-t", "edge-queue/request/submit", "-m", "/media/jfk.flac"],
            check=True, timeout=10,
        )  # fmt: skip
        job = wait_until(lambda: final_job(login), 180, "the job final")
        assert job["state"] == "succeeded" and "Americans" in job["result"]["text"], job
        browser_ready()
        b = Browser(tmp_path / "browser.log")
        try:
            b.do("goto", url=f"http://127.0.0.1:{page_port}/")
            # the broker asks for a login, through the relay, and takes a person's
            b.wait("document.querySelector('#login').open", timeout=60)
            b.do("fill", selector="#user", value=PERSON_LOGIN[0])
            b.do("fill", selector="#password", value=PERSON_LOGIN[1])
            b.do("click", selector="#login-ok")
            b.wait("page.connected && page.online === true", timeout=60)
            assert b.eval("wsUrl()") == f"ws://127.0.0.1:{page_port}/mqtt"
            csp = b.eval("fetch('config.json').then(r => r.headers.get('content-security-policy'))")
            assert "frame-ancestors 'self'" in csp
        finally:
            b.close()
    finally:
        supervisor.close()


def _answers(port: int) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/config.json", timeout=2):
            return True
    except OSError:
        return False
