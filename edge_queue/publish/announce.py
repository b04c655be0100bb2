"""What the service says about itself: ``<base>/status``, the retained ``<base>/info``, Home
Assistant's discovery config, and other installations announcing themselves on our base
topic (docs/topics.md, "`<base>/info`"; docs/home-assistant.md).
"""

from __future__ import annotations

import json
import logging
import socket
import sqlite3
import time
from collections.abc import Callable
from typing import Any

from edge_queue import package_version
from edge_queue.config.settings import Settings
from edge_queue.http.page import PageServer
from edge_queue.mqtt import payloads
from edge_queue.mqtt.bridge import Bridge
from edge_queue.mqtt.instance import describe
from edge_queue.mqtt.topics import ONLINE, Topics
from edge_queue.store import Store, iso

from . import discovery, ha_diagnostics
from .ha_finished import FinishedJobs

log = logging.getLogger(__name__)


class Announcer:
    """The service's own retained messages and the conflicts it sees.

    Args:
        settings: the validated configuration.
        topics: the installation's topic names.
        kinds: the kind registry (name -> kind class), for ``info``'s ``kinds``.
        bridge: where messages go.
        store: returns the open store (the discovery flag is kept there).
        watch_info: the ``watch`` entries of ``info``.
        page: returns the queue page's server, or None without one.
        started_at: when the service started (ISO 8601).
        nodes: the worker nodes' summary.
        finished: ``<base>/ha/finished`` (the publisher's, shared; a new one when None).
    """

    def __init__(
        self,
        settings: Settings,
        topics: Topics,
        kinds: dict[str, Any],
        bridge: Bridge,
        store: Callable[[], Store],
        watch_info: Callable[[], list[dict[str, Any]]],
        page: Callable[[], PageServer | None],
        started_at: str,
        nodes: Callable[[], list[dict[str, Any]]] = list,
        finished: FinishedJobs | None = None,
    ) -> None:
        self.settings, self.topics, self.kinds, self.bridge = settings, topics, kinds, bridge
        self.store, self.watch_info, self.page, self.nodes = store, watch_info, page, nodes
        self.started_at = started_at
        # <base>/ha/finished: what Home Assistant has not received (the publisher's, shared)
        self.finished = finished or FinishedJobs(bridge, topics, store)
        self.instance_id = ""  # the installation's id, from the store (set at boot)
        if settings.homeassistant.discovery:
            ha_diagnostics.install()  # the last warnings and errors, for <base>/ha/diagnostics
        #: other installations seen announcing themselves on our base topic: id -> their info
        self.conflicts: dict[str, dict[str, Any]] = {}

    def info(self) -> dict[str, Any]:
        """The retained ``<base>/info`` object (docs/topics.md, "`<base>/info`")."""
        page = self.page()
        return {
            "v": 1,
            "version": package_version(),
            "started_at": self.started_at,
            "base_topic": self.topics.base,
            "instance_id": self.instance_id,
            "host": socket.gethostname(),
            # always present, [] when alone: Home Assistant's templates warn of an absent key
            "conflict": list(self.conflicts.values()),
            "kinds": {  # the options' JSON Schemas: the kinds request
                name: {
                    "description": k.description,
                    "needs_input": k.needs_input,
                    "options": sorted(k.Options.model_fields),
                }
                for name, k in self.kinds.items()
            },
            "default_kind": self.settings.default_kind,
            "media_roots": [str(r) for r in self.settings.media_roots],
            **({"watch": self.watch_info()} if self.settings.watch else {}),
            "workers": self.settings.workers,
            "nodes": self.nodes(),
            "node_ids": sorted(self.settings.access.nodes),
            "broker_protocol": self.bridge.protocol_name,
            "http_port": page.port if page is not None else None,
        }

    def publish_info(self) -> None:
        self.bridge.publish(self.topics.info, payloads.encode(self.info()), retain=True)

    def connected(self) -> None:
        """A (re)connect: :meth:`announce`, and the finished runs Home Assistant has not got."""
        self.announce()
        if self.settings.homeassistant.discovery:
            self.finished.connected(self.bridge.protocol_name == "5")

    def announce(self, *, forget_conflicts: bool = False) -> None:
        """``online``, ``info`` and the Home Assistant config, retained: at every connect and
        at the start of a republish (``forget_conflicts``: :meth:`forget_conflicts` first)."""
        if forget_conflicts:
            self.forget_conflicts()
        self.bridge.publish(self.topics.status, ONLINE, retain=True)
        self.publish_info()
        self.publish_discovery()
        self.publish_ha_states()

    def publish_ha_states(self) -> None:
        """Home Assistant's own retained topics, from the store (with discovery on): every
        entity has a state at once after a restart of edge-queue, of the broker (a broker
        without persistence forgets retained messages) or of Home Assistant."""
        if not self.settings.homeassistant.discovery:
            return
        store = self.store()
        last = store.last_finished()
        body = discovery.last_payload(last) if last is not None else discovery.NO_LAST
        self.bridge.publish(discovery.last_topic(self.topics), payloads.encode(body), retain=True)
        submit = store.meta_text("ha_submit")
        self.bridge.publish(
            discovery.submit_topic(self.topics),
            submit.encode() if submit else payloads.encode(discovery.NO_SUBMIT),
            retain=True,
        )
        self.publish_diagnostics()

    def publish_diagnostics(self) -> None:
        """``<base>/ha/diagnostics`` (retained; :mod:`.ha_diagnostics`), with discovery on."""
        if not self.settings.homeassistant.discovery:
            return
        store = self.store()
        failed = [payloads.job_object(j) for j in store.list_jobs(state="failed", limit=ha_diagnostics.FAILED_MAX)]
        settings = self.settings.model_dump(mode="json")
        body = ha_diagnostics.payload(settings, self.info(), store.counts(), failed)
        self.bridge.publish(discovery.diagnostics_topic(self.topics), payloads.encode(body), retain=True)

    def submitted(self, request: bytes, response: dict[str, Any]) -> None:
        """The last submit a loop turn answered on the shared request topic (Home Assistant's
        "Submit" text and anyone else's): ``<base>/ha/submit`` (with discovery on), kept in the
        store for the next start."""
        if not self.settings.homeassistant.discovery:
            return
        body = payloads.encode(discovery.submit_payload(request, response, iso(time.time())))
        try:  # outside the turn's transaction (its commit may have failed: a full disk)
            self.store().set_meta_text("ha_submit", body.decode())
        except (sqlite3.Error, OSError) as e:
            log.warning("could not keep Home Assistant's last submit for the next start: %s", e)
        self.bridge.publish(discovery.submit_topic(self.topics), body, retain=True)

    def page_url(self) -> str | None:
        """Home Assistant's device link: ``homeassistant.device_url`` when set, else the page's
        address, or ``None`` without a page:
        ``http://<http.host, or this machine's name for a wildcard address>:<port>/``."""
        if self.settings.homeassistant.device_url:
            return self.settings.homeassistant.device_url
        page = self.page()
        if page is None:
            return None
        host = page.host if page.host not in ("0.0.0.0", "::", "") else socket.gethostname()
        return f"http://{f'[{host}]' if ':' in host else host}:{page.port}/"

    def publish_discovery(self) -> None:
        """The Home Assistant device config (retained), or an empty one that removes the device
        when discovery is off (docs/home-assistant.md)."""
        ha = self.settings.homeassistant
        topic = discovery.config_topic(ha.prefix, self.instance_id)
        store = self.store()
        if not ha.discovery:
            # Cleared once, only when this installation published one: with discovery off the
            # broker's ACL need not let the service write there (mosquitto 2.0.11 closes the
            # connection of a client whose publish it denies).
            if store.meta("discovery_published"):
                self.bridge.publish(topic, b"", retain=True)
                store.set_meta("discovery_published", 0)
            return
        config = discovery.device_config(
            self.topics,
            self.instance_id,
            socket.gethostname(),
            package_version(),
            configuration_url=self.page_url(),
            nodes=list(self.settings.access.nodes),
            name=ha.name,
            workers=self.settings.workers,
        )
        self.bridge.publish(topic, payloads.encode(config), retain=True)
        if not store.meta("discovery_published"):
            store.set_meta("discovery_published", 1)

    def listen(self) -> None:
        """Watch for another installation announcing itself on our ``<base>/info`` (live
        messages only) and, with discovery on, for Home Assistant's birth message."""
        self.bridge.watch[self.topics.info] = self.on_foreign_info
        ha = self.settings.homeassistant
        if ha.discovery:
            self.bridge.watch[f"{ha.prefix}/status"] = self.on_homeassistant_status

    def on_homeassistant_status(self, payload: bytes, retained: bool) -> None:
        """Home Assistant's birth message (not retained): it has just started; send the config,
        and the finished jobs it has not received. Its Last Will (``offline``): finished jobs
        are kept for it until it is back (:mod:`.ha_finished`)."""
        if payload.strip() == b"online":
            log.info("Home Assistant came online: sending the discovery config again")
            self.publish_discovery()
            self.publish_diagnostics()
            self.finished.home_assistant(online=True)
        elif payload.strip() == b"offline" and self.settings.homeassistant.discovery:
            self.finished.home_assistant(online=False)

    def on_foreign_info(self, payload: bytes, retained: bool) -> None:
        """A live ``<base>/info`` from another installation: two services on one base topic.
        Logged, and shown in our own ``info`` (``conflict``), once per other installation. A
        retained one is our own, or was checked by ``claim_base_topic`` before we connected."""
        if retained:
            return
        try:
            info = json.loads(payload)
        except (ValueError, RecursionError):
            return
        if not isinstance(info, dict):
            return
        other = info.get("instance_id")
        if not other or other == self.instance_id or other in self.conflicts:
            return
        self.conflicts[str(other)] = {k: info.get(k) for k in ("instance_id", "host", "version", "started_at")}
        log.error(
            "another edge-queue announced itself on our base topic %s: %s; both take the same requests. Give each "
            "box its own mqtt.base_topic, and stop one of them",
            self.topics.base,
            describe(info),
        )
        self.publish_info()
        self.publish_diagnostics()  # its `conflict` too, not only at the next republish

    def forget_conflicts(self) -> None:
        """Forget the other installations seen (the ``republish`` command: "Base topic shared"
        goes off once the other box is gone; one still there shows again when it announces
        itself, at its next start or connect)."""
        self.conflicts.clear()
