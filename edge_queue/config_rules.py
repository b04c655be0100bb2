"""What ``serve`` cannot run although every key is valid on its own (docs/configuration.md,
"Checking a file"): checks across keys, as plain functions over :class:`Settings`, used by
``config check`` and by the service before it serves.

Plain data in, sentences out: tested without a broker.
"""

from __future__ import annotations

import ipaddress

from edge_queue.config import Settings

#: Host names that mean this machine: a broker listening there and our own listeners share ports.
_THIS_MACHINE = {"localhost", "0.0.0.0", "::", "::1"}


def _on_this_machine(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback or host in _THIS_MACHINE
    except ValueError:
        return host in _THIS_MACHINE


def listener_problems(settings: Settings) -> list[str]:
    """Two of our listeners on one TCP port: the queue page (``http.port``), the HTTP API
    (``api.port``), the broker's MQTT
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
    if settings.api.enabled:
        ports.setdefault(settings.api.port, []).append("api.port")
    return [
        f"{' and '.join(keys)} are both {port}: two listeners cannot share a port; give each its own"
        for port, keys in sorted(ports.items())
        if len(keys) > 1
    ]


def serve_problems(settings: Settings) -> list[str]:
    """Every reason ``serve`` cannot run ``settings``, one sentence each naming its key; an
    empty list when there is none. Checked: the listeners' ports (:func:`listener_problems`)
    and ``workers = 0`` with no ``access.nodes`` (no place could ever run a job). A ``data_dir``
    inside a media root is allowed (the default ``~/.local/share/edge-queue`` is inside a
    ``--media-root "$HOME"``): no file in it is taken as an input
    (:func:`~edge_queue.rules.inputs.check_input`)."""
    problems = listener_problems(settings)
    if settings.workers == 0 and not settings.access.nodes:
        problems.append(
            "workers: 0 with no access.nodes: no worker and no node could run a job; "
            "set workers to 1 or more, or list the worker nodes in access.nodes"
        )
    return problems
