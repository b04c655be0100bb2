"""Docs contract: everything a user can name is documented (sqlite-utils' ``test_docs.py``).

Every request command and its fields, every topic, error code, job state, job and batch field,
configuration key, built-in job kind and its options, and command-line command and option
must appear in ``docs/``; ``docs/operations.md`` and ``docs/home-assistant.md`` exist; every
configuration key must appear in ``config/edge-queue.example.toml``, with its default. The
lists come from the real modules, so a new name without documentation fails here.
"""

from __future__ import annotations

import inspect
import re
import tomllib
from collections import defaultdict
from pathlib import Path
from typing import Any, get_args, get_origin

import pytest
from pydantic import BaseModel

from edge_queue.cli import main as cli
from edge_queue.config.settings import Settings, load_settings
from edge_queue.errors import NON_RETRYABLE, ErrorCode
from edge_queue.http.statuses import STATUS
from edge_queue.kinds import BUILTIN
from edge_queue.mqtt import payloads
from edge_queue.mqtt.topics import COMMANDS, Topics
from edge_queue.requests import models
from edge_queue.rules.states import TERMINAL, TRANSITIONS, JobState

from .helpers.docs_text import DOCS, read, section

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_TOML = ROOT / "config" / "edge-queue.example.toml"
#: Placeholder for the table name of a ``dict[str, Section]`` key such as ``kinds``.
NAME = "<name>"
#: A commented-out key line of the example file: ``# key = value``, or the header of an
#: array of tables shown commented out (``# [[watch]]``).
COMMENTED_KEY = re.compile(r"^#\s*([a-z_][a-z0-9_]*\s*=.*|\[\[[a-z_]+\]\])$")


# -- helpers ----------------------------------------------------------------------------


def all_docs() -> str:
    files = sorted(DOCS.rglob("*.md"))
    assert files, f"no documentation in {DOCS}"
    return "\n".join(f.read_text(encoding="utf-8") for f in files)


def table_rows(text: str) -> list[list[str]]:
    """The cells of every Markdown table row (header and separator rows included)."""
    return [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.lstrip().startswith("|")
    ]


def row_for(text: str, name: str) -> list[str] | None:
    """The first table row whose first cell is exactly ``name`` in backticks."""
    for cells in table_rows(text):
        if cells and cells[0] == f"`{name}`":
            return cells
    return None


def _model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model of a section field (``MqttSettings``, ``MqttSettings | None``)."""
    candidates = [annotation, *get_args(annotation)]
    for c in candidates:
        if inspect.isclass(c) and issubclass(c, BaseModel):
            return c
    return None


def config_keys(model: type[BaseModel] = Settings, prefix: str = "") -> list[str]:
    """Every leaf key of the configuration as a dotted name: ``workers``, ``mqtt.tls.ca_file``,
    ``kinds.<name>.timeout_s`` (for a ``dict[str, Section]`` field)."""
    keys: list[str] = []
    for name, field in model.model_fields.items():
        dotted = prefix + name
        if get_origin(field.annotation) is dict:
            value_model = _model(get_args(field.annotation)[1])
            if value_model is not None:
                keys.extend(config_keys(value_model, f"{dotted}.{NAME}."))
            else:
                keys.append(dotted)
        elif (sub := _model(field.annotation)) is not None:
            keys.extend(config_keys(sub, dotted + "."))
        else:
            keys.append(dotted)
    return keys


def example_lines(uncomment: bool) -> str:
    text = EXAMPLE_TOML.read_text(encoding="utf-8")
    if not uncomment:
        return text
    return "\n".join(m.group(1) if (m := COMMENTED_KEY.match(line)) else line for line in text.splitlines())


def flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"mqtt": {"tls": {"enabled": False}}}`` -> ``{"mqtt.tls.enabled": False}``; the
    tables under ``kinds`` become ``kinds.<name>.<key>``. A key whose value is itself a
    table (``transcribe.models``) stays one key."""
    out: dict[str, Any] = {}
    leaves = set(config_keys())
    for key, value in table.items():
        dotted = prefix + key
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for item in value:  # an array of tables (``[[watch]]``): its keys, once each
                out.update(flatten(item, dotted + "."))
        elif isinstance(value, dict) and dotted not in leaves:
            if dotted == "kinds":
                for kind_name, kind_table in value.items():
                    for k, v in kind_table.items():
                        out.setdefault(f"kinds.{NAME}.{k}", {})[kind_name] = v
            else:
                out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def example_only_keys() -> set[str]:
    """Keys whose value in the example is an example, not the default: the line before the
    key says ``(example)`` (``data_dir``, ``media_roots``)."""
    keys, section_prefix, previous = set(), "", ""
    for line in EXAMPLE_TOML.read_text(encoding="utf-8").splitlines():
        if m := re.match(r"^\[([a-z_.]+)\]", line):
            section_prefix = m.group(1) + "."
        elif (m := re.match(r"^([a-z_]+)\s*=", line)) and "(example)" in previous:
            keys.add(section_prefix + m.group(1))
        previous = line
    return keys


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``EDGE_QUEUE_...`` variable of the caller leaks into the configuration."""
    import os

    for var in list(os.environ):
        if var.upper().startswith("EDGE_QUEUE_"):
            monkeypatch.delenv(var)


# -- requests and responses -------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
def test_command_has_a_section(command: str) -> None:
    # Given the topics page, when looking for the command, then it has its own heading
    section(read("topics.md"), re.compile(rf"^###\s.*`{re.escape(command)}`"))


@pytest.mark.parametrize("command", COMMANDS)
def test_request_fields_documented(command: str) -> None:
    text = read("topics.md")
    own = section(text, re.compile(rf"^###\s.*`{re.escape(command)}`"))
    general = section(text, re.compile(r"^##\s+Requests and responses"))
    for field in models.REQUEST_MODELS[command].model_fields:
        where = own if f"`{field}`" in own else general
        assert f"`{field}`" in where, f"request field {field!r} of {command} is not documented"


def test_every_command_has_a_request_model() -> None:
    # The docs describe the fields of REQUEST_MODELS: a command without one would be undocumented
    assert set(models.REQUEST_MODELS) == set(COMMANDS)


@pytest.mark.parametrize("code", list(ErrorCode), ids=str)
def test_error_code_documented_with_retryability(code: ErrorCode) -> None:
    row = row_for(section(read("topics.md"), re.compile(r"^##\s+Error codes")), code.value)
    assert row is not None, f"error code {code.value!r} has no row in docs/topics.md"
    retryable = row[-1].lower()
    if code in NON_RETRYABLE:
        assert retryable.startswith("no"), f"{code.value} is in NON_RETRYABLE; the docs say {row[-1]!r}"
    else:
        assert retryable.startswith(("yes", "n/a")), f"{code.value} is retryable; the docs say {row[-1]!r}"


def test_response_shapes_documented() -> None:
    text = read("topics.md")
    ok = payloads.ok({}, "t")
    err = payloads.error(ErrorCode.INVALID_REQUEST, "m", "t", field="f")
    for key in [*ok, *err, *err["error"], "rejected"]:
        assert f'"{key}"' in text or f"`{key}`" in text or f"error.{key}" in text, key


# -- topics -----------------------------------------------------------------------------

#: How each public method of Topics turns into documented topic strings.
_TOPIC_METHODS = {
    "job": lambda t: [t.job("x").removesuffix("x") + "<job_id>"],
    "batch": lambda t: [t.batch("x").removesuffix("x") + "<batch_id>"],
    "request": lambda t: [t.request("<command>")],
    "response": lambda t: [t.response(None), t.response(COMMANDS[0]).rsplit("/", 1)[0] + "/<command>"],
    "reply_prefix": lambda t: [t.reply_prefix()],
    "user_reply_prefix": lambda t: [t.user_reply_prefix("<user>")],
    "user_response": lambda t: [t.user_response("<user>", COMMANDS[0]).rsplit("/", 1)[0] + "/<command>"],
    "node": lambda t: [t.node("<node_id>")],
    "node_up": lambda t: [t.node_up("<node_id>")],
    "node_down": lambda t: [t.node_down("<node_id>")],
    "ha": lambda t: [t.ha("last"), t.ha("submit"), t.ha("finished")],
    # parsers and validators: no topic of their own
    "parse_request": lambda t: [],
    "parse_job": lambda t: [],
    "parse_batch": lambda t: [],
    "parse_node": lambda t: [],
    "valid_reply_to": lambda t: [],
}


def documented_topics() -> list[str]:
    t = Topics("<base>")
    found: list[str] = []
    for name, member in inspect.getmembers(Topics):
        if name.startswith("_") or name == "base":
            continue
        if isinstance(member, property):
            found.append(getattr(t, name))
        elif callable(member):
            assert name in _TOPIC_METHODS, f"Topics.{name} is new: document its topic in docs/topics.md and map it here"
            found.extend(_TOPIC_METHODS[name](t))
    return found


@pytest.mark.parametrize("topic", documented_topics())
def test_topic_documented(topic: str) -> None:
    assert f"`{topic}`" in read("topics.md"), f"topic {topic} is not documented"


def test_every_command_topic_in_examples() -> None:
    text = read("topics.md")
    for command in COMMANDS:
        assert Topics("edge-queue").request(command) in text, f"no example publishes {command}"


# -- job object, batch, states ----------------------------------------------------------


def test_job_object_fields_documented() -> None:
    text = section(read("topics.md"), re.compile(r"^##\s+The job object"))
    for field in payloads.job_object({}):
        assert row_for(text, field) is not None, f"job field {field!r} has no row"


def test_batch_object_fields_documented() -> None:
    text = section(read("topics.md"), re.compile(r"^###\s+`<base>/batches/"))
    for field in payloads.batch_object(defaultdict(lambda: None)):
        assert row_for(text, field) is not None, f"batch field {field!r} has no row"


@pytest.mark.parametrize("state", list(JobState), ids=str)
def test_state_documented(state: JobState) -> None:
    row = row_for(section(read("topics.md"), re.compile(r"^##\s+States")), state.value)
    assert row is not None, f"state {state.value!r} has no row in docs/topics.md"
    assert row[1].startswith("yes" if state in TERMINAL else "no"), row


def documented_transitions(text: str) -> set[tuple[str, str]]:
    states = {s.value for s in JobState}
    pairs: set[tuple[str, str]] = set()
    for cells in table_rows(section(text, re.compile(r"^##\s+States"))):
        if len(cells) >= 3:
            srcs = set(re.findall(r"`([a-z]+)`", cells[0])) & states
            dsts = set(re.findall(r"`([a-z]+)`", cells[1])) & states
            if len(cells[1].split("`")) == 3:  # exactly one destination state per row
                pairs |= {(s, d) for s in srcs for d in dsts}
    pairs |= set(re.findall(r"`([a-z]+)` → `([a-z]+)`", text))
    return pairs


def test_every_allowed_transition_documented() -> None:
    documented = documented_transitions(read("topics.md"))
    for src, dsts in TRANSITIONS.items():
        for dst in dsts:
            assert (src.value, dst.value) in documented, f"{src} -> {dst} is not documented"


def test_no_transition_documented_that_is_not_allowed() -> None:
    for src, dst in documented_transitions(read("topics.md")):
        assert JobState(dst) in TRANSITIONS[JobState(src)], f"docs claim {src} -> {dst}"


# -- configuration ----------------------------------------------------------------------


def test_config_walk_finds_nested_keys() -> None:
    keys = config_keys()
    for key in ("workers", "mqtt.host", "mqtt.tls.ca_file", f"kinds.{NAME}.timeout_s"):
        assert key in keys


@pytest.mark.parametrize("key", config_keys())
def test_config_key_documented(key: str) -> None:
    assert f"`{key}`" in all_docs(), f"configuration key {key} is not documented in docs/"


def test_environment_override_documented() -> None:
    text = all_docs()
    assert Settings.model_config["env_prefix"] in text
    assert f"EDGE_QUEUE_MQTT{Settings.model_config['env_nested_delimiter']}HOST" in text
    assert "EDGE_QUEUE_CONFIG" in text


@pytest.mark.parametrize("key", config_keys())
def test_config_key_in_example(key: str) -> None:
    keys = flatten(tomllib.loads(example_lines(uncomment=True)))
    assert key in keys, f"configuration key {key} is missing from {EXAMPLE_TOML.name}"


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize("uncomment", [False, True], ids=["as-is", "uncommented"])
def test_example_config_is_valid(uncomment: bool, tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(example_lines(uncomment), encoding="utf-8")
    settings = load_settings(path)
    assert settings.media_roots, "the example should show a media root"


@pytest.mark.usefixtures("clean_env")
def test_example_values_are_the_defaults() -> None:
    defaults = flatten(Settings().model_dump(mode="json"))
    defaults.pop("kinds", None)
    example = flatten(tomllib.loads(example_lines(uncomment=False)))
    skip = example_only_keys()
    assert {"data_dir", "media_roots"} <= skip
    for key, value in example.items():
        if key in skip:
            continue
        if key.startswith(f"kinds.{NAME}."):
            field = key.rsplit(".", 1)[1]
            for kind_name, kind_value in value.items():
                builtin = getattr(Settings().kind(kind_name), field)
                assert kind_value == builtin, f"kinds.{kind_name}.{field}: {kind_value} != {builtin}"
        else:
            assert value == defaults[key], f"{key} = {value!r} in the example; default {defaults[key]!r}"


# -- command line -----------------------------------------------------------------------


def cli_commands() -> list[tuple[str, Any]]:
    """``("config check", <command>)`` for every leaf command of the typer app."""
    import typer.main

    out: list[tuple[str, Any]] = []

    def walk(cmd: Any, prefix: str) -> None:
        for name, sub in cmd.commands.items():
            if hasattr(sub, "commands"):
                walk(sub, f"{prefix}{name} ")
            else:
                out.append((prefix + name, sub))

    walk(typer.main.get_command(cli.app), "")
    return out


def test_cli_walk_finds_commands() -> None:
    names = [n for n, _ in cli_commands()]
    assert "serve" in names and "config check" in names


@pytest.mark.parametrize("name", [n for n, _ in cli_commands()])
def test_cli_command_documented(name: str) -> None:
    text = read("cli.md")
    own = section(text, re.compile(rf"^##\s+`edge-queue {re.escape(name)}`"))
    command = dict(cli_commands())[name]
    for param in command.params:
        for opt in param.opts:
            if opt.startswith("--") and opt != "--help":
                assert opt in own, f"option {opt} of edge-queue {name} is not documented"


def test_new_cli_commands_documented() -> None:
    # doctor and backup exist and have their own section (with --skip-model for doctor)
    names = [n for n, _ in cli_commands()]
    assert "doctor" in names and "backup" in names
    text = read("cli.md")
    assert "--skip-model" in section(text, re.compile(r"^##\s+`edge-queue doctor`"))
    assert "DEST" in section(text, re.compile(r"^##\s+`edge-queue backup`"))


@pytest.mark.parametrize("name", [n for n, _ in cli_commands()])
def test_cli_command_in_overview(name: str) -> None:
    # every command is in the table at the top of cli.md
    assert row_for(read("cli.md"), f"edge-queue {name}") is not None, f"edge-queue {name} is not in the table"


def test_exit_codes_documented() -> None:
    text = section(read("cli.md"), re.compile(r"^##\s+Exit codes"))
    for code in (0, cli.EXIT_FAILED, cli.EXIT_USAGE, cli.EXIT_NO_BROKER):
        assert f"| {code} |" in text, f"exit code {code} is not documented"


# -- job kinds --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(BUILTIN))
def test_kind_documented_with_options(kind: str) -> None:
    # Every built-in kind has its own section in topics.md that names each of its options
    own = section(read("topics.md"), re.compile(rf"^###\s+`{re.escape(kind)}`"))
    for option in BUILTIN[kind].Options.model_fields:
        assert f"`{option}`" in own, f"option {option!r} of kind {kind} is not documented"


@pytest.mark.parametrize("kind", sorted(BUILTIN))
def test_kind_in_readme_table(kind: str) -> None:
    assert row_for((ROOT / "README.md").read_text(encoding="utf-8"), kind) is not None, kind


# -- operations and Home Assistant ------------------------------------------------------


@pytest.mark.parametrize(
    ("page", "needles"),
    [
        ("operations.md", ["edge-queue backup", "journalctl", "edge-queue doctor", "ReadWritePaths"]),
        ("home-assistant.md", ["<base>/events", "<base>/status", "<base>/queue", "mqtt.publish"]),
    ],
)
def test_guide_pages(page: str, needles: list[str]) -> None:
    assert (DOCS / page).is_file(), f"docs/{page} is missing"
    text = read(page)
    for needle in needles:
        assert needle in text, f"docs/{page} does not mention {needle}"


def test_home_assistant_yaml_is_valid() -> None:
    # Every YAML block of the Home Assistant page parses (HA's !secret etc. are not used)
    import yaml

    blocks = re.findall(r"```yaml\n(.*?)```", read("home-assistant.md"), re.S)
    assert blocks
    for block in blocks:
        yaml.safe_load(block)


def test_every_http_error_code_is_documented() -> None:
    docs = read("http-api.md")
    raised: set[str] = set()
    for module in (Path(__file__).resolve().parent.parent / "edge_queue" / "http").glob("*.py"):
        raised |= {code.lower() for code in re.findall(r"code=ErrorCode\.([A-Z_]+)", module.read_text())}
    assert {"forbidden", "busy", "disk_full", "model_not_found", "stopping"} <= raised
    assert raised <= set(STATUS), (
        f"codes raised without a status in edge_queue/http/statuses.py: {raised - set(STATUS)}"
    )
    missing = sorted(c for c in STATUS if f"`{c}`" not in docs)
    assert not missing, f"error codes of edge_queue/http not in docs/http-api.md: {missing}"
