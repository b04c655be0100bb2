"""The Home Assistant add-on's start: the add-on's options (``/data/options.json``, as the
Supervisor writes it) and the Supervisor's MQTT service (the Mosquitto add-on) turned into
edge-queue's settings, then ``edge-queue serve`` (docs/install.md, "Home Assistant add-on").

- The broker: ``mqtt_host`` when set, else the Supervisor's ``GET /services/mqtt`` (``host``,
  ``port``, ``username``, ``password``); neither: exit 2 with the reason.
- The page: on 8099 for ingress, its WebSocket relayed to the broker's ``mqtt_websocket_port``
  (the Mosquitto add-on's is 1884), framed only by Home Assistant itself (``'self'``).
- ``media_roots`` that do not exist in the add-on (a folder not mapped) are left out, with a line
  saying so.

- The device in Home Assistant: named ``edge-queue`` (not after the container's host name), its
  "Visit" link the add-on's ingress panel (``homeassistant://hassio/ingress/<slug>``, the slug
  from the Supervisor's ``GET /addons/self/info``, else from the host name).
- Root only for this: the service runs as uid/gid 1000 (the image's ``edge-queue`` user,
  through ``setpriv``), its ``data_dir`` handed to that user, so FFmpeg never parses an upload
  as root.

- Voice: the Wyoming listener on 10300 (option ``wyoming``, on by default), announced to the
  Supervisor (``POST /discovery``, service ``wyoming``, ``{"uri": "tcp://<host name>:10300"}``,
  as the add-on's ``discovery: [wyoming]`` allows), so that Home Assistant offers it by itself;
  Home Assistant checks the URI (``describe``) when the user accepts it, after the service runs.

``--print``: print the settings (without passwords and keys) as JSON and exit.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import urllib.request
from pathlib import Path
from typing import Any

OPTIONS = Path(os.environ.get("ADDON_OPTIONS", "/data/options.json"))
SUPERVISOR = os.environ.get("SUPERVISOR_API", "http://supervisor")
SECRET = ("EDGE_QUEUE_MQTT__PASSWORD", "EDGE_QUEUE_API__KEYS")
#: The service's user and group: the image's ``edge-queue`` (container/Containerfile)
SERVICE_UID = SERVICE_GID = 1000
#: The Wyoming listener's port in the add-on: ``wyoming.port``'s default, 10300
WYOMING_PORT = int(os.environ.get("ADDON_WYOMING_PORT", "10300"))


def supervisor_get(path: str) -> dict[str, Any] | None:
    """The ``data`` of the Supervisor's ``GET <path>``, or None without a token or an answer."""
    token = os.environ.get("SUPERVISOR_TOKEN")
    if not token:
        return None
    request = urllib.request.Request(f"{SUPERVISOR}{path}", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            body = json.loads(answer.read())
    except (OSError, ValueError) as e:
        print(f"edge-queue add-on: the Supervisor's {path} is not available ({e})", file=sys.stderr)
        return None
    data = body.get("data") if isinstance(body, dict) else None
    return data if isinstance(data, dict) else None


def ingress_url() -> str:
    """The add-on's ingress panel as a link Home Assistant opens: the slug from the Supervisor,
    else from the host name the Supervisor gives the container (the slug, ``_`` as ``-``)."""
    info = supervisor_get("/addons/self/info") or {}
    slug = info.get("slug") if isinstance(info.get("slug"), str) else None
    return f"homeassistant://hassio/ingress/{slug or socket.gethostname().replace('-', '_')}"


def supervisor_post(path: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """The ``data`` of the Supervisor's ``POST <path>`` with the JSON ``body``, or None without a
    token or an answer (said on stderr)."""
    token = os.environ.get("SUPERVISOR_TOKEN")
    if not token:
        return None
    request = urllib.request.Request(
        f"{SUPERVISOR}{path}",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            reply = json.loads(answer.read())
    except (OSError, ValueError) as e:
        print(f"edge-queue add-on: the Supervisor's {path} refused or did not answer ({e})", file=sys.stderr)
        return None
    data = reply.get("data") if isinstance(reply, dict) and reply.get("result") == "ok" else None
    return data if isinstance(data, dict) else None


def announce_wyoming(port: int = WYOMING_PORT) -> bool:
    """Tell the Supervisor where the Wyoming listener is (its documented ``POST /discovery``:
    ``{"service": "wyoming", "config": {"uri": "tcp://<host name>:<port>"}}``, the host name
    the Supervisor gave the container, which Home Assistant resolves); True once it took it."""
    uri = f"tcp://{socket.gethostname()}:{port}"
    data = supervisor_post("/discovery", {"service": "wyoming", "config": {"uri": uri}})
    if data is None:
        return False
    print(f"edge-queue add-on: Wyoming listener {uri} announced to Home Assistant", file=sys.stderr)
    return True


def supervisor_mqtt() -> dict[str, Any] | None:
    """The Supervisor's MQTT service (``{"host", "port", "username", "password", ...}``), or
    None without a Supervisor token or service."""
    data = supervisor_get("/services/mqtt")
    return data if data is not None and data.get("host") else None


def settings(options: dict[str, Any], mqtt: dict[str, Any] | None) -> dict[str, str]:
    """``EDGE_QUEUE_*`` variables from the add-on's ``options`` and the Supervisor's ``mqtt``
    service. Raises ``SystemExit(2)`` when no broker is known."""
    env: dict[str, str] = {}
    if options.get("mqtt_host"):
        broker = {
            "host": options["mqtt_host"],
            "port": options.get("mqtt_port", 1883),
            "username": options.get("mqtt_username") or None,
            "password": options.get("mqtt_password") or None,
        }
    elif mqtt is not None:
        broker = mqtt
    else:
        print(
            "edge-queue add-on: no MQTT broker: install the Mosquitto add-on, or set mqtt_host (and its login)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    env["EDGE_QUEUE_MQTT__HOST"] = str(broker["host"])
    env["EDGE_QUEUE_MQTT__PORT"] = str(broker.get("port") or 1883)
    if broker.get("username"):
        env["EDGE_QUEUE_MQTT__USERNAME"] = str(broker["username"])
    if broker.get("password"):
        env["EDGE_QUEUE_MQTT__PASSWORD"] = str(broker["password"])
    roots = [r for r in options.get("media_roots", []) if Path(r).is_dir()]
    for missing in set(options.get("media_roots", [])) - set(roots):
        print(f"edge-queue add-on: media root {missing} is not in the add-on (not mapped): left out", file=sys.stderr)
    env["EDGE_QUEUE_MEDIA_ROOTS"] = json.dumps(roots)
    env["EDGE_QUEUE_WORKERS"] = str(options.get("workers", 2))
    env["EDGE_QUEUE_LOG_LEVEL"] = str(options.get("log_level", "INFO"))
    env["EDGE_QUEUE_HTTP__HOST"] = "0.0.0.0"
    env["EDGE_QUEUE_HTTP__PORT"] = os.environ.get("ADDON_PAGE_PORT", "8099")  # config.yaml's ingress_port
    env["EDGE_QUEUE_HTTP__WEBSOCKET_PROXY"] = "true"
    env["EDGE_QUEUE_HTTP__WEBSOCKET_PORT"] = str(options.get("mqtt_websocket_port", 1884))
    env["EDGE_QUEUE_HTTP__FRAME_ANCESTORS"] = json.dumps(["'self'"])
    # Home Assistant's ingress proxy: every page opened through the panel comes from this address
    env["EDGE_QUEUE_HTTP__TRUSTED_PROXIES"] = json.dumps(["172.30.32.2"])
    env["EDGE_QUEUE_HOMEASSISTANT__NAME"] = "edge-queue"  # not the container's host name
    env["EDGE_QUEUE_HOMEASSISTANT__DEVICE_URL"] = ingress_url()
    if options.get("api_anonymous_user"):
        env["EDGE_QUEUE_API__ANONYMOUS_USER"] = str(options["api_anonymous_user"])
    if options.get("wyoming", True):
        env["EDGE_QUEUE_WYOMING__ENABLED"] = "true"
        env["EDGE_QUEUE_WYOMING__PORT"] = str(WYOMING_PORT)
        # the Supervisor's discovery tells Home Assistant; an mDNS announcement would offer it twice
        env["EDGE_QUEUE_WYOMING__ZEROCONF"] = "false"
    keys = {k["user"]: k["key"] for k in options.get("api_keys", []) if k.get("user") and k.get("key")}
    if keys:
        env["EDGE_QUEUE_API__KEYS"] = json.dumps(keys)
    return env


def main(argv: list[str]) -> int:
    options = json.loads(OPTIONS.read_text()) if OPTIONS.is_file() else {}
    env = settings(options, None if options.get("mqtt_host") else supervisor_mqtt())
    if "--print" in argv:
        print(json.dumps({k: ("***" if k in SECRET else v) for k, v in sorted(env.items())}, indent=1))
        return 0
    if env.get("EDGE_QUEUE_WYOMING__ENABLED") == "true":
        announce_wyoming()
    data_dir = Path(os.environ.get("EDGE_QUEUE_DATA_DIR", "/data/edge-queue"))
    data_dir.mkdir(parents=True, exist_ok=True)
    os.environ.update(env)
    command = ["edge-queue", "serve"]
    if os.geteuid() == 0:
        command = [*drop_root(data_dir), *command]
    os.execvp(command[0], command)
    return 1  # not reached


def drop_root(data_dir: Path) -> list[str]:
    """Hand ``data_dir`` (and what an older add-on wrote there as root) to the service's user;
    the command prefix that runs the service as that user for good (util-linux's ``setpriv``:
    real, effective and saved ids, no supplementary groups, no capabilities left)."""
    for path in (data_dir, *data_dir.rglob("*")):
        st = path.lstat()
        if (st.st_uid, st.st_gid) != (SERVICE_UID, SERVICE_GID):
            os.lchown(path, SERVICE_UID, SERVICE_GID)
    os.environ["HOME"] = str(data_dir)  # root's home is not the service's
    return ["setpriv", f"--reuid={SERVICE_UID}", f"--regid={SERVICE_GID}", "--clear-groups", "--"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
