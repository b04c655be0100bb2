"""What the Home Assistant tests share: a real Home Assistant Core (through
``../shared/tools/homeassistant/ha_harness.py``) on a mosquitto of its own, one for a row of
tests that use it (the ``ha`` fixture: a start takes 10-20 s), into which each test loads its
own automations, scripts and MQTT sensors (``reload_yaml``); edge-queue services with discovery
on, and waiting on Home Assistant's states."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from .conftest import ROOT, Broker, ServiceProcess, need, wait_until
from .helpers.ha_docs import EXTRA_YAML
from .helpers.ports import free_port

#: The marks of every test file that runs the real Home Assistant.
HOME_ASSISTANT_MARKS = [
    pytest.mark.homeassistant,
    pytest.mark.slow,
    # one Home Assistant (the harness's configuration folder), started within the harness's own
    # time limits: alone, after the parallel part of the suite
    pytest.mark.serial,
    # the harness (a shared tool, not ours) leaves its subprocess pipes to the garbage collector
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

HARNESS = ROOT.parent / "shared" / "tools" / "homeassistant"

#: Every entity edge-queue declares, by the key its unique_id ends with.
KEYS = [
    "queued",
    "running",
    "retrying",
    "failed",
    "succeeded",
    "cancelled",
    "current_job",
    "current_progress",
    "last_result",
    "job_finished",
    "paused",
    "cancel_current",
    "retry_failed",
    "republish",
    "submit",
    "submit_result",
    "version",
    "started",
    "workers_alive",
    "workers_problem",
    "store_size",
    "disk_free",
    "conflict",
    "diagnostics",
]


#: The files docs/home-assistant.md's reader has Home Assistant include (``EXTRA_YAML``), empty
#: until a test writes its own and loads them (:func:`reload_yaml`).
INCLUDED = {"automations.yaml": "[]\n", "scripts.yaml": "{}\n", "edge_queue_mqtt.yaml": "{}\n"}
#: The file in its configuration folder that is appended to ``configuration.yaml`` at each start.
EXTRA = "extra.yaml"


def harness() -> Any:
    """The harness's module, once its Home Assistant is set up (else the test skips locally,
    fails under CI=true)."""
    need((HARNESS / "ha_harness.py").is_file(), f"no Home Assistant harness in {HARNESS}")
    if str(HARNESS) not in sys.path:
        sys.path.insert(0, str(HARNESS))
    import ha_harness as h

    need(h.venv_exists(), "Home Assistant is not set up: python3 ../shared/tools/homeassistant/ha_harness.py setup")
    return h


@contextmanager
def home_assistant() -> Iterator[tuple[Any, dict[str, Any], Broker]]:
    """A real Home Assistant Core with its MQTT integration on a broker of its own, in a fresh
    configuration folder of this checkout's own (two checkouts on one machine do not share one),
    configured as docs/home-assistant.md's reader has it (``EXTRA_YAML``: the included
    automations, scripts and MQTT sensors, empty; the phone's notify group)."""
    h = harness()
    need(shutil.which("mosquitto") is not None, "mosquitto not installed")
    config = Path(f"{h.DEFAULT_CONFIG}-{ROOT.name}")
    if (config / "harness.json").exists():  # one left running by an interrupted session
        h.stop(h.load(config))
    shutil.rmtree(config, ignore_errors=True)
    config.mkdir(parents=True)
    for name, text in INCLUDED.items():
        (config / name).write_text(text)
    # zeroconf: loaded on every real install (default_config has it), so the Wyoming listener's
    # mDNS announcement is discovered (tests/test_homeassistant_voice.py)
    (config / EXTRA).write_text(EXTRA_YAML + "\nzeroconf:\n")
    port = free_port()
    h.broker_start(port)
    try:
        extra, http_port = str(config / EXTRA), free_port()
        inst = h.start(broker_host="127.0.0.1", broker_port=port, config=config, http_port=http_port, extra_yaml=extra)
    except BaseException:
        h.broker_stop(port)
        raise
    try:
        yield h, inst, Broker("127.0.0.1", port, "mosquitto")
    finally:
        h.stop(inst)
        h.broker_stop(port)


class SharedHomeAssistant:
    """The one Home Assistant of a test session (a start takes 10-20 s): started by the first
    test that asks for it, stopped after the last one of a row of tests that use it
    (``pytest_runtest_teardown``), so that the tests after them run without it."""

    def __init__(self) -> None:
        self.stack = ExitStack()
        self.found: tuple[Any, dict[str, Any], Broker] | None = None

    def get(self) -> tuple[Any, dict[str, Any], Broker]:
        """The running one, started first if none runs."""
        if self.found is None:
            self.found = self.stack.enter_context(home_assistant())
        return self.found

    def close(self) -> None:
        """Stop it and its broker, if they run."""
        self.found = None
        self.stack.close()


SHARED = SharedHomeAssistant()


@pytest.fixture
def ha() -> tuple[Any, dict[str, Any], Broker]:
    """``(ha_harness, instance, broker)``: the session's real Home Assistant Core (the harness
    module, its state as ``ha_harness.start`` returns it, its own mosquitto). A test leaves it
    running, on its broker; what it configured stays until the next test loads its own."""
    return SHARED.get()


def pytest_sessionfinish() -> None:
    """Home Assistant stops at the end of an interrupted session too."""
    SHARED.close()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the test's own teardown: Home Assistant stops when the next test does not use it."""
    if nextitem is None or "ha" not in getattr(nextitem, "fixturenames", ()):
        SHARED.close()


def restart_home_assistant(h: Any, inst: dict[str, Any]) -> None:
    """Stop Home Assistant and start it again on the same configuration (``inst`` is updated)."""
    h.stop(inst)
    inst.update(
        h.start(
            broker_host="127.0.0.1",
            broker_port=inst["broker_port"],
            config=inst["config"],
            http_port=inst["http_port"],
            extra_yaml=str(Path(inst["config"]) / EXTRA),
        )
    )


def reload_yaml(h: Any, inst: dict[str, Any]) -> None:
    """Home Assistant reads its automations (and their blueprints), scripts and MQTT sensors
    again, as the reader of docs/home-assistant.md does after editing them (Developer tools,
    YAML), and dismisses every notification: a test's own configuration, loaded without the
    10-20 s of a restart."""
    for domain in ("automation", "script", "mqtt"):
        h.call_service(inst, domain, "reload")
    h.call_service(inst, "persistent_notification", "dismiss_all")


def service(broker: Broker, tmp: Path, media: list[Path], name: str, base: str | None = None) -> ServiceProcess:
    """An edge-queue with discovery on and its default client id, its store in ``tmp/name``
    (beside ``tmp`` when that is a media root)."""
    svc = ServiceProcess(broker, tmp, media)
    svc.env.pop("EDGE_QUEUE_MQTT__CLIENT_ID", None)  # the default: edge-queue-<instance id>-<secret>
    svc.env["EDGE_QUEUE_HOMEASSISTANT__DISCOVERY"] = "true"
    svc.data_dir = tmp / name
    if any(svc.data_dir.is_relative_to(root) for root in media):  # serve refuses a data_dir in a media root
        svc.data_dir = tmp.parent / f"{tmp.name}-{name}"
    svc.env["EDGE_QUEUE_DATA_DIR"] = str(svc.data_dir)
    if base is not None:
        svc.base = base
        svc.env["EDGE_QUEUE_MQTT__BASE_TOPIC"] = base
    return svc


def instance_id(svc: ServiceProcess) -> str:
    w = svc.watcher("info")
    try:
        return str(w.wait_json(f"{svc.base}/info", lambda m: True)["instance_id"])
    finally:
        w.close()


def entities(h: Any, inst: dict[str, Any], iid: str, keys: list[str] = KEYS) -> dict[str, str]:
    """key -> entity_id of every entity of the installation, waiting (up to 30 s) for discovery
    and for each to be available: Home Assistant has subscribed to its topics (an entity in the
    registry may not have yet; a message then would be missed)."""
    wanted = {f"edge_queue_{iid}_{key}": key for key in keys}
    found: dict[str, str] = {}

    def all_available() -> bool:
        for entry in h.ws_call(inst, "config/entity_registry/list"):
            if entry.get("unique_id") in wanted:
                found[wanted[entry["unique_id"]]] = entry["entity_id"]
        if len(found) < len(wanted):
            return False
        states = {s["entity_id"]: s["state"] for s in h.states(inst)}
        return all(states.get(eid) not in (None, "unavailable") for eid in found.values())

    try:
        wait_until(all_available, 30, f"the entities of edge-queue {iid}, available", interval=0.2)
    except AssertionError as err:
        missing = sorted(unique_id for unique_id, key in wanted.items() if key not in found)
        raise AssertionError(f"{err}: no entity with unique_id {missing}; found {found}") from None
    return found


def state_of(h: Any, inst: dict[str, Any], eid: str) -> str:
    s = h.state(inst, eid)
    return "" if s is None else str(s["state"])


def wait_state(
    h: Any, inst: dict[str, Any], eid: str, pred: Callable[[str, dict[str, Any]], Any], what: str, timeout: float = 60
) -> dict[str, Any]:
    """Wait until ``pred(state, attributes)`` holds for ``eid``; returns its state object."""
    return wait_until(
        lambda: (s := h.state(inst, eid)) is not None and pred(s["state"], s.get("attributes") or {}) and s,
        timeout,
        what,
        interval=0.2,
    )


class Events:
    """Home Assistant's events of one type (a WebSocket subscription), collected by a thread of
    its own: ``state_changed`` (keep those of ``entity_id``), ``call_service``, ..."""

    def __init__(self, h: Any, inst: dict[str, Any], event_type: str, entity_id: str | None = None) -> None:
        self.entity_id = entity_id
        self.items: list[dict[str, Any]] = []
        self.ws = h.WS("127.0.0.1", inst["http_port"], inst["token"])
        self.ws.call("subscribe_events", event_type=event_type)
        self.ws.sock.settimeout(None)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                data = (self.ws.recv().get("event") or {}).get("data") or {}
                if self.entity_id is None:
                    self.items.append(data)
                elif data.get("entity_id") == self.entity_id and data.get("new_state"):
                    self.items.append(data["new_state"])
        except (OSError, ConnectionError, ValueError):
            pass

    def close(self) -> None:
        self.ws.close()


class StateChanges(Events):
    """The new states of one entity, as Home Assistant announces them."""

    def __init__(self, h: Any, inst: dict[str, Any], entity_id: str) -> None:
        super().__init__(h, inst, "state_changed", entity_id)
        self.states = self.items


#: Why a Home Assistant integration's requirements could not be installed, by integration.
_UNINSTALLABLE: dict[str, str] = {}


def integration_requirements(h: Any, domain: str) -> None:
    """Install the requirements of one of Home Assistant's integrations (its ``manifest.json``,
    pinned by Home Assistant's ``package_constraints.txt``) into the harness's Home Assistant,
    which runs with ``--skip-pip`` and installs only those of its default integrations and
    MQTT: once (idempotent; a second call only reads the installed versions), with the
    runtime's own pip from PyPI, as ``ha_harness.py setup`` installs them. Skips the test
    locally, fails it under CI=true, when they cannot be installed."""
    if domain not in _UNINSTALLABLE:
        _UNINSTALLABLE[domain] = _install_requirements(h, domain)
    need(not _UNINSTALLABLE[domain], _UNINSTALLABLE[domain])


#: Run by Home Assistant's own Python: the requirements of an integration and of the
#: integrations it depends on that are not installed at their pinned version (a JSON list),
#: and the path of Home Assistant's pins.
_MISSING_REQUIREMENTS = r"""
import json, pathlib, sys, homeassistant, importlib.metadata as md
here = pathlib.Path(homeassistant.__file__).parent
todo, seen, reqs = {sys.argv[1]}, set(), set()
while todo:
    domain = todo.pop()
    seen.add(domain)
    manifest = json.loads((here / "components" / domain / "manifest.json").read_text())
    reqs.update(manifest.get("requirements", []))
    todo.update(set(manifest.get("dependencies", [])) - seen)
def installed(req):
    name, _, version = req.partition("==")
    try:
        return md.version(name.split("[")[0]) == version
    except md.PackageNotFoundError:
        return False
print(json.dumps([sorted(r for r in reqs if not installed(r)), str(here / "package_constraints.txt")]))
"""


def _install_requirements(h: Any, domain: str) -> str:
    """``""`` once installed, else why not."""
    try:
        out = subprocess.run(
            h.rt_cmd([h.venv_py(), "-c", _MISSING_REQUIREMENTS, domain]),
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        missing, constraints = json.loads(out)
        if missing:
            pip = [h.venv_py(), "-m", "pip", "--disable-pip-version-check", "install", "-q", "-c", constraints]
            run = ["nice", "-n", "10", *h.rt_cmd([*pip, *missing])]
            subprocess.run(run, capture_output=True, text=True, check=True, timeout=600)
    except (OSError, ValueError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", None) or err
        return f"the requirements of Home Assistant's {domain} integration cannot be installed: {detail}"
    return ""
