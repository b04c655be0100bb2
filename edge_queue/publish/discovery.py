"""Home Assistant MQTT discovery (docs/home-assistant.md): one device per installation.

Device-based discovery (Home Assistant 2024.11 and newer): one retained message on
``<prefix>/device/<instance_id>/config`` describes the device and all its entities
(``cmps``); an entity left out of a newer config, or an empty retained config, is removed by
Home Assistant. States come from the topics edge-queue already publishes (``<base>/queue``,
``<base>/info``, ``<base>/status`` for availability), and from topics of their own: the
retained ``<base>/ha/last`` (the last finished job) and ``<base>/ha/submit`` (the last submit
on the shared topic), sent again at every connect and republish so that every entity has a
state within seconds of a restart of edge-queue, the broker or Home Assistant, and
``<base>/ha/finished`` for the event entity (:mod:`.ha_finished`). Commands are the ordinary
requests (``pause``, ``cancel``, ``retry``, ``republish``, ``submit``).

Sources: https://www.home-assistant.io/integrations/mqtt/#device-discovery-payload and the
facts measured with a real Home Assistant Core (tests/test_homeassistant.py)
(``dev``, ``o`` and ``cmps`` required; ``p`` and ``unique_id`` per component).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edge_queue.mqtt.topics import OFFLINE, ONLINE, Topics

#: Home Assistant's limit for a state (characters).
STATE_MAX = 255


def config_topic(prefix: str, instance_id: str) -> str:
    """``<prefix>/device/<instance_id>/config``."""
    return f"{prefix}/device/{instance_id}/config"


def last_topic(topics: Topics) -> str:
    """``<base>/ha/last``: the last finished job (retained)."""
    return topics.ha("last")


def finished_topic(topics: Topics) -> str:
    """``<base>/ha/finished``: one message per finished job, for the event entity (not retained)."""
    return topics.ha("finished")


def diagnostics_topic(topics: Topics) -> str:
    """``<base>/ha/diagnostics``: settings, counts, nodes, recent problems (retained)."""
    return topics.ha("diagnostics")


def submit_topic(topics: Topics) -> str:
    """``<base>/ha/submit``: the last submit on the shared request topic and its result (retained)."""
    return topics.ha("submit")


#: The base topic a device name leaves out (``mqtt.base_topic``'s default).
DEFAULT_BASE = "edge-queue"


def device_name(configured: str, host: str, base: str) -> str:
    """The device's name: ``homeassistant.name`` when set, else ``edge-queue <host>``, with the
    base topic after it when it is not the default: two installations on one host get two
    names, and so two sets of entity ids (``sensor.edge_queue_nas_garage_jobs_queued``)."""
    if configured.strip():
        return configured.strip()
    return f"edge-queue {host}" + ("" if base == DEFAULT_BASE else f" {base}")


def device_config(
    topics: Topics,
    instance_id: str,
    host: str,
    version: str,
    *,
    configuration_url: str | None = None,
    nodes: list[str] | None = None,
    name: str = "",
    workers: int = 1,
) -> dict[str, Any]:
    """The discovery payload: the device, its origin, availability and every entity.

    Each entity's ``unique_id`` is ``edge_queue_<instance_id>_<key>``, so two installations
    never share one; the device is named by :func:`device_name` (``name``: the configured
    one); ``workers`` (the configured number) is what the "Workers" problem sensor expects
    alive. ``configuration_url`` (the queue
    page, ``http://nas:8099/``) becomes the device's "Visit" link (``cu``). Each worker node of
    ``nodes`` (``access.nodes``) gets a connectivity sensor from its retained announcement and a
    sensor of the jobs it runs (docs/home-assistant.md, "Discovery")."""
    queue = topics.queue

    def uid(key: str) -> str:
        return f"edge_queue_{instance_id}_{key}"

    def count(key: str, name: str, icon: str) -> dict[str, Any]:
        return {
            "p": "sensor",
            "name": name,
            "unique_id": uid(key),
            "stat_t": queue,
            "val_tpl": "{{ value_json.counts." + key + " }}",
            "unit_of_meas": "jobs",
            "stat_cla": "measurement",
            "ic": icon,
        }

    current = "value_json.running[0]"
    components: dict[str, Any] = {
        "queued": count("queued", "Jobs queued", "mdi:tray-full"),
        "running": count("running", "Jobs running", "mdi:cog-play"),
        "retrying": count("retrying", "Jobs retrying", "mdi:restart"),
        "failed": count("failed", "Jobs failed", "mdi:alert-circle"),
        "succeeded": count("succeeded", "Jobs succeeded", "mdi:check-circle"),
        "cancelled": count("cancelled", "Jobs cancelled", "mdi:cancel"),
        "current_job": {
            "p": "sensor",
            "name": "Current job",
            "unique_id": uid("current_job"),
            "stat_t": queue,
            "val_tpl": (
                "{{ (J.kind ~ ' ' ~ (J.input or '').split('/')[-1])[:255] if value_json.running else 'idle' }}"
            ).replace("J", current),
            "json_attr_t": queue,
            "json_attr_tpl": (
                "{{ ({'job_id': J.job_id, 'kind': J.kind, 'input': J.input, 'stage': J.stage, "
                "'progress': J.progress, 'eta_s': J.eta_s} if value_json.running else {}) | tojson }}"
            ).replace("J", current),
            "ic": "mdi:progress-clock",
        },
        "current_progress": {
            "p": "sensor",
            "name": "Current job progress",
            "unique_id": uid("current_progress"),
            "stat_t": queue,
            "val_tpl": "{{ (J.progress or 0) | round(0) if value_json.running else 0 }}".replace("J", current),
            "unit_of_meas": "%",
            "stat_cla": "measurement",
            "ic": "mdi:percent",
        },
        "last_result": {
            "p": "sensor",
            "name": "Last result",
            "unique_id": uid("last_result"),
            "stat_t": last_topic(topics),
            "val_tpl": "{{ value_json.summary }}",
            "json_attr_t": last_topic(topics),
            "ic": "mdi:text-box-check",
        },
        "job_finished": {
            "p": "event",
            "name": "Job finished",
            "unique_id": uid("job_finished"),
            # <base>/ha/finished: once per finished run, and the runs that ended while Home
            # Assistant was offline when it is back (edge_queue/publish/ha_finished.py)
            "stat_t": finished_topic(topics),
            # missed: one summary of the jobs Home Assistant did not get (rules/ha_delivery.py)
            "evt_typ": ["succeeded", "failed", "cancelled", "missed"],
            "ic": "mdi:flag-checkered",
        },
        "paused": {
            "p": "switch",
            "name": "Paused",
            "unique_id": uid("paused"),
            "stat_t": queue,
            "val_tpl": "{{ 'ON' if value_json.paused else 'OFF' }}",
            "cmd_t": topics.request("pause"),
            "pl_on": '{"paused": true}',
            "pl_off": '{"paused": false}',
            "stat_on": "ON",
            "stat_off": "OFF",
            "ic": "mdi:pause-circle",
        },
        "cancel_current": {
            "p": "button",
            "name": "Cancel current job",
            "unique_id": uid("cancel_current"),
            "cmd_t": topics.request("cancel"),
            "pl_prs": '{"running": true}',
            "ic": "mdi:cancel",
        },
        "retry_failed": {
            "p": "button",
            "name": "Retry failed jobs",
            "unique_id": uid("retry_failed"),
            "cmd_t": topics.request("retry"),
            "pl_prs": '{"failed": true}',
            "ic": "mdi:restart",
        },
        "republish": {
            "p": "button",
            "name": "Republish",
            "unique_id": uid("republish"),
            "cmd_t": topics.request("republish"),
            "pl_prs": "{}",
            "ent_cat": "diagnostic",
            "ic": "mdi:broadcast",
        },
        "submit": {
            "p": "text",
            "name": "Submit",
            "unique_id": uid("submit"),
            "cmd_t": topics.request("submit"),
            # the last submitted input: a state after any restart, not HA's optimistic "unknown"
            "stat_t": submit_topic(topics),
            "val_tpl": "{{ value_json.input }}",
            "max": 255,
            "ic": "mdi:file-upload",
        },
        "submit_result": {
            "p": "sensor",
            "name": "Last submit",
            "unique_id": uid("submit_result"),
            "stat_t": submit_topic(topics),
            "val_tpl": "{{ value_json.summary }}",
            "json_attr_t": submit_topic(topics),
            "json_attr_tpl": "{{ {'job_ids': value_json.job_ids, 'error_code': value_json.error_code, "
            "'submitted_at': value_json.submitted_at} | tojson }}",
            "ic": "mdi:inbox-arrow-down",
        },
    }
    components.update(diagnostics(topics, uid, workers, instance_id))
    for node_id in nodes or []:
        components[f"node_{node_id}"] = {
            "p": "binary_sensor",
            "name": f"Node {node_id}",
            "unique_id": uid(f"node_{node_id}"),
            # what the hub sees of the node (its queue's nodes), not the node's own announcement,
            # which a bridge keeps "online" through an outage
            "stat_t": queue,
            "val_tpl": "{{ 'ON' if (value_json.nodes | selectattr('node_id', 'equalto', '"
            + node_id
            + "') | map(attribute='online') | list | first | default(false)) else 'OFF' }}",
            "dev_cla": "connectivity",
        }
        components[f"node_{node_id}_running"] = {
            "p": "sensor",
            "name": f"Node {node_id} jobs running",
            "unique_id": uid(f"node_{node_id}_running"),
            "stat_t": queue,
            "val_tpl": "{{ value_json.nodes | selectattr('node_id', 'equalto', '"
            + node_id
            + "') | map(attribute='running') | list | first | default(0) }}",
            "unit_of_meas": "jobs",
            "stat_cla": "measurement",
            "ic": "mdi:server-network",
        }
    return {
        "dev": {
            "ids": [f"edge_queue_{instance_id}"],
            "name": device_name(name, host, topics.base),
            "mf": "edge-queue",
            "mdl": "edge-queue job queue",
            "sw": version,
            **({"cu": configuration_url} if configuration_url else {}),
        },
        "o": {"name": "edge-queue", "sw": version},
        "avty_t": topics.status,
        "pl_avail": ONLINE,
        "pl_not_avail": OFFLINE,
        "qos": 1,
        "cmps": components,
    }


#: ``<base>/ha/last`` before any job finished, so that "Last result" has a state.
NO_LAST: dict[str, Any] = {
    "summary": "none",
    **dict.fromkeys(
        ("job_id", "kind", "state", "input", "text", "outputs", "error_code", "error_message", "finished_at")
    ),
}
#: ``<base>/ha/submit`` before any submit.
NO_SUBMIT: dict[str, Any] = {"summary": "none", "input": "", "job_ids": [], "error_code": None, "submitted_at": None}


def submit_payload(request: bytes, response: dict[str, Any], at: str) -> dict[str, Any]:
    """``<base>/ha/submit`` for a submit on the shared request topic: ``summary`` (``queued <job
    ids>`` or ``error: <code>: <message>``, cut to 255 characters), ``input`` (what was
    submitted: the ``input`` of a JSON request or the bare path, cut to 255 characters, the
    "Submit" text's state), ``job_ids``, ``error_code`` and ``submitted_at`` (``at``, ISO 8601)."""
    text = request.decode("utf-8", "replace").strip()
    try:
        decoded = json.loads(text)
    except (ValueError, RecursionError):
        decoded = text
    given = decoded.get("input") if isinstance(decoded, dict) else decoded
    data = response.get("data") if isinstance(response.get("data"), dict) else {}
    jobs = [j.get("job_id") for j in (data or {}).get("jobs") or [] if isinstance(j, dict)]
    error = response.get("error") if isinstance(response.get("error"), dict) else None
    if response.get("status") == "error" and error is not None:
        summary = f"error: {error.get('code')}: {error.get('message')}"
    else:
        summary = "queued " + ", ".join(str(j) for j in jobs)
    return {
        "summary": summary[:STATE_MAX],
        "input": (given if isinstance(given, str) else "")[:STATE_MAX],
        "job_ids": jobs,
        "error_code": error.get("code") if error is not None else None,
        "submitted_at": at,
    }


def diagnostics(topics: Topics, uid: Any, workers: int, instance_id: str) -> dict[str, Any]:
    """The device's diagnostic entities (entity category ``diagnostic``, as Zigbee2MQTT's and
    Frigate's devices have): version, start time, worker health, store size, free disk, another
    installation on the base topic, and the diagnostics object (``<base>/ha/diagnostics``)."""
    queue, info = topics.queue, topics.info

    def diag(key: str, p: str, name: str, stat_t: str, val_tpl: str, **more: Any) -> dict[str, Any]:
        # (a template that renders None makes the state unknown)
        base = {"p": p, "name": name, "unique_id": uid(key), "stat_t": stat_t, "val_tpl": val_tpl}
        return {**base, "ent_cat": "diagnostic", **more}

    return {
        "version": diag("version", "sensor", "Version", info, "{{ value_json.version }}", ic="mdi:tag"),
        "started": diag("started", "sensor", "Started", info, "{{ value_json.started_at }}", dev_cla="timestamp"),
        "workers_alive": diag(
            "workers_alive",
            "sensor",
            "Workers alive",
            queue,
            "{{ value_json.workers_alive }}",
            stat_cla="measurement",
            ic="mdi:account-hard-hat",
        ),
        # on while fewer worker processes are alive than configured (one crashed, or restarts)
        "workers_problem": diag(
            "workers_problem",
            "binary_sensor",
            "Workers",
            queue,
            "{{ 'ON' if value_json.workers_alive < " + str(int(workers)) + " else 'OFF' }}",
            dev_cla="problem",
        ),
        "store_size": diag(
            "store_size",
            "sensor",
            "Store size",
            queue,
            "{{ (value_json.store_bytes / 1000000) | round(1) if value_json.store_bytes is number else None }}",
            dev_cla="data_size",
            unit_of_meas="MB",
            stat_cla="measurement",
            ic="mdi:database",
        ),
        # another installation on our base topic: its info there, or ours naming it (announce.py)
        "conflict": diag(
            "conflict",
            "binary_sensor",
            "Base topic shared",
            info,
            # `| default`: an info retained by an older edge-queue has no `conflict` when alone
            "{{ 'ON' if value_json.conflict | default([]) or value_json.instance_id != '"
            + instance_id
            + "' else 'OFF' }}",
            dev_cla="problem",
            json_attr_t=info,
            json_attr_tpl="{{ {'installations': value_json.conflict | default([]), "
            "'info_from': value_json.instance_id} | tojson }}",
        ),
        "diagnostics": diag(
            "diagnostics",
            "sensor",
            "Diagnostics",
            diagnostics_topic(topics),
            "{{ value_json.generated_at }}",
            dev_cla="timestamp",
            json_attr_t=diagnostics_topic(topics),
            ic="mdi:stethoscope",
        ),
        "disk_free": diag(
            "disk_free",
            "sensor",
            "Disk free",
            queue,
            "{{ (value_json.disk_free_bytes / 1000000000) | round(1) "
            "if value_json.disk_free_bytes is number else None }}",
            dev_cla="data_size",
            unit_of_meas="GB",
            stat_cla="measurement",
            ic="mdi:harddisk",
        ),
    }


def finished_payload(job: dict[str, Any], state: str, event_id: int | None, *, late: bool) -> dict[str, Any]:
    """``<base>/ha/finished`` for a job that reached ``state`` (its ``end`` event ``event_id``):
    ``event_type`` (the state), ``event_id``, ``job_id``, ``kind``, ``input``, ``error_code``,
    ``error_message``, ``text`` (a transcript's first 1,000 characters), ``finished_at`` and
    ``late`` (true when sent again because Home Assistant was offline when the job ended)."""
    result = job.get("result") if isinstance(job.get("result"), dict) else {}
    error = job.get("error") if isinstance(job.get("error"), dict) else {}
    return {
        "event_type": state,
        "event_id": event_id,
        "job_id": job["job_id"],
        "kind": job["kind"],
        "input": job.get("input"),
        "error_code": (error or {}).get("code"),
        "error_message": (error or {}).get("message"),
        "text": ((result or {}).get("text") or "")[:1000],
        "finished_at": job.get("finished_at"),
        "late": late,
    }


def last_payload(job: dict[str, Any]) -> dict[str, Any]:
    """``<base>/ha/last`` for a finished job: ``summary`` (the transcript, cut to Home
    Assistant's 255-character state limit, or ``<kind> <state>: <file name>``, ``<kind> <state>``
    for a job without an input), and the job's main fields
    with the whole text and the output paths."""
    result = job.get("result") or {}
    text = result.get("text") if isinstance(result, dict) else None
    error = job.get("error") or {}
    name = Path(job.get("input") or "").name
    summary = (text or "").strip() or f"{job['kind']} {job['state']}" + (f": {name}" if name else "")
    return {
        "summary": summary[:STATE_MAX],
        "job_id": job["job_id"],
        "kind": job["kind"],
        "state": job["state"],
        "input": job.get("input"),
        "text": text,
        "outputs": result.get("outputs") if isinstance(result, dict) else None,
        "error_code": error.get("code") if isinstance(error, dict) else None,
        "error_message": error.get("message") if isinstance(error, dict) else None,
        "finished_at": job.get("finished_at"),
    }
