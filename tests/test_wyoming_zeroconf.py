"""The Wyoming listener announced by mDNS (docs/home-assistant.md, "Voice (Assist)";
``wyoming.zeroconf``), seen as Home Assistant sees it: a python-zeroconf ``ServiceBrowser`` for
``_wyoming._tcp.local.`` (Home Assistant's zeroconf integration browses with that library for
the types its integrations' manifests name) finds the service with the box's LAN address and the
listener's port, ``describe`` at that address is answered, and the goodbye at stop removes it.
A listener on loopback, or with ``wyoming.zeroconf = false``, is not announced.

The listener is the real one, in this process, on a free port; commands are not its concern here.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from wyoming.client import AsyncTcpClient
from wyoming.event import Event
from wyoming.info import Info
from zeroconf import ServiceBrowser, ServiceListener, Zeroconf

from edge_queue.config.settings import Settings
from edge_queue.voice.mdns import SERVICE_TYPE, announced_address, announcement, instance_name
from edge_queue.voice.server import VoiceServer

from .conftest import need, wait_until
from .helpers.ports import free_port

#: Seconds for an announcement to be seen: python-zeroconf probes three times 250 ms apart
#: and announces; a loaded box may take a few seconds more.
SEEN_S = 15.0


class NoCommands:
    """The loop's side: never reached by these tests."""

    def transcribe(self, wav: Path, language: str | None) -> tuple[Future[dict[str, Any]], Future[dict[str, Any]]]:
        raise AssertionError("no command is sent here")

    def cancel(self, job_id: str) -> None:
        raise AssertionError("no command is sent here")


class Seen(ServiceListener):
    """What a browser has seen of ``_wyoming._tcp.local.``: name -> (addresses, port), and the
    names removed."""

    def __init__(self) -> None:
        self.services: dict[str, tuple[list[str], int | None]] = {}
        self.removed: set[str] = set()
        self.lock = threading.Lock()

    def add_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        info = zc.get_service_info(type_, name, timeout=3000)
        with self.lock:
            if info is not None:
                self.services[name] = (info.parsed_addresses(), info.port)
            self.removed.discard(name)

    def update_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        self.add_service(zc, type_, name)

    def remove_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        with self.lock:
            self.removed.add(name)


@pytest.fixture
def browser() -> Iterator[Seen]:
    zc = Zeroconf()
    seen = Seen()
    ServiceBrowser(zc, SERVICE_TYPE, seen)
    yield seen
    zc.close()


def listener(tmp_path: Path, instance_id: str = "", **wyoming: Any) -> VoiceServer:
    config = {"enabled": True, "host": "0.0.0.0", "port": free_port(), **wyoming}
    settings = Settings(data_dir=tmp_path, wyoming=config, mqtt={"base_topic": "eq-zc"})
    server = VoiceServer(settings, NoCommands(), instance_id)
    server.start()
    return server


async def describe(host: str, port: int) -> Info:
    async with AsyncTcpClient(host, port) as client:
        await client.write_event(Event("describe"))
        event = await asyncio.wait_for(client.read_event(), 5)
        assert event is not None
        return Info.from_event(event)


def test_home_assistant_s_browser_finds_the_listener_and_loses_it_at_stop(tmp_path: Path, browser: Seen) -> None:
    lan = announced_address("0.0.0.0")
    need(lan is not None, "no interface with a route to the mDNS group (224.0.0.251): nothing to announce on")
    server = listener(tmp_path, "3f7c9a1e5b2d")
    try:
        assert server.announcement is not None and server.port is not None
        name = server.announcement.name
        assert name == f"{instance_name(server.settings, '3f7c9a1e5b2d')}._wyoming._tcp.local.", name
        assert name.startswith(f"edge-queue {socket.gethostname()} eq-zc 3f7c9a"), name
        wait_until(lambda: name in browser.services, SEEN_S, "the announcement seen by a browser")
        assert browser.services[name] == ([lan], server.port)
        # what Home Assistant's config flow does next: describe at the discovered address
        assert lan is not None
        info = asyncio.run(describe(lan, server.port))
        assert [p.name for p in info.asr] == ["edge-queue"]
    finally:
        server.stop()
    wait_until(lambda: name in browser.removed, SEEN_S, "the goodbye seen by the browser")


def test_two_installations_of_one_device_name_are_two_services(tmp_path: Path, browser: Seen) -> None:
    """Two boxes of the same host name (``raspberrypi``) and base topic: their installations'
    ids make two names (mDNS's own probe is not relied on: a host that did not answer it, or
    a name announced first from another process, went undetected)."""
    need(announced_address("0.0.0.0") is not None, "no interface with a route to the mDNS group")
    first = listener(tmp_path / "a", "aaaaaa000001")
    second = listener(tmp_path / "b", "bbbbbb000002")
    try:
        assert first.announcement is not None and second.announcement is not None
        wait_until(
            lambda: {p for _, p in browser.services.values()} >= {first.port, second.port},
            SEEN_S,
            "both listeners seen",
        )
        assert first.announcement.name != second.announcement.name
    finally:
        first.stop()
        second.stop()


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "::ffff:127.0.0.1"])
def test_a_listener_on_loopback_is_not_announced(tmp_path: Path, host: str) -> None:
    settings = Settings(data_dir=tmp_path, wyoming={"enabled": True, "host": host})
    assert announced_address(host) is None
    assert announcement(settings, 10300) is None


def test_the_announced_address_is_the_listener_s_own() -> None:
    assert announced_address("192.0.2.77") == "192.0.2.77"
    assert announced_address("::ffff:192.0.2.77") == "192.0.2.77"
    assert announced_address("2001:db8::1") is None  # IPv4 only: what Home Assistant's flow connects to
    lan = announced_address("0.0.0.0")
    assert lan is None or not lan.startswith("127.")


def test_zeroconf_off_announces_nothing(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, wyoming={"enabled": True, "host": "192.0.2.77", "zeroconf": False})
    assert announcement(settings, 10300) is None


def test_the_instance_name_is_the_device_s_and_the_installation_s_within_a_dns_label(tmp_path: Path) -> None:
    host = socket.gethostname()  # as the Home Assistant device's name has it
    assert instance_name(Settings(data_dir=tmp_path)) == f"edge-queue {host}"[:63].strip()
    assert instance_name(Settings(data_dir=tmp_path), "3f7c9a1e5b2d") == f"edge-queue {host}"[:56].strip() + " 3f7c9a"
    named = Settings(data_dir=tmp_path, homeassistant={"name": "Küche " * 10})
    for name in (instance_name(named), instance_name(named, "3f7c9a1e5b2d")):
        assert len(name.encode()) <= 63 and name.startswith("Küche"), name
    assert instance_name(named, "3f7c9a1e5b2d").endswith(" 3f7c9a")
