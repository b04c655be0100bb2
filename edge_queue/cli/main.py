"""The ``edge-queue`` command line: a thin layer over the service, the broker and the client.

Exit codes: 0 success; 1 a job did not succeed or a request was answered with an error;
2 bad usage or configuration, or (``serve``, ``up``) a ``data_dir`` or store the service cannot
use (``preflight``); 3 no broker answered.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import sys
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from edge_queue.config.settings import Settings, load_settings
from edge_queue.errors import BrokerUnavailable, ConfigError
from edge_queue.logfmt import OneLineFormatter
from edge_queue.rules.states import JobState

from .help import PlainCommand, PlainGroup

app = typer.Typer(
    cls=PlainGroup,
    add_completion=False,
    help="edge-queue: an MQTT-native job queue for media work on home and edge boxes.",
)
config_app = typer.Typer(cls=PlainGroup, help="Check the configuration.")
app.add_typer(config_app, name="config")


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: Annotated[bool, typer.Option("--version", is_eager=True, help="print the version and exit")] = False,
) -> None:
    """edge-queue: an MQTT-native job queue for media work on home and edge boxes."""
    if version:
        from edge_queue import package_version

        typer.echo(f"edge-queue {package_version()}")
        raise typer.Exit(0)
    if ctx.invoked_subcommand is None:  # a bare command shows the help, and is no error
        typer.echo(ctx.get_help())
        raise typer.Exit(0)


@config_app.callback(invoke_without_command=True)
def _config_root(ctx: typer.Context) -> None:
    """Check the configuration."""
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())
        raise typer.Exit(0)


ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        envvar="EDGE_QUEUE_CONFIG",
        metavar="FILE",
        help="TOML file (default /etc/edge-queue/config.toml if present)",
    ),
]
MediaRootOpt = Annotated[
    list[Path] | None, typer.Option("--media-root", "-m", metavar="FOLDER", help="add a media root (repeatable)")
]

EXIT_FAILED, EXIT_USAGE, EXIT_NO_BROKER, EXIT_OFFLINE, EXIT_TOPIC_IN_USE = 1, 2, 3, 4, 5
TERMINAL = ("succeeded", "failed", "cancelled")


def _settings(config: Path | None, media_roots: list[Path] | None = None) -> Settings:
    try:
        settings = load_settings(config)
    except ConfigError as e:
        typer.echo(f"edge-queue: {e.message}", err=True)
        raise typer.Exit(EXIT_USAGE) from e
    if media_roots:
        roots = [*settings.media_roots, *(Path(os.path.abspath(p.expanduser())) for p in media_roots)]
        settings = settings.model_copy(update={"media_roots": roots})
    _logging(settings.log_level)
    return settings


def _service_settings(config: Path | None, media_roots: list[Path] | None = None) -> Settings:
    """:func:`_settings` for ``serve`` and ``up``: exits with EXIT_USAGE, naming each key, when
    the service cannot run them (:func:`~edge_queue.config.rules.serve_problems`)."""
    from edge_queue.config.rules import media_root_warnings, serve_problems

    settings = _settings(config, media_roots)
    if problems := serve_problems(settings):
        typer.echo(f"edge-queue: invalid configuration: {'; '.join(problems)}", err=True)
        raise typer.Exit(EXIT_USAGE)
    for warning in media_root_warnings(settings):  # the service runs; doctor fails on them
        logging.getLogger("edge_queue").warning(warning)
    return settings


def _logging(level: str) -> None:
    # journald adds the time; one line per event on stderr, which client text cannot forge
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    # The format uses none of these: not collecting them saves a fifth of the cost of each line
    # (19 -> 15 us here; the service logs three lines per job at INFO; logging HOWTO, "Optimization").
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging._srcfile = None  # type: ignore[attr-defined]  # no caller look-up (HOWTO, "Optimization")
    for noisy in ("amqtt", "transitions"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))


def _client(settings: Settings) -> Any:
    from edge_queue.mqtt.request_client import RequestClient

    try:
        return RequestClient(settings.mqtt)
    except BrokerUnavailable as e:
        typer.echo(f"edge-queue: {e.message}", err=True)
        raise typer.Exit(EXIT_NO_BROKER) from e


def _request(settings: Settings, command: str, body: dict[str, Any]) -> dict[str, Any]:
    from edge_queue.mqtt.request_client import ServiceOffline

    client = _client(settings)
    try:
        resp = client.request(command, body)
    except ServiceOffline as e:
        typer.echo(f"edge-queue: {e.message}", err=True)
        raise typer.Exit(EXIT_OFFLINE) from e
    except TimeoutError as e:
        typer.echo(f"edge-queue: {e}", err=True)
        raise typer.Exit(EXIT_NO_BROKER) from e
    finally:
        client.close()
    if resp.get("status") != "ok":
        err = resp.get("error", {})
        typer.echo(f"error: {err.get('code')}: {_shown(err.get('message'))}", err=True)
        raise typer.Exit(EXIT_FAILED)
    return dict(resp["data"])


@app.command(cls=PlainCommand)
def serve(config: ConfigOpt = None, media_root: MediaRootOpt = None) -> None:
    """Run the service against the configured broker (systemd's ExecStart)."""
    from edge_queue.service import serve as run_service

    settings = _service_settings(config, media_root)
    from edge_queue.mqtt.instance import BaseTopicInUse

    try:
        raise typer.Exit(run_service(settings))
    except BaseTopicInUse as e:
        typer.echo(f"edge-queue: {e.message}", err=True)
        raise typer.Exit(EXIT_TOPIC_IN_USE) from e
    except ConfigError as e:
        typer.echo(f"edge-queue: {e.message}", err=True)
        raise typer.Exit(EXIT_USAGE) from e
    except BrokerUnavailable as e:
        typer.echo(f"edge-queue: {e.message}", err=True)
        raise typer.Exit(EXIT_NO_BROKER) from e
    except (sqlite3.DatabaseError, OSError) as e:
        raise typer.Exit(_boot_failure(settings, e)) from e


@app.command(cls=PlainCommand)
def worker(config: ConfigOpt = None, media_root: MediaRootOpt = None) -> None:
    """Run a worker node: take jobs from the hub (the box running serve) over the broker."""
    from edge_queue.nodes.node import run_node

    settings = _settings(config, media_root)
    try:
        raise typer.Exit(run_node(settings))
    except ConfigError as e:
        typer.echo(f"edge-queue: {e.message}", err=True)
        raise typer.Exit(EXIT_USAGE) from e


def _boot_failure(settings: Settings, e: sqlite3.DatabaseError | OSError) -> int:
    """For a store or data_dir error raised while the service opened them (before READY=1):
    print the one line and return EXIT_USAGE. Anything else propagates."""
    from edge_queue.store.preflight import boot_failure

    failure = boot_failure(settings, e)
    if failure is None:
        raise e
    typer.echo(f"edge-queue: {failure.message}", err=True)
    return EXIT_USAGE


@app.command(cls=PlainCommand)
def broker(config: ConfigOpt = None) -> None:
    """Run the embedded amqtt broker on mqtt.host:mqtt.port until interrupted."""
    import asyncio
    import signal

    from edge_queue.mqtt.embedded_broker import serve as serve_broker

    settings = _settings(config)
    broker_cfg = _broker_config(settings)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve_broker(broker_cfg, stop, page=settings.http)

    asyncio.run(main())


def _broker_config(settings: Settings) -> dict[str, Any]:
    from edge_queue.mqtt.embedded_broker import broker_config, load_config
    from edge_queue.mqtt.ws_listener import page_listener_port

    if settings.broker.config_file is None:
        return broker_config(settings.mqtt.host, settings.mqtt.port, websocket_port=page_listener_port(settings))
    try:
        return load_config(settings.broker.config_file)
    except ValueError as e:
        typer.echo(f"edge-queue: {e}", err=True)
        raise typer.Exit(EXIT_USAGE) from e


@app.command(cls=PlainCommand)
def up(config: ConfigOpt = None, media_root: MediaRootOpt = None) -> None:
    """Start the embedded broker (when configured, or when none answers) and the service."""
    from edge_queue.mqtt.embedded_broker import BrokerThread, port_open
    from edge_queue.service import Service

    settings = _service_settings(config, media_root)
    mode, host, port = settings.broker.embedded, settings.mqtt.host, settings.mqtt.port
    embedded = None
    if mode == "true" and port_open(host, port):
        typer.echo(f"edge-queue: {host}:{port} is in use; cannot start the embedded broker there", err=True)
        raise typer.Exit(EXIT_NO_BROKER)
    if mode == "true" or (mode == "auto" and not port_open(host, port)):
        embedded = BrokerThread(_broker_config(settings), page=settings.http)
        try:
            embedded.start()
        except RuntimeError as e:
            typer.echo(f"edge-queue: {e}", err=True)
            raise typer.Exit(EXIT_NO_BROKER) from e
    else:
        logging.getLogger("edge_queue").info("using the MQTT broker at %s:%s", host, port)
    from edge_queue.mqtt.instance import BaseTopicInUse

    try:
        service = Service(settings)
        if embedded is not None:  # the broker never takes the service for a client that reads nothing
            service.bridge.on_client_id = embedded.trust
            if service.bridge.client_id:  # mqtt.client_id
                embedded.trust(service.bridge.client_id)
        code = service.run()
    except BaseTopicInUse as e:
        typer.echo(f"edge-queue: {e.message}", err=True)
        code = EXIT_TOPIC_IN_USE
    except ConfigError as e:
        typer.echo(f"edge-queue: {e.message}", err=True)
        code = EXIT_USAGE
    except BrokerUnavailable as e:
        typer.echo(f"edge-queue: {e.message}", err=True)
        code = EXIT_NO_BROKER
    except (sqlite3.DatabaseError, OSError) as e:
        code = _boot_failure(settings, e)
    finally:
        if embedded is not None:
            embedded.stop()
    raise typer.Exit(code)


def _parse_options(pairs: list[str] | None) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{pair!r}: use KEY=VALUE", param_hint="--option")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


@app.command(cls=PlainCommand)
def submit(
    files: Annotated[
        list[str] | None,
        typer.Argument(help="media files (paths as the service sees them); none for a kind without input"),
    ] = None,
    kind: Annotated[str | None, typer.Option("--kind", "-k", help="job kind (default: default_kind)")] = None,
    option: Annotated[
        list[str] | None, typer.Option("--option", "-o", metavar="KEY=VALUE", help="a kind option (JSON value)")
    ] = None,
    priority: Annotated[int, typer.Option(min=-100, max=100, help="higher runs first, -100..100")] = 0,
    wait: Annotated[bool, typer.Option("--wait", "-w", help="show progress until every job ends")] = False,
    timeout: Annotated[float, typer.Option(min=1, metavar="SECONDS", help="seconds to wait with --wait")] = 24 * 3600,
    config: ConfigOpt = None,
) -> None:
    """Submit FILE... as jobs; with --wait, exit 0 only if every job succeeded."""
    settings = _settings(config)
    body: dict[str, Any] = {
        "kind": kind or settings.default_kind,
        "options": _parse_options(option),
        "priority": priority,
    }
    paths = [p if p.startswith("/") else os.path.abspath(p) for p in files or []]
    if len(paths) == 1:
        body["input"] = paths[0]
    elif paths:
        body["inputs"] = paths
    from edge_queue.mqtt.request_client import ServiceOffline

    client = _client(settings)
    try:
        try:
            resp = client.request("submit", body)
        except ServiceOffline as e:
            typer.echo(f"edge-queue: {e.message}", err=True)
            raise typer.Exit(EXIT_OFFLINE) from e
        except TimeoutError as e:
            typer.echo(f"edge-queue: {e}", err=True)
            raise typer.Exit(EXIT_NO_BROKER) from e
        if resp.get("status") != "ok":
            err = resp["error"]
            for r in err.get("rejected", []):
                typer.echo(f"rejected {_shown(r['input'])}: {r['code']}: {_shown(r['message'])}", err=True)
            if not err.get("rejected"):
                typer.echo(f"error: {err['code']}: {_shown(err['message'])}", err=True)
            raise typer.Exit(EXIT_FAILED)
        data = resp["data"]
        for r in data["rejected"]:
            typer.echo(f"rejected {_shown(r['input'])}: {r['code']}: {_shown(r['message'])}", err=True)
        for j in data["jobs"]:
            shown = _shown(j["input"]) if j["input"] else "(no input)"
            typer.echo(f"{j['job_id']}  {shown}{'  (duplicate)' if j['duplicate'] else ''}")
        if data.get("batch_id"):
            typer.echo(f"batch {data['batch_id']}")
        if not wait:
            raise typer.Exit(EXIT_FAILED if data["rejected"] else 0)
        ok = _wait(client, [j["job_id"] for j in data["jobs"]], timeout)
        raise typer.Exit(0 if ok and not data["rejected"] else EXIT_FAILED)
    finally:
        client.close()


def _shown(text: Any) -> str:
    """``text`` safe to print on a terminal: characters that are not printable (control
    characters such as a newline or ESC, bidirectional overrides, lone surrogates) are written
    as Python escapes (``\\n``, ``\\x1b``, ``\\u202e``), so a file name cannot forge an output
    line or move the cursor."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _label(job: dict[str, Any], paused: bool) -> str:
    """A job's state as ``submit --wait`` shows it: ``running (transcribing)``, ``queued (the
    queue is paused: resume it to start)``."""
    if job["state"] == "running" and job.get("stage"):
        return f"running ({job['stage']})"
    if job["state"] in ("queued", "retrying") and paused:
        return f"{job['state']} (the queue is paused: resume it to start)"
    return str(job["state"])


def _done(job: dict[str, Any]) -> float:
    return 100.0 if job["state"] == "succeeded" else float(job.get("progress") or 0)


def _wait(client: Any, job_ids: list[str], timeout: float) -> bool:
    """Progress bars (rich) until every job is terminal; True when all succeeded."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    states: dict[str, dict[str, Any]] = {}
    seqs: dict[str, int] = {}
    for job_id in job_ids:
        client.subscribe(client.topics.job(job_id))
    client.subscribe(client.topics.queue)  # a queued job says so when the queue is paused
    console = Console(stderr=True)
    with Progress(
        TextColumn("{task.fields[job]}"),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[state]}"),
        TimeRemainingColumn(),
        console=console,
    ) as bar:
        tasks = {j: bar.add_task("", total=100, job=j, state="…") for j in job_ids}
        paused = False
        for job_id, job in client.job_updates(timeout):
            changed = []
            if job is not None and job_id in tasks and job.get("seq", 0) >= seqs.get(job_id, 0):
                seqs[job_id] = job["seq"]
                states[job_id] = job
                changed.append(job_id)
            if client.queue_paused != paused:  # a pause or resume: every waiting job's label
                paused, changed = client.queue_paused, list(states)
            for known in changed:
                bar.update(tasks[known], completed=_done(states[known]), state=_label(states[known], paused))
            if len(states) == len(job_ids) and all(s["state"] in TERMINAL for s in states.values()):
                break
    all_ok = True
    for job_id in job_ids:
        job = states.get(job_id)
        if job is None or job["state"] != "succeeded":
            all_ok = False
            waiting = "still not finished" + ("; the queue is paused: resume it to start" if paused else "")
            reason = (job or {}).get("error") or {"code": "timeout", "message": waiting}
            typer.echo(
                f"{job_id} {job['state'] if job else 'unknown'}: {reason.get('code')}: {_shown(reason.get('message'))}",
                err=True,
            )
        else:
            text = (job.get("result") or {}).get("text")
            typer.echo(f"{job_id} succeeded" + (f": {_shown(text)}" if text else ""))
    return all_ok


@app.command(cls=PlainCommand)
def jobs(
    state: Annotated[JobState | None, typer.Option(help="only jobs in this state")] = None,
    kind: Annotated[str | None, typer.Option(help="only jobs of this kind")] = None,
    limit: Annotated[int, typer.Option(min=1, max=500, help="at most this many, newest first")] = 20,
    config: ConfigOpt = None,
) -> None:
    """List jobs, newest first."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    settings = _settings(config)
    body: dict[str, Any] = {"limit": limit}
    if state:
        body["state"] = state.value
    if kind:
        body["kind"] = kind
    data = _request(settings, "list", body)
    if not sys.stdout.isatty():  # scripts get one tab-separated line per job, whole values
        for j in data["jobs"]:
            row = (
                j["job_id"],
                j["kind"],
                j["state"],
                f"{j['progress'] or 0:.0f}%",
                f"{j['attempt']}/{j['max_attempts']}",
                _shown(j["input"] or ""),
                j["updated_at"],
            )
            typer.echo("\t".join(row))
        return
    # A terminal gets a table that fits its width (80 columns too): the input's file name,
    # cut with an ellipsis when it does not fit, and the time of the last change, local.
    rows = [
        (
            j["job_id"],
            j["kind"],
            j["state"],
            f"{j['progress'] or 0:.0f}",
            f"{j['attempt']}/{j['max_attempts']}",
            _short_time(j["updated_at"]),
            _shown(Path(j["input"]).name) if j["input"] else "",
        )
        for j in data["jobs"]
    ]
    console = Console()
    table = Table(box=None, padding=(0, 1), pad_edge=False, header_style="bold")
    headers = ("job", "kind", "state", "%", "try", "updated")
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(headers)]
    for header, width in zip(headers, widths, strict=True):  # whole, always: only the input gives way
        table.add_column(header, no_wrap=True, width=width, justify="right" if header == "%" else "left")
    # what is left of the line: each column but the last takes its width and 2 of padding
    room = max(8, console.width - sum(widths) - 2 * len(headers))
    table.add_column("input", no_wrap=True, overflow="ellipsis", max_width=room)
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))  # Text: "[red]" in a file name is not markup
    console.print(table)


def _short_time(stamp: str) -> str:
    """An RFC 3339 UTC time as local ``HH:MM:SS`` when it is today, else ``MM-DD HH:MM``."""
    try:
        when = datetime.fromisoformat(stamp.replace("Z", "+00:00")).astimezone()
    except ValueError:
        return stamp
    if when.date() == datetime.now().astimezone().date():
        return when.strftime("%H:%M:%S")
    return when.strftime("%m-%d %H:%M")


@app.command(cls=PlainCommand)
def show(job_id: str, config: ConfigOpt = None) -> None:
    """Print one job object as JSON, with its full result."""
    typer.echo(json.dumps(_request(_settings(config), "get", {"job_id": job_id}), indent=2, ensure_ascii=False))


@app.command(cls=PlainCommand)
def cancel(job_id: str, config: ConfigOpt = None) -> None:
    """Cancel a job: at once when queued, at its next checkpoint when running."""
    data = _request(_settings(config), "cancel", {"job_id": job_id})
    typer.echo(json.dumps(data))


@app.command(cls=PlainCommand)
def doctor(
    config: ConfigOpt = None,
    skip_model: Annotated[bool, typer.Option("--skip-model", help="do not load the Whisper model(s)")] = False,
    media_root: MediaRootOpt = None,
    node: Annotated[bool, typer.Option("--node", help="check this box as a worker node: the hub's view of it")] = False,
) -> None:
    """Check the broker, data dir, disk, database, media roots and model; exit 1 on a failure.

    Media roots: those of the configuration and ``--media-root`` (as for ``up``/``serve``);
    with none, those the running service publishes on ``<base>/info``."""
    from .doctor import run_checks

    settings = _settings(config, media_root)
    logging.getLogger().setLevel(logging.WARNING)
    failed = False

    # coloured marks; click drops the colours when standard output is not a terminal
    def paint(text: str, colour: str) -> str:
        return typer.style(text, fg=colour, bold=colour == "red")

    for check in run_checks(settings, model=not skip_model, node=node):
        typer.echo(check.line(paint))
        failed |= not check.ok
    raise typer.Exit(EXIT_FAILED if failed else 0)


@app.command(cls=PlainCommand)
def backup(dest: Annotated[Path, typer.Argument(help="new file for the copy")], config: ConfigOpt = None) -> None:
    """Copy the job database online (SQLite backup API), safe while the service runs."""
    from edge_queue.store import Store

    settings = _settings(config)
    if not settings.db_path.exists():
        typer.echo(f"edge-queue: no database at {settings.db_path}", err=True)
        raise typer.Exit(EXIT_FAILED)
    try:
        Store.backup(settings.db_path, dest)
    except FileExistsError as e:
        typer.echo(f"edge-queue: {e}; choose a new file", err=True)
        raise typer.Exit(EXIT_FAILED) from e
    except (OSError, sqlite3.Error) as e:
        typer.echo(f"edge-queue: backup failed: {e}", err=True)
        raise typer.Exit(EXIT_FAILED) from e
    typer.echo(f"backed up {settings.db_path} to {dest}")


@config_app.command("check", cls=PlainCommand)
def config_check(
    file: Annotated[Path | None, typer.Argument(envvar="EDGE_QUEUE_CONFIG", help="TOML file to check")] = None,
) -> None:
    """Validate a configuration file (and the environment); name every invalid key."""
    from edge_queue.config.rules import relay_warning, serve_problems
    from edge_queue.service import checked_kinds
    from edge_queue.watch.folders import check_watches

    try:
        settings = load_settings(file)
        check_watches(settings, checked_kinds(settings))
        if problems := serve_problems(settings):
            raise ConfigError(f"invalid configuration{f' in {file}' if file else ''}: {'; '.join(problems)}")
    except ConfigError as e:
        typer.echo(f"edge-queue: {e.message}", err=True)
        raise typer.Exit(EXIT_USAGE) from e
    if (warning := relay_warning(settings)) is not None:  # the queue runs; the relay refuses
        typer.echo(f"warning: {warning}", err=True)
    typer.echo(
        f"ok: data_dir={settings.data_dir} broker={settings.mqtt.host}:{settings.mqtt.port} "
        f"base_topic={settings.mqtt.base_topic} media_roots={[str(p) for p in settings.media_roots]}"
    )


def main() -> None:
    app(prog_name="edge-queue")
