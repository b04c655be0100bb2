"""Settings: one frozen, validated object, loaded once from TOML and the environment.

Sources, highest priority first: keyword arguments (the CLI's flags), ``EDGE_QUEUE_...``
environment variables (nested keys joined with ``__``, e.g. ``EDGE_QUEUE_MQTT__HOST``), the
TOML file, then the defaults below. Unknown keys and bad values raise :class:`ConfigError`
naming every offending key (pydantic-settings does the validation).
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from edge_queue.config.api import ApiSettings
from edge_queue.config.http import HttpSettings
from edge_queue.config.sources import not_json_in_environment, toml_type_problems
from edge_queue.config.values import NODE_ID_PATTERN, NOT_IN_USER, Host
from edge_queue.config.wyoming import WyomingSettings
from edge_queue.errors import ConfigError

DEFAULT_CONFIG_PATH = Path("/etc/edge-queue/config.toml")


def default_data_dir() -> Path:
    """``$STATE_DIRECTORY`` under systemd, else ``$XDG_DATA_HOME/edge-queue`` (``~/.local/share``)."""
    if state := os.environ.get("STATE_DIRECTORY"):
        return Path(state.split(":")[0])
    xdg = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(xdg) / "edge-queue"


#: The largest MQTT 5 Session Expiry and Message Expiry Interval: a four-byte integer (MQTT 5.0,
#: 3.1.2.11.2 and 3.3.2.3.3), about 136 years.
MQTT_INTERVAL_MAX_S = 2**32 - 1
#: The largest MQTT packet: a Remaining Length of four bytes (MQTT 5.0, 1.5.5), plus its header.
MQTT_PACKET_MAX_BYTES = 268_435_455 + 5
#: Longest retention: a century (a cut-off date before year 1 is no date).
RETENTION_DAYS_MAX = 36_500
#: Longest retry backoff: a year (a retry date stays a date).
BACKOFF_MAX_S = 365 * 86400


class _Section(BaseModel):
    #: ``inf`` and ``nan`` are TOML floats (and ``"inf"`` an environment string pydantic reads
    #: as one): no key means "never" or "no limit" by them, and an infinite retention, grace or
    #: backoff has no date to store.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class TlsSettings(_Section):
    """TLS to the broker. ``insecure`` skips certificate verification; keep it off."""

    enabled: bool = False
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    insecure: bool = False


class MqttSettings(_Section):
    """Connection to the MQTT broker (docs/configuration.md, "`[mqtt]`")."""

    host: Host = "127.0.0.1"
    port: int = Field(1883, ge=1, le=65535)
    username: str | None = None
    password: SecretStr | None = None
    #: None: ``edge-queue-<instance id>-<secret>`` (the installation's id and a random secret,
    #: both kept in the store; the secret is never published)
    client_id: str | None = Field(None, min_length=1, max_length=64)
    base_topic: str = "edge-queue"
    keepalive_s: int = Field(30, ge=5, le=3600)
    #: ``auto`` tries MQTT 5 and falls back to 3.1.1 for brokers that refuse it (amqtt 0.12).
    protocol: Literal["auto", "5", "3.1.1"] = "auto"
    #: MQTT 5 session expiry: how long the broker keeps our subscriptions and QoS 1 backlog.
    session_expiry_s: int = Field(86400, ge=0, le=MQTT_INTERVAL_MAX_S)
    #: MQTT 5 Message Expiry of a finished job's retained state: the broker forgets it this
    #: long after the job ended (the store keeps it for get, list and events); 0: never.
    finished_expiry_s: int = Field(86400, ge=0, le=MQTT_INTERVAL_MAX_S)
    #: The largest packet the broker takes from us, in bytes, when it does not say (MQTT 3.1.1,
    #: or an MQTT 5 CONNACK without Maximum Packet Size): the shipped mosquitto.conf's
    #: ``max_packet_size``. Nothing the service sends is larger (docs/configuration.md).
    max_packet_size: int = Field(16 * 2**20, ge=4096, le=MQTT_PACKET_MAX_BYTES)
    tls: TlsSettings = TlsSettings()

    @field_validator("base_topic")
    @classmethod
    def _base(cls, v: str) -> str:
        if not v or any(c in v for c in "#+\x00") or v.startswith("/") or v.endswith("/"):
            raise ValueError("base_topic must be a topic without wildcards or leading/trailing '/'")
        return v


class BrokerSettings(_Section):
    """The embedded amqtt broker; it listens on ``mqtt.host``:``mqtt.port``."""

    #: ``auto``: ``edge-queue up`` starts it only when no broker answers at the address.
    embedded: Literal["auto", "true", "false"] = "auto"
    #: An amqtt YAML configuration (listeners, password file, ACL), e.g. broker/amqtt.yaml;
    #: unset: one anonymous listener on ``mqtt.host:mqtt.port``.
    config_file: Path | None = None

    @field_validator("embedded", mode="before")
    @classmethod
    def _bool(cls, v: Any) -> Any:
        return str(v).lower() if isinstance(v, bool) else v


class RetrySettings(_Section):
    """Backoff of retryable failures: full jitter, AWS Architecture Blog 2015."""

    max_attempts: int = Field(3, ge=1, le=100)
    backoff_base_s: float = Field(5.0, ge=0, le=BACKOFF_MAX_S)
    backoff_cap_s: float = Field(300.0, ge=0, le=BACKOFF_MAX_S)


class KindSettings(_Section):
    """Per-kind limits. ``timeout_s`` is the per-attempt default; a job may set its own."""

    max_concurrency: int | None = Field(None, ge=1)
    timeout_s: float | None = Field(None, gt=0)
    #: Where jobs of this kind go first when several places have a free slot: worker node ids
    #: in order, ``"hub"`` for this box's own workers; places not listed come after
    #: (docs/nodes.md, "Scheduling").
    prefer: list[str] = []


class LimitsSettings(_Section):
    """``[limits]``: what one household (or one careless client) may ask of the service
    (docs/configuration.md, "[limits]"). Requests past a limit are refused with a clear code;
    requests that arrive faster than they can be committed wait in the broker (back-pressure)."""

    #: Jobs waiting to run (``queued`` + ``retrying``) at most; a submit past it: ``queue_full``.
    max_queued_jobs: int = Field(100_000, ge=1)
    #: ... and of one sender with the ``user`` role (``[access]``), so that one user cannot fill
    #: the queue for everyone (0: no limit of its own).
    max_queued_jobs_per_user: int = Field(10_000, ge=0)
    #: Inputs in one ``submit`` at most (a batch); more: ``invalid_request`` on ``inputs``.
    max_batch_inputs: int = Field(1_000, ge=1, le=10_000)
    #: Requests executed per second at most, all clients together (0: no limit); the rest
    #: wait in the broker, unacknowledged, and are answered later.
    max_requests_per_s: float = Field(0, ge=0)
    #: Free space (MiB) ``data_dir`` must keep; below it a submit is refused with ``disk_full``
    #: while status, cancel, purge and every read keep working.
    min_free_disk_mb: int = Field(256, ge=0)


class HomeAssistantSettings(_Section):
    """``[homeassistant]``: MQTT discovery of the device and its entities
    (docs/home-assistant.md)."""

    #: Publish the device config; off: the config is cleared and Home Assistant removes the device.
    discovery: bool = True
    #: Home Assistant's discovery prefix (``discovery_prefix`` of its MQTT integration).
    prefix: str = Field(
        "homeassistant", min_length=1, max_length=64, pattern=r"^[^#+/\x00][^#+\x00]*[^#+/\x00]$|^[^#+/\x00]$"
    )
    #: The device's name (and so the start of its entity ids); empty: ``edge-queue <host name>``,
    #: followed by the base topic when it is not the default (two boxes on one host differ).
    name: str = Field("", max_length=64)
    #: The device's "Visit" link in Home Assistant; empty: the queue page's own address. The
    #: add-on sets its ingress panel (``homeassistant://hassio/ingress/<slug>``).
    device_url: str = Field("", max_length=256, pattern=r"^$|^(https?|homeassistant)://\S+$")


#: A role of docs/configuration.md, "[access]": ``admin`` may do everything; ``user`` submits and
#: sees, cancels and retries its own jobs; ``none`` may send no request at all.
Role = Literal["admin", "user", "none"]


class AccessSettings(_Section):
    """``[access]``: roles of the broker users who send requests (docs/configuration.md,
    "[access]"). A request's sender is known only from the topic it came on:
    ``<base>/request/<command>/<user>``, which the broker's ACL lets only ``<user>`` publish to;
    requests on ``<base>/request/<command>`` carry no user name and get ``shared_role``."""

    #: Broker user names with the ``admin`` role.
    admins: list[str] = []
    #: Broker user names with the ``user`` role (a name in both lists is an admin).
    users: list[str] = []
    #: The role of every other user name on ``<base>/request/<command>/<user>``.
    default_role: Role = "admin"
    #: The role of requests on ``<base>/request/<command>`` (no user name).
    shared_role: Role = "admin"
    #: Broker user names that may run jobs as worker nodes (docs/nodes.md): a node's id is its
    #: broker user, and the hub hands jobs only to the nodes listed here.
    nodes: list[str] = []

    @field_validator("admins", "users")
    @classmethod
    def _users(cls, v: list[str]) -> list[str]:
        for name in v:
            if not name or NOT_IN_USER.search(name):
                raise ValueError(
                    f"{name[:100]!r} cannot be a broker user name in the ACL's topics: "
                    "not empty, without '/', '+', '#' or control characters"
                )
        return v

    @field_validator("nodes")
    @classmethod
    def _nodes(cls, v: list[str]) -> list[str]:
        for name in v:
            if not re.match(NODE_ID_PATTERN, name):
                raise ValueError(
                    f"{name[:100]!r} cannot be a worker node's user name: 1-64 of letters, digits, '_', '.' and '-' "
                    "(it is the node id in <base>/nodes/<node_id>)"
                )
        return v

    def role_of(self, user: str | None) -> Role:
        """The role of a request sent by ``user`` (``None``: the shared request topics). A
        worker node's user sends no request (``none``) unless it is also an admin or a user."""
        if user is None:
            return self.shared_role
        if user in self.admins:
            return "admin"
        if user in self.users:
            return "user"
        if user in self.nodes:
            return "none"
        return self.default_role


class PathMap(_Section):
    """One ``[[path_map]]`` entry of a worker node: a folder as the hub names it, and the same
    folder as this machine sees it (docs/nodes.md, "Files")."""

    hub: Path
    local: Path

    @field_validator("hub", "local")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        if not v.is_absolute():
            raise ValueError("must be an absolute path")
        return v


class NodesSettings(_Section):
    """``[nodes]``: worker nodes (docs/nodes.md). ``lease_s`` is the hub's; the rest a node's."""

    #: Seconds a node holds a job without renewing its lease; a node silent that long loses
    #: the job (it goes back to the queue, counted like a local worker death).
    lease_s: float = Field(30.0, ge=3, le=3600)
    #: This node's id (``edge-queue worker``): its broker user name by default, else the host name.
    node_id: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    #: Seconds between a node's heartbeats (lease renewals); at most a third of the hub's ``lease_s``.
    heartbeat_s: float = Field(5.0, ge=0.2, le=600)
    #: The hub's: the most jobs one node is given at once, whatever slots it announces.
    max_slots: int = Field(16, ge=1, le=1024)


class TranscribeSettings(_Section):
    """faster-whisper settings. ``model``: a CTranslate2 model folder, or a model name that
    faster-whisper downloads where a network exists; ``None`` uses the bundled multilingual
    base of the ``model`` extra, with English to the bundled tiny.en (``language_models``)."""

    model: str | None = None
    #: The model each spoken language goes to: Whisper language code -> model (a folder, a name;
    #: the bundled ``tiny.en`` and ``base`` by those names). ``None``: ``{en = "tiny.en"}`` while
    #: ``model`` is unset, none otherwise (:func:`~edge_queue.kinds.languages.routes`).
    language_models: dict[Annotated[str, Field(pattern=r"^[a-z]{2,3}$")], str] | None = None
    #: Below this probability (the model's own, 0-1) a detected language is uncertain: a job
    #: that did not give its language fails with ``language_uncertain``, ``/detect-language``
    #: answers its best guess with ``"uncertain": true`` (docs/topics.md, "Languages").
    language_threshold: float = Field(0.5, ge=0, le=1)
    #: A worker process releases a model it has not used for this many seconds (0: never).
    idle_unload_s: float = Field(600.0, ge=0, le=604800)
    #: Models a worker process holds while a job decodes: 1, only the one decoding (the one
    #: that told the language is released first, and loaded again by the next job that needs
    #: it); 2, also the one used before it (no reload, more memory).
    keep_models: int = Field(1, ge=1, le=2)
    #: Where CTranslate2 runs faster-whisper: ``cpu``, or ``cuda`` on a machine with an NVIDIA
    #: GPU (docs/nodes.md, "GPU nodes"); ``edge-queue doctor`` says whether CUDA works.
    device: Literal["cpu", "cuda"] = "cpu"
    #: Models a job may choose with the ``model`` option: name -> folder path or model name.
    models: dict[str, str] = {}
    compute_type: str = "int8"
    #: CPU threads each transcription's model takes; ``None``:
    #: :func:`~edge_queue.kinds.transcribe.model_threads` (the box's cores shared by the
    #: transcriptions that may run at once).
    cpu_threads: int | None = Field(None, ge=1, le=64)
    beam_size: int = Field(5, ge=1, le=20)
    vad: bool = True
    #: Speech windows (up to 30 s, found by VAD) decoded together by faster-whisper's
    #: ``BatchedInferencePipeline``; 1 decodes them one after another (``WhisperModel.transcribe``).
    #: Batching needs VAD: with ``vad`` off a job is decoded one window after another. Measured
    #: on 10 minutes of speech (tiny.en, 2 threads, 2 cores; docs/benchmarks.md, P3).
    batch_size: int = Field(4, ge=1, le=32)
    #: Long recordings are transcribed in chunks of about this many seconds (bounded memory);
    #: ``None``: :func:`~edge_queue.kinds.transcribe.chunk_length_s` (120 s one window after
    #: another, room for about ``batch_size`` windows of 30 s batched: 120 s for the default 4).
    chunk_s: float | None = Field(None, ge=5, le=1800)
    #: Chunks of one recording decoded at once, each on a model replica of its own threads
    #: (faster-whisper's ``num_workers``). 2 on 2 cores, 1 thread each: about 10 % less CPU and
    #: 20-27 % less wall time than 1 chunk on 2 threads, at 447-476 MiB peak (462-500 on 1
    #: hour) against 370-386 (tiny.en, batches of 4; docs/configuration.md). With
    #: ``carry_context`` chunks follow each other; a job asking for a wide beam decodes fewer
    #: (:func:`~edge_queue.kinds.transcribe.chunks_at_once`).
    chunks_at_once: int = Field(1, ge=1, le=4)
    #: Give each chunk the end of the previous chunk's text as its prompt. Off by default:
    #: with it, Whisper skipped speech that repeats the prompt (25 % of the words of 8 min
    #: of repeated LibriVox clips, measured); without it chunked and whole-file runs matched.
    carry_context: bool = False


# -- watch folders (docs/configuration.md, "[[watch]]") ---------------------------------------

#: File names a watch takes when it sets no ``include``: common audio and video containers.
DEFAULT_WATCH_INCLUDE = (
    "*.wav *.flac *.mp3 *.m4a *.aac *.ogg *.oga *.opus *.wma *.amr "
    "*.mp4 *.m4v *.mkv *.mov *.avi *.webm *.mpg *.mpeg *.ts *.mts *.m2ts *.3gp"
).split()


class WatchSettings(_Section):
    """One ``[[watch]]`` table: a folder whose new files become jobs (docs/configuration.md).

    ``path`` must lie inside a media root (checked by :func:`watch_problems`, at start-up).
    Times are in seconds."""

    #: An absolute folder inside ``media_roots``.
    path: Path
    #: The kind of the jobs; unset: ``default_kind``.
    kind: str | None = Field(None, min_length=1, max_length=64)
    #: The jobs' options, as in a submit (checked against the kind at start-up).
    options: dict[str, Any] = {}
    #: ``fnmatch`` patterns on the file name, case-insensitive; a file must match one.
    include: list[str] = Field(default_factory=lambda: list(DEFAULT_WATCH_INCLUDE), min_length=1)
    #: ``fnmatch`` patterns on the file name, case-insensitive; a file matching one is skipped.
    exclude: list[str] = []
    #: Watch the sub-folders too (hidden ones excepted).
    recursive: bool = False
    #: A file becomes a job once its size and modification time stood still this long.
    settle_s: float = Field(5.0, ge=0.1, le=3600)
    #: ``events``: inotify; ``poll``: a scan every ``poll_interval_s``; ``auto``: ``poll`` on
    #: network file systems (NFS, SMB/CIFS, sshfs...), ``events`` elsewhere.
    mode: Literal["auto", "events", "poll"] = "auto"
    poll_interval_s: float = Field(30.0, ge=1, le=86400)

    @field_validator("path")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        if not v.is_absolute():
            raise ValueError("a watch path must be absolute")
        return v

    @field_validator("include", "exclude")
    @classmethod
    def _patterns(cls, v: list[str]) -> list[str]:
        if any(not p or "/" in p for p in v):
            raise ValueError("patterns match file names: non-empty, without '/'")
        return v


def watch_problems(settings: Settings) -> list[str]:
    """What is wrong with the ``[[watch]]`` tables given the media roots (which the command
    line may add to after the file is read): a path outside every media root (after symbolic
    links and ``..``), or two watches over the same folder. Returns one sentence per problem,
    naming ``watch[<index>].path``; an empty list when all is well."""
    roots = [Path(os.path.realpath(r)) for r in settings.media_roots]
    where = ", ".join(str(r) for r in settings.media_roots) or "none configured"
    problems = []
    resolved: list[tuple[Path, bool]] = []
    for i, w in enumerate(settings.watch):
        real = Path(os.path.realpath(w.path))
        if not any(real == r or real.is_relative_to(r) for r in roots):
            problems.append(
                f"watch[{i}].path: {w.path} is not inside a media root (media_roots: {where}); "
                "jobs may only read files inside media_roots"
            )
        for j, (other, recursive) in enumerate(resolved):
            covers = (recursive and real.is_relative_to(other)) or (w.recursive and other.is_relative_to(real))
            if real == other or covers:
                problems.append(f"watch[{i}].path: {w.path} overlaps watch[{j}]; a folder is watched by one watch")
        resolved.append((real, w.recursive))
    return problems


_KIND_DEFAULTS: dict[str, KindSettings] = {
    "transcribe": KindSettings(max_concurrency=1, timeout_s=6 * 3600),
    "transcode": KindSettings(max_concurrency=1, timeout_s=6 * 3600),
    "extract_audio": KindSettings(timeout_s=3600),
    "probe": KindSettings(timeout_s=120),
    "noop": KindSettings(timeout_s=120),
}


class Settings(BaseSettings):
    """The whole configuration (every key is listed in ``config/edge-queue.example.toml``)."""

    model_config = SettingsConfigDict(
        env_prefix="EDGE_QUEUE_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
        allow_inf_nan=False,
    )

    _toml_file: ClassVar[Path | None] = None

    data_dir: Path = Field(default_factory=default_data_dir)
    media_roots: list[Path] = []
    #: ``[[watch]]`` tables: folders whose new files become jobs.
    watch: list[WatchSettings] = []
    #: Local worker processes; 0 on a hub that only hands jobs to worker nodes.
    workers: int = Field(2, ge=0, le=64)
    #: The short lane: one more worker process for transcriptions of at most this many seconds
    #: of audio, which it takes only while every worker is busy (docs/configuration.md); 0: none.
    short_lane_s: float = Field(120.0, ge=0, le=3600)
    durability: Literal["full", "normal"] = "full"
    retention_days: float = Field(7.0, gt=0, le=RETENTION_DAYS_MAX)
    max_payload_bytes: int = Field(256 * 1024, ge=1024)
    default_kind: str = "transcribe"
    cancel_grace_s: float = Field(10.0, ge=0)
    crash_loop_limit: int = Field(3, ge=1)
    #: Recycle a worker after this many jobs (0: never) ...
    max_jobs_per_worker: int = Field(500, ge=0)
    #: ... or when its resident memory passes this many MiB after a job (0: never).
    max_worker_rss_mb: int = Field(1500, ge=0)
    #: Extra job kinds as import paths ``"package.module:KindClass"`` (besides entry points).
    extra_kinds: list[str] = []
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    mqtt: MqttSettings = MqttSettings()
    broker: BrokerSettings = BrokerSettings()
    retry: RetrySettings = RetrySettings()
    transcribe: TranscribeSettings = TranscribeSettings()
    kinds: dict[str, KindSettings] = {}
    limits: LimitsSettings = LimitsSettings()
    homeassistant: HomeAssistantSettings = HomeAssistantSettings()
    access: AccessSettings = AccessSettings()
    http: HttpSettings = HttpSettings()
    api: ApiSettings = ApiSettings()
    wyoming: WyomingSettings = WyomingSettings()
    nodes: NodesSettings = NodesSettings()
    #: ``[[path_map]]`` tables of a worker node: hub paths and the same folders on this machine.
    path_map: list[PathMap] = []

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if cls._toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=cls._toml_file))
        return tuple(sources)

    def kind(self, name: str) -> KindSettings:
        """Limits for kind ``name``: the ``[kinds.<name>]`` table over the built-in defaults."""
        base = _KIND_DEFAULTS.get(name, KindSettings())
        own = self.kinds.get(name)
        if own is None:
            return base
        return base.model_copy(update=own.model_dump(exclude_none=True))

    @property
    def db_path(self) -> Path:
        return self.data_dir / "edge-queue.db"

    @property
    def outputs_dir(self) -> Path:
        return self.data_dir / "outputs"

    @property
    def uploads_dir(self) -> Path:
        """The HTTP API's uploads (docs/http-api.md, "Uploads"): inputs of its jobs only."""
        return self.data_dir / "uploads"

    @property
    def voice_dir(self) -> Path:
        """The Wyoming listener's audio (docs/home-assistant.md, "Voice (Assist)"): one WAV per
        voice command, the service's own (0700), deleted once the command is answered."""
        return self.data_dir / "voice"


#: Environment variables with the prefix that are not configuration keys.
#: Variables of the environment that are not configuration keys: the TOML file's name, and the
#: mark edge-queue's container images set (:func:`edge_queue.rules.inputs.in_container`).
_ENV_NOT_KEYS = {"EDGE_QUEUE_CONFIG", "EDGE_QUEUE_IN_CONTAINER"}


def unknown_environment(environ: Any) -> list[str]:
    """``EDGE_QUEUE_...`` variables that name no configuration key (pydantic-settings would
    ignore them silently; a typo must not be)."""
    bad = []
    for name in environ:
        if not name.startswith("EDGE_QUEUE_") or name in _ENV_NOT_KEYS:
            continue
        parts = name[len("EDGE_QUEUE_") :].lower().split("__")
        model: Any = Settings
        for i, part in enumerate(parts):
            fields = getattr(model, "model_fields", None)
            if fields is None:
                break
            if part not in fields:
                if not (model is Settings and i == 1 and parts[0] == "kinds"):
                    bad.append(name)
                break
            annotation = fields[part].annotation
            model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
            if parts[0] == "kinds" and i == 0:
                model = None if len(parts) < 3 else KindSettings
                if len(parts) >= 3 and parts[2] not in KindSettings.model_fields:
                    bad.append(name)
                break
    return sorted(bad)


def load_settings(path: Path | None = None, **overrides: Any) -> Settings:
    """Build :class:`Settings` from ``path`` (TOML), the environment and ``overrides``.

    ``path=None`` reads :data:`DEFAULT_CONFIG_PATH` when it exists. Raises :class:`ConfigError`
    when ``path`` is given but missing, is not valid TOML, or any key is unknown or invalid;
    the message names every offending key (``mqtt.port: Input should be ...``).
    """
    if path is None:
        path = DEFAULT_CONFIG_PATH if DEFAULT_CONFIG_PATH.is_file() else None
    elif not Path(path).is_file():
        raise ConfigError(f"config file not found: {path}")
    typed: list[str] = []
    if path is not None:
        try:
            with open(path, "rb") as fh:
                typed = toml_type_problems(tomllib.load(fh), Settings)
        except (OSError, tomllib.TOMLDecodeError):
            pass  # said below, as pydantic-settings reads the file
    unknown = unknown_environment(os.environ)
    if unknown:
        raise ConfigError(f"unknown configuration variable(s) in the environment: {', '.join(unknown)}")

    class _Loaded(Settings):
        _toml_file = Path(path) if path else None

    try:
        loaded = _Loaded(**overrides)
    except ValidationError as e:
        named = {line.split(":")[0] for line in typed}
        problems = typed + [
            f"{key}: {err['msg']}"
            for err in e.errors()
            if (key := ".".join(str(p) for p in err["loc"]) or "(root)") not in named
        ]
        raise ConfigError(f"invalid configuration{f' in {path}' if path else ''}: {'; '.join(problems)}") from e
    except ValueError as e:  # TOML syntax and environment JSON errors surface as ValueError
        if "EnvSettingsSource" in str(e) and (field := re.search(r'field "([^"]+)"', str(e))):
            raise ConfigError(not_json_in_environment(field.group(1), os.environ, Settings)) from e
        where = f"configuration file {path}" if path else "the EDGE_QUEUE_ environment variables"
        raise ConfigError(f"cannot read {where}: {e}") from e
    if typed:
        raise ConfigError(f"invalid configuration in {path}: {'; '.join(typed)}")
    return Settings.model_validate(loaded.model_dump())
