"""What ``serve`` cannot run although every key is valid on its own (docs/configuration.md,
"Checking a file"): checks across keys, as plain functions over :class:`Settings`, used by
``config check`` and by the service before it serves.

Plain data in, sentences out: tested without a broker.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

from edge_queue.config import Settings

#: Host names that mean this machine: a broker listening there and our own listeners share ports.
_THIS_MACHINE = {"localhost", "0.0.0.0", "::", "::1"}


def _on_this_machine(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback or host in _THIS_MACHINE
    except ValueError:
        return host in _THIS_MACHINE


def listener_problems(settings: Settings) -> list[str]:
    """Two of our listeners on one TCP port: the queue page (``http.port``), the broker's MQTT
    over WebSocket that the page connects to (``http.websocket_port``, unless
    ``http.websocket_url`` names it), and the broker on this machine (``mqtt.port`` when
    ``mqtt.host`` is a loopback address, ``localhost`` or ``0.0.0.0``: ``up`` starts the
    embedded broker there)."""
    ports: dict[int, list[str]] = {}
    if _on_this_machine(settings.mqtt.host):
        ports.setdefault(settings.mqtt.port, []).append("mqtt.port")
    if settings.http.enabled:
        ports.setdefault(settings.http.port, []).append("http.port")
        if settings.http.websocket_url is None:
            ports.setdefault(settings.http.websocket_port, []).append("http.websocket_port")
    return [
        f"{' and '.join(keys)} are both {port}: two listeners cannot share a port; give each its own"
        for port, keys in sorted(ports.items())
        if len(keys) > 1
    ]


def _inside(path: Path, roots: list[Path]) -> Path | None:
    real = Path(os.path.realpath(path))
    for root in roots:
        r = Path(os.path.realpath(root))
        if real == r or real.is_relative_to(r):
            return root
    return None


def serve_problems(settings: Settings) -> list[str]:
    """Every reason ``serve`` cannot run ``settings``, one sentence each naming its key; an
    empty list when there is none. Checked: the listeners' ports (:func:`listener_problems`),
    ``data_dir`` inside a media root (jobs could read the store and other users' outputs as
    inputs, and ``browse`` would list them), and ``workers = 0`` with no ``access.nodes`` (no
    place could ever run a job)."""
    problems = listener_problems(settings)
    root = _inside(settings.data_dir, settings.media_roots)
    if root is not None:
        problems.append(
            f"data_dir: {settings.data_dir} is inside the media root {root}: jobs and browse could read the store "
            "and every job's outputs; keep data_dir outside media_roots"
        )
    if settings.workers == 0 and not settings.access.nodes:
        problems.append(
            "workers: 0 with no access.nodes: no worker and no node could run a job; "
            "set workers to 1 or more, or list the worker nodes in access.nodes"
        )
    return problems
