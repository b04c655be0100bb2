"""What ``serve`` cannot run although every key is valid on its own (docs/configuration.md,
"Checking a file"): checks across keys, as plain functions over :class:`Settings`, used by
``config check`` and by the service before it serves.

Plain data in, sentences out: tested without a broker.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from edge_queue.config.settings import Settings
from edge_queue.config.values import canonical_address, is_loopback

#: Host names that mean this machine: a broker listening there and our own listeners share ports.
_THIS_MACHINE = {"localhost", "0.0.0.0", "::", "::1"}


def _on_this_machine(host: str) -> bool:
    return is_loopback(host) or canonical_address(host) in _THIS_MACHINE


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


def media_root_warnings(settings: Settings) -> list[str]:
    """A sentence for each of ``media_roots`` that is not a readable folder, or is an empty one,
    when ``serve`` or ``up`` starts (a share not mounted yet, a typo, a host path given to a
    container, a container's mount of a folder of the box that did not exist): a warning, not
    a problem (the service runs, and jobs on files under it fail until the folder is there;
    ``doctor`` fails on a missing one, and marks an empty one ``warn``)."""
    warnings = []
    for root in settings.media_roots:
        try:
            mode = os.stat(root).st_mode
        except (FileNotFoundError, NotADirectoryError):
            why = "does not exist"
        except OSError as e:  # a folder above it this user may not enter
            why = f"cannot be reached by this user ({e.strerror})"
        else:
            if not stat.S_ISDIR(mode):
                why = "is not a folder"
            elif not os.access(root, os.R_OK | os.X_OK):
                why = "is not readable by this user"
            elif empty_folder(root):
                warnings.append(f"media root {root} is empty: {EMPTY_ROOT_HINT}")
                continue
            else:
                continue
        warnings.append(f"media root {root} {why}: jobs on files under it fail until it is there (media_roots)")
    return warnings


#: Why a media root may be empty, for the start-up warning and ``doctor``.
EMPTY_ROOT_HINT = (
    "a share not mounted yet, or, in a container, a folder of the box that did not exist "
    "(Docker then mounts a new empty one: check the volume's folder, compose's MEDIA_DIR)"
)


def empty_folder(path: Path) -> bool:
    """``path`` is a folder with nothing in it (False when it cannot be listed)."""
    try:
        with os.scandir(path) as entries:
            return next(entries, None) is None
    except OSError:
        return False


def relay_warning(settings: Settings) -> str | None:
    """Why the page's ``/mqtt`` relay will refuse to relay under ``edge-queue up``, or None:
    ``http.websocket_proxy`` with the page listening beyond this box (``http.host`` not a
    loopback address), and the broker ``up`` starts (``broker.embedded`` not ``false``, on
    ``mqtt.host`` of this machine) without ``broker.config_file``, so without a login: the
    relay never hands an anonymous broker to the LAN (docs/operations.md, "Behind a reverse
    proxy or Home Assistant's ingress"). A warning, not a problem: the queue runs, and
    ``serve`` with a broker that asks for a login relays."""
    http = settings.http
    if not (http.enabled and http.websocket_proxy) or is_loopback(http.host):
        return None
    if settings.broker.embedded == "false" or settings.broker.config_file is not None:
        return None
    if not _on_this_machine(settings.mqtt.host):
        return None
    return (
        f"http.websocket_proxy relays the broker's WebSocket to the LAN (http.host = {http.host!r}), and the "
        "embedded broker of `edge-queue up` without broker.config_file takes clients without a login: /mqtt "
        "refuses it (403). Give the embedded broker passwords (broker.config_file, broker/amqtt.yaml), or set "
        'http.host = "127.0.0.1"'
    )
