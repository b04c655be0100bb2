"""``edge-queue doctor``: one line per check of what the appliance needs, as an operator reads it."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_queue.config.rules import EMPTY_ROOT_HINT, empty_folder
from edge_queue.config.settings import Settings
from edge_queue.errors import EdgeQueueError

#: Below this much free space in ``data_dir``, the disk check fails (bytes).
MIN_FREE_BYTES = 1 << 30
#: The colour of each mark on a terminal.
MARK_COLOURS = {"ok": "green", "warn": "yellow", "FAIL": "red"}


@dataclass(frozen=True, slots=True)
class Check:
    """``ok`` False makes ``doctor`` exit non-zero; ``warn`` marks a notice that does not."""

    name: str
    ok: bool
    detail: str
    warn: bool = False

    @property
    def mark(self) -> str:
        """``ok``, ``warn`` or ``FAIL``."""
        return "ok" if self.ok and not self.warn else ("warn" if self.ok else "FAIL")

    def line(self, paint: Callable[[str, str], str] | None = None) -> str:
        """``<mark>  <name>: <detail>``; ``paint(text, colour)`` colours the mark (green,
        yellow, red) for a terminal."""
        mark = self.mark if paint is None else paint(self.mark, MARK_COLOURS[self.mark])
        return f"{mark}{' ' * (6 - len(self.mark))}{self.name}: {self.detail}"


def _broker(settings: Settings, service: dict[str, Any]) -> Iterator[Check]:
    """The broker and the service on ``mqtt.base_topic``; fills ``service`` with what the
    service publishes (``status``, and ``info`` as a dict) for the later checks."""
    from edge_queue.mqtt.probe import detect_protocol
    from edge_queue.mqtt.request_client import RequestClient

    s = settings.mqtt
    where = f"{s.host}:{s.port}" + (" (TLS)" if s.tls.enabled else "")
    try:
        protocol = detect_protocol(s, "eq-doctor-" + secrets.token_hex(4), 5.0) if s.protocol == "auto" else s.protocol
        client = RequestClient(s, timeout_s=5.0)
    except EdgeQueueError as e:
        yield Check("broker", False, f"{where}: {e.message}")
        return
    who = f"as {s.username}" if s.username else "anonymously"
    yield Check("broker", True, f"{where} accepts us {who}, MQTT {protocol}")
    if not settings.path_map:  # a worker node uses <base>/nodes/<its id>/ only (docs/nodes.md)
        yield _grant(settings, client.topics, protocol)
    # Is a service answering on this base topic? A notice, not a failure: doctor runs before start too.
    client.subscribe(client.topics.info)
    status = client.status(1.5)
    end = time.monotonic() + 1.5
    while time.monotonic() < end and "info" not in service:
        try:
            topic, raw = client.messages.get(timeout=0.2)
        except Exception:
            continue
        if topic == client.topics.info:
            try:
                info = json.loads(raw)
            except (ValueError, RecursionError):
                continue
            if isinstance(info, dict):
                service["info"] = info
    service["status"] = status
    client.close()
    yield Check("service", True, f"{client.topics.status} is {status or 'not set'}", warn=status != "online")


def _grant(settings: Settings, topics: Any, protocol: str) -> Check:
    """Whether the broker lets us read requests and publish under the base topic (an ACL
    refuses subscriptions and publishes, not the connection): a round trip, MQTT 5's reason
    codes when the broker speaks it (:func:`~edge_queue.mqtt.grants.base_topic_refusal`)."""
    import paho.mqtt.client as mqtt

    from edge_queue.mqtt.grants import base_topic_refusal

    version = mqtt.MQTTv5 if protocol == "5" else mqtt.MQTTv311
    refused = base_topic_refusal(settings.mqtt, topics, "eq-doctor-" + secrets.token_hex(4), version)
    if refused is not None:
        return Check("grants", False, refused)
    return Check("grants", True, f"{topics.base}: the broker lets us read its requests and publish there")


def _data_dir(settings: Settings) -> Iterator[Check]:
    from edge_queue.store.preflight import lock_problem

    d = settings.data_dir
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".doctor-{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
        problem = lock_problem(d)
    except OSError as e:
        yield Check("data_dir", False, f"{d}: {e.strerror or e}")
        return
    if problem is not None:
        # a store cannot be opened or checked there: say only why
        yield Check("data_dir", False, problem)
        return
    yield Check("data_dir", True, f"{d} is writable, with working file locks")
    free = shutil.disk_usage(d).free
    yield Check(
        "disk",
        free >= MIN_FREE_BYTES,
        f"{free / 2**30:.1f} GiB free in {d}"
        + ("" if free >= MIN_FREE_BYTES else f" (below {MIN_FREE_BYTES / 2**30:.0f} GiB)"),
    )
    db = settings.db_path
    if not db.exists():
        yield Check("database", True, f"{db} does not exist yet (created at the first start)")
        return
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            result = conn.execute("PRAGMA integrity_check").fetchone()[0]
            jobs = conn.execute("SELECT count(*) FROM jobs").fetchone()[0]
    except sqlite3.Error as e:
        yield Check("database", False, f"{db}: {e}")
        return
    yield Check("database", result == "ok", f"{db}: integrity {result}, {jobs} jobs")


def _media_roots(settings: Settings, service: dict[str, Any]) -> Iterator[Check]:
    """The configured media roots; when the configuration (and ``--media-root``) gives none,
    those of the running service (``media_roots`` of ``<base>/info``: it may have been started
    with ``--media-root``)."""
    roots = [str(r) for r in settings.media_roots]
    if not roots:
        published = service.get("info", {}).get("media_roots")
        if isinstance(published, list) and published:
            roots = [str(r) for r in published]
            how = "uses" if service.get("status") == "online" else "used when it last ran"
            yield Check("media_roots", True, f"none in the configuration; the service {how} {', '.join(roots)}")
        else:
            yield Check(
                "media_roots",
                False,
                "none configured, and no service on this base topic has published any: every submit would be "
                "rejected (set media_roots in the configuration, or give --media-root to edge-queue up and to doctor)",
            )
    for root in roots:
        p = Path(root)
        ok = readable_folder(p)
        if ok and empty_folder(p):
            yield Check(f"media root {p}", True, f"readable, but empty: {EMPTY_ROOT_HINT}", warn=True)
        else:
            yield Check(f"media root {p}", ok, "readable" if ok else "missing or not readable")


def readable_folder(p: Path) -> bool:
    """``p`` is a folder this user may list; False too when a folder above it may not be entered
    (``Path.is_dir`` raises ``PermissionError`` then)."""
    try:
        return p.is_dir() and os.access(p, os.R_OK | os.X_OK)
    except OSError:
        return False


def _watch(settings: Settings, service: dict[str, Any]) -> Iterator[Check]:
    """Each ``[[watch]]`` folder: inside a media root, present and readable, writable when its
    jobs' outputs go beside the files (``output = "beside"``), how it is watched
    (inotify, or polling on a network file system), and the state the running service
    publishes for it (``watch`` of ``<base>/info``: ``missing`` fails)."""
    from edge_queue.config.settings import watch_problems
    from edge_queue.kinds.outputs import writable_problem
    from edge_queue.watch.files import file_system_type, is_network_fs

    problems = watch_problems(settings)
    for problem in problems:
        yield Check("watch", False, problem)
    published = {str(w.get("path")): w for w in service.get("info", {}).get("watch") or [] if isinstance(w, dict)}
    for w in settings.watch:
        p = Path(w.path)
        name = f"watch {p}"
        if not readable_folder(p):
            yield Check(name, False, "missing or not readable (removed, or its share not mounted)")
            continue
        fs_type = file_system_type(os.path.realpath(p))
        mode = w.mode if w.mode != "auto" else ("poll" if is_network_fs(fs_type) else "events")
        how = f"polled every {w.poll_interval_s:g} s" if mode == "poll" else "inotify events"
        detail = f"{fs_type or 'unknown'} file system, {how}, kind {w.kind or settings.default_kind}"
        if (w.options or {}).get("output") == "beside" and (why := writable_problem(p)) is not None:
            yield Check(name, False, f"{detail}; its outputs go beside the files (output = beside): {why}")
            continue
        live = published.get(str(p))
        if live is None:
            yield Check(name, True, detail)
        elif live.get("state") in ("missing", "outside", "failed"):
            yield Check(name, False, f"{detail}; the service reports it {live.get('state')} since {live.get('since')}")
        else:
            yield Check(name, True, f"{detail}; the service reports it {live.get('state')}")


def _page(settings: Settings) -> Iterator[Check]:
    """The queue page ([http]): off, or where it is and whether the broker's WebSocket
    listener it connects to answers (a warning, not a failure: the queue works without it)."""
    from edge_queue.http.page import page_broker_problem

    http = settings.http
    if not http.enabled:
        yield Check("queue page", True, "off (http.enabled = false)")
        return
    where = f"http://{http.host}:{http.port}/"
    if (why := page_broker_problem(settings)) is not None:
        yield Check("queue page", True, f"{where}; {why}", warn=True)
    else:
        broker = http.websocket_url or f"port {http.websocket_port}"
        yield Check("queue page", True, f"{where}; broker WebSocket {broker}")
    yield from _relay(settings)


def _relay(settings: Settings) -> Iterator[Check]:
    """The page's ``/mqtt`` relay (``http.websocket_proxy``) when the page listens beyond this
    box: whether the broker behind it asks for a login (else the relay refuses it)."""
    from edge_queue.config.values import is_loopback
    from edge_queue.http.page import relay_target
    from edge_queue.http.relay import anonymous_line
    from edge_queue.mqtt.probe import anonymous_over_websocket

    if (to := relay_target(settings)) is None or is_loopback(settings.http.host):
        return
    anonymous = anonymous_over_websocket(*to)
    if anonymous is None:
        yield Check(
            "page relay", True, f"the broker's WebSocket listener at {to[0]}:{to[1]} does not answer", warn=True
        )
    elif anonymous:
        yield Check("page relay", True, anonymous_line(to), warn=True)
    else:
        yield Check("page relay", True, f"/mqtt relays the broker at {to[0]}:{to[1]}, which asks for a login")


def _model(settings: Settings) -> Iterator[Check]:
    from edge_queue.kinds.languages import routes
    from edge_queue.kinds.transcribe import model_threads, resolve_model
    from edge_queue.kinds.whisper import load_model

    cfg = settings.transcribe
    refs = {"transcribe.model": cfg.model} | {f"transcribe.models.{k}": v for k, v in cfg.models.items()}
    refs |= {f"transcribe.language_models.{k}": v for k, v in routes(cfg).items()}
    for key, ref in refs.items():
        try:
            path = resolve_model(ref, settings.data_dir / "models")
            started = time.monotonic()
            load_model(path, cfg.compute_type, model_threads(settings), cfg.device)
            yield Check(key, True, f"{path} loads ({cfg.compute_type}, {time.monotonic() - started:.1f} s)")
        except EdgeQueueError as e:
            yield Check(key, False, e.message)
        except Exception as e:  # faster-whisper/CTranslate2 raise plain errors for bad models
            yield Check(key, False, f"{ref or 'bundled model'}: {type(e).__name__}: {e}")


def _speaker_model(settings: Settings) -> Iterator[Check]:
    """The voice encoder of ``diarize`` (Resemblyzer's weights, requirements/model.txt): found,
    loaded and run on one window of silence (about 0.1 s). Not there: a ``warn`` (only jobs with
    ``diarize`` need it, and they fail ``internal_error``), a failure when a ``[[watch]]`` rule
    asks for ``diarize``; the package there but its ``pretrained.pt`` missing, not a file, or not
    loading: a failure whose advice (``--force-reinstall``) mends it."""
    from edge_queue.kinds.voice_encoder import (
        REINSTALL,
        DamagedVoiceModel,
        NoVoiceModel,
        load_encoder,
        partial_mels,
        weights_path,
    )

    name = "speaker model"
    try:
        path = weights_path()
    except NoVoiceModel as e:
        asking = [str(w.path) for w in settings.watch if (w.options or {}).get("diarize") is True]
        why = f"{e}; jobs with diarize fail internal_error"
        if asking:
            yield Check(name, False, f"{why}, as every job of the watch folder(s) {', '.join(asking)} would")
        else:
            yield Check(name, True, why, warn=True)
        return
    except DamagedVoiceModel as e:  # installed without its weights: pip's plain install says it is there
        yield Check(name, False, f"{e}; jobs with diarize fail internal_error")
        return
    try:
        import numpy as np

        started = time.monotonic()
        encoder = load_encoder(path)
        windows, _ = partial_mels(np.zeros(16000, np.float32))
        embedding = encoder.embed_mels(windows)
        if embedding.shape != (1, 256) or not np.isfinite(embedding).all():
            raise DamagedVoiceModel(
                f"{path} cannot be loaded (an embedding of shape {embedding.shape} with values that are not "
                f"numbers): {REINSTALL}"
            )
    except DamagedVoiceModel as e:
        yield Check(name, False, f"{e}; jobs with diarize fail internal_error")
        return
    except Exception as e:  # the encoder loaded but does not run: the file is not the encoder's weights
        yield Check(name, False, f"{path} cannot be run ({type(e).__name__}: {e}): {REINSTALL}")
        return
    yield Check(name, True, f"{path} loads and runs (Resemblyzer's voice encoder, {time.monotonic() - started:.1f} s)")


def _cuda(settings: Settings) -> Iterator[Check]:
    """``[transcribe] device = "cuda"``: whether CTranslate2 sees a CUDA device, and why not."""
    if settings.transcribe.device != "cuda":
        return
    try:
        import ctranslate2

        count = ctranslate2.get_cuda_device_count()
    except Exception as e:  # a CTranslate2 build or driver that cannot even count
        yield Check("cuda", False, f"CTranslate2 cannot use CUDA: {type(e).__name__}: {e}")
        return
    if count < 1:
        yield Check(
            "cuda",
            False,
            "transcribe.device is cuda but CTranslate2 sees no CUDA device (no NVIDIA GPU, its driver is not "
            'loaded, or the CUDA 12 and cuDNN 9 libraries are missing: docs/nodes.md, "GPU nodes")',
        )
    else:
        yield Check("cuda", True, f"{count} CUDA device(s) visible to CTranslate2 {ctranslate2.__version__}")


def _path_maps(settings: Settings) -> Iterator[Check]:
    """A worker node's ``[[path_map]]``: each local folder exists, inside ``media_roots``."""
    roots = [os.path.realpath(r) for r in settings.media_roots]
    for i, m in enumerate(settings.path_map):
        local = os.path.realpath(m.local)
        inside = any(local == r or local.startswith(r.rstrip("/") + "/") for r in roots)
        if not os.path.isdir(local):
            yield Check(f"path_map[{i}]", False, f"{m.local} (for the hub's {m.hub}) is not a folder here")
        elif not inside:
            yield Check(f"path_map[{i}]", False, f"{m.local} is not inside media_roots: its jobs would be refused")
        else:
            yield Check(f"path_map[{i}]", True, f"the hub's {m.hub} is {m.local} here")


def _old_base_topic(settings: Settings, service: dict[str, Any]) -> Iterator[Check]:
    """A base topic the store served on before ``mqtt.base_topic`` changed: a warning while
    the broker still holds its retained ``status`` or ``info``, with the command that clears
    them; one also when the configuration names another base than the running store's."""
    from edge_queue.mqtt.instance import clear_command, read_status_and_info
    from edge_queue.mqtt.topics import Topics

    db = settings.db_path
    if not db.exists() or "status" not in service:  # no store yet, or no broker to look at
        return
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            rows = dict(conn.execute("SELECT key, value FROM store_meta WHERE key LIKE '%base_topic'").fetchall())
    except sqlite3.Error:
        return
    base = settings.mqtt.base_topic
    served, old = rows.get("base_topic"), rows.get("old_base_topic")
    if served is not None and served != base:
        yield Check(
            "base topic",
            True,
            f"the store serves {served}; its retained topics stay: {clear_command(settings.mqtt, served)}",
            warn=True,
        )
        return
    if old is None or old == base:
        return
    try:
        status, info = read_status_and_info(settings.mqtt, Topics(str(old)), "eq-doctor-" + secrets.token_hex(4))
    except EdgeQueueError:
        return
    if status or info:
        clear = clear_command(settings.mqtt, str(old))
        yield Check(
            "base topic", True, f"the broker still holds retained topics of the old base {old}: {clear}", warn=True
        )


def _hub_view(settings: Settings, service: dict[str, Any]) -> Iterator[Check]:
    """A worker node: does the hub's retained info list it, compatible, its path maps inside
    the hub's media roots (:func:`~edge_queue.nodes.hub_view.node_problems`)?"""
    from edge_queue.nodes.hub_view import node_problems
    from edge_queue.nodes.node import node_id_of

    node_id = node_id_of(settings)
    info = service.get("info")
    if not isinstance(info, dict):
        yield Check("hub", False, f"no hub publishes {settings.mqtt.base_topic}/info: is mqtt.base_topic the hub's?")
        return
    entries = [(str(m.hub), str(m.local)) for m in settings.path_map]
    problems = node_problems(info, node_id, entries)
    for problem in problems:
        yield Check("hub", False, problem)
    if not problems:
        yield Check("hub", True, f"the hub lists this node ({node_id}); its path maps name the hub's folders")


def run_checks(settings: Settings, *, model: bool = True, node: bool = False) -> Iterator[Check]:
    """Every check, in order: broker, data dir, disk, database, media roots, watch folders,
    the queue page, the speaker model, model(s). With ``node``, what a worker node needs:
    broker, the hub's view of this node, media roots, path maps, CUDA, the speaker model,
    model(s); nothing of a store it does not keep. ``model`` False skips the Whisper models
    only (the speaker model loads in 0.1 s)."""
    service: dict[str, Any] = {}
    yield from _broker(settings, service)
    if node:
        yield from _hub_view(settings, service)
        yield from _media_roots(settings, {})
        yield from _path_maps(settings)
        yield from _cuda(settings)
        yield from _speaker_model(settings)
        if model:
            yield from _model(settings)
        return
    yield from _data_dir(settings)
    yield from _old_base_topic(settings, service)
    yield from _media_roots(settings, service)
    yield from _watch(settings, service)
    yield from _page(settings)
    yield from _path_maps(settings)
    yield from _cuda(settings)
    yield from _speaker_model(settings)
    if model:
        yield from _model(settings)
