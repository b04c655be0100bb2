"""Request decoding at the edge, topics, configuration and backoff: pure logic."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from edge_queue.config.settings import load_settings
from edge_queue.errors import ConfigError, ErrorCode, InputError, RequestError
from edge_queue.mqtt import payloads
from edge_queue.mqtt.topics import Topics
from edge_queue.requests.models import SubmitRequest, decode_request
from edge_queue.rules import inputs
from edge_queue.rules.inputs import check_input
from edge_queue.rules.lifecycle import backoff_s


def decode(command: str, raw: bytes):
    return decode_request(command, raw, max_bytes=1024, default_kind="transcribe")


def test_bare_path_json_string_and_array() -> None:
    assert decode("submit", b"/srv/a.m4a\n").input == "/srv/a.m4a"
    assert decode("submit", b'"/srv/a.m4a"').input == "/srv/a.m4a"
    req = decode("submit", b'["/a", "/b"]')
    assert isinstance(req, SubmitRequest) and req.inputs == ["/a", "/b"] and req.kind == "transcribe"


def test_a_byte_order_mark_before_the_payload_is_ignored() -> None:
    """Windows tools write a UTF-8 byte-order mark before text; it is not part of the request
    (docs/topics.md, "Requests and responses")."""
    req = decode("submit", b'\xef\xbb\xbf{"kind": "noop", "input": "x"}')
    assert isinstance(req, SubmitRequest) and (req.kind, req.input) == ("noop", "x")
    req = decode("submit", b"\xef\xbb\xbf/srv/media/call.m4a\n")
    assert isinstance(req, SubmitRequest) and req.input == "/srv/media/call.m4a"
    assert decode("get", b'\xef\xbb\xbf {"job_id": "abc"}').job_id == "abc"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("command", "raw", "code", "field"),
    [
        ("submit", b"{", ErrorCode.INVALID_JSON, None),
        ("submit", b"\xff", ErrorCode.INVALID_JSON, None),
        ("submit", b"x" * 2000, ErrorCode.PAYLOAD_TOO_LARGE, None),
        ("nope", b"{}", ErrorCode.UNKNOWN_COMMAND, None),
        ("submit", b'{"input": 5}', ErrorCode.INVALID_REQUEST, "input"),
        ("submit", b'{"input": "/a", "colour": 1}', ErrorCode.INVALID_REQUEST, "colour"),
        ("submit", b'{"input": "/a", "run_at": "tomorrow"}', ErrorCode.INVALID_REQUEST, "run_at"),
        ("list", b'{"limit": 0}', ErrorCode.INVALID_REQUEST, "limit"),
        ("get", b"[]", ErrorCode.INVALID_REQUEST, "(root)"),
        ("purge", b'{"older_than_s": 0, "states": []}', ErrorCode.INVALID_REQUEST, "states"),
        ("get", b"\xef\xbb\xbf", ErrorCode.INVALID_JSON, None),
        ("submit", b" \n", ErrorCode.INVALID_JSON, None),  # empty: not a bare path
    ],
)
def test_bad_requests_raise_with_code_and_field(command, raw, code, field) -> None:
    with pytest.raises(RequestError) as e:
        decode(command, raw)
    assert e.value.code == code
    if field:
        assert e.value.field == field


def test_topics_closed_vocabulary() -> None:
    t = Topics("home/eq")
    assert t.job("abc123") == "home/eq/jobs/abc123"
    assert t.response("submit") == "home/eq/response/submit"
    assert t.response("rm -rf") == "home/eq/response/unknown"
    with pytest.raises(ValueError):
        t.job("../x")
    with pytest.raises(ValueError):
        Topics("a/#")
    assert t.valid_reply_to("home/eq/reply/me") and t.valid_reply_to("home/eq/reply/phone/x")
    assert not t.valid_reply_to("home/eq/jobs/x") and not t.valid_reply_to("home/eq/reply/+/b")
    # only under <base>/reply/: the shipped ACLs let the service publish nowhere else
    assert not t.valid_reply_to("phone/replies") and not t.valid_reply_to("home/eq/reply/")
    assert t.parse_request("home/eq/request/get") == ("get", None) and t.parse_request("other/request/get") is None
    assert t.parse_request("home/eq/request/get/alice") == ("get", "alice")
    assert t.parse_request("home/eq/request/get/a/b") == ("get/a/b", None)
    # only bob may publish on request/+/bob (the shipped ACLs): an empty command level is still his
    assert t.parse_request("home/eq/request//bob") == ("", "bob")
    assert t.parse_request("home/eq/request/get/") == ("get/", None)
    assert t.valid_reply_to("home/eq/reply/alice/x", "alice") and not t.valid_reply_to("home/eq/reply/bob/x", "alice")
    assert not t.valid_reply_to("home/eq/reply/alice/", "alice") and not t.valid_reply_to(
        "home/eq/reply/alicex/y", "alice"
    )


def test_check_input_confines_to_media_roots(tmp_path: Path) -> None:
    root = tmp_path / "media"
    root.mkdir()
    (root / "a.wav").write_bytes(b"x")
    secret = tmp_path / "secret.wav"
    secret.write_bytes(b"x")
    (root / "link.wav").symlink_to(secret)
    assert check_input(str(root / "a.wav"), [root]) == str(root / "a.wav")
    for raw, code in [
        (str(root / "missing.wav"), ErrorCode.INPUT_NOT_FOUND),
        (str(root / ".." / "secret.wav"), ErrorCode.INPUT_OUTSIDE_MEDIA_ROOTS),
        (str(root / "link.wav"), ErrorCode.INPUT_OUTSIDE_MEDIA_ROOTS),
        ("a.wav", ErrorCode.INPUT_OUTSIDE_MEDIA_ROOTS),
        (str(root), ErrorCode.INPUT_NOT_FOUND),
        # errors of the file system itself are input_not_found too, never an internal error
        (str(root / ("L" * 300 + ".wav")), ErrorCode.INPUT_NOT_FOUND),  # ENAMETOOLONG
        (str(root / "a.wav" / "x.wav"), ErrorCode.INPUT_NOT_FOUND),  # ENOTDIR
        (str(root / "/".join(["d" * 200] * 25)), ErrorCode.INPUT_NOT_FOUND),  # over PATH_MAX
    ]:
        with pytest.raises(InputError) as e:
            check_input(raw, [root])
        assert e.value.code == code, raw


def test_config_names_bad_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('workers = "many"\ncolour = 1\n[mqtt]\nport = 70000\n')
    with pytest.raises(ConfigError) as e:
        load_settings(bad)
    for key in ("workers", "colour", "mqtt.port"):
        assert key in e.value.message
    good = tmp_path / "good.toml"
    good.write_text(
        'media_roots = ["/srv/media"]\n[mqtt]\nbase_topic = "home/eq"\n[kinds.probe]\nmax_concurrency = 4\n'
    )
    monkeypatch.setenv("EDGE_QUEUE_MQTT__PORT", "1884")
    s = load_settings(good)
    assert s.mqtt.port == 1884 and s.mqtt.base_topic == "home/eq" and s.media_roots == [Path("/srv/media")]
    assert s.kind("probe").max_concurrency == 4 and s.kind("transcribe").max_concurrency == 1
    with pytest.raises(ConfigError):
        load_settings(tmp_path / "missing.toml")


def test_a_toml_value_of_the_wrong_toml_type_is_named_not_converted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given values pydantic would convert ("2", true and 2.0 all gave 2), in tables, arrays of
    # tables and per-kind tables, beside a value pydantic refuses itself
    bad = tmp_path / "typed.toml"
    bad.write_text(
        'workers = "2"\nretention_days = true\n[transcribe]\nchunks_at_once = 2.0\nvad = "yes"\n'
        'beam_size = true\n[kinds.transcribe]\nmax_concurrency = "1"\n[mqtt]\nport = 70000\n'
        '[[watch]]\npath = "/srv/media/in"\nsettle_s = true\n'
    )
    with pytest.raises(ConfigError) as e:
        load_settings(bad)
    # Then each is named once, with the type it should have
    message = e.value.message
    for key, want in [
        ("workers", "an integer"),
        ("retention_days", "a number"),
        ("transcribe.chunks_at_once", "an integer"),
        ("transcribe.vad", "true or false"),
        ("transcribe.beam_size", "an integer"),
        ("kinds.transcribe.max_concurrency", "an integer"),
        ("watch.0.settle_s", "a number"),
    ]:
        assert f"{key}: should be {want}" in message, (key, message)
    assert "mqtt.port" in message and message.count("workers") == 1 and message.count("settle_s") == 1
    # And numbers of the right TOML type pass (an integer for a float key too), and the
    # environment's strings are still converted
    good = tmp_path / "good.toml"
    good.write_text("retention_days = 3\n[transcribe]\nchunks_at_once = 2\nvad = false\n")
    monkeypatch.setenv("EDGE_QUEUE_WORKERS", "3")
    s = load_settings(good)
    assert (s.retention_days, s.transcribe.chunks_at_once, s.transcribe.vad, s.workers) == (3.0, 2, False, 3)


def float_keys() -> list[tuple[str, str]]:
    """Every float key of the configuration, as (its name in errors, a TOML document setting
    it to ``{}``): top level, tables, ``[kinds.<name>]`` and ``[[watch]]``. Read from the
    settings models, so a float key added later is covered too."""
    from pydantic import BaseModel

    from edge_queue.config.settings import KindSettings, Settings, WatchSettings

    def floats(model: type[BaseModel]) -> list[str]:
        return [n for n, f in model.model_fields.items() if "float" in str(f.annotation)]

    keys = [(n, f"{n} = {{}}\n") for n in floats(Settings)]
    for name, field in Settings.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += [(f"{name}.{n}", f"[{name}]\n{n} = {{}}\n") for n in floats(ann)]
    keys += [(f"kinds.noop.{n}", f"[kinds.noop]\n{n} = {{}}\n") for n in floats(KindSettings)]
    keys += [(f"watch.0.{n}", f'[[watch]]\npath = "/srv/in"\n{n} = {{}}\n') for n in floats(WatchSettings)]
    return keys


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_no_float_key_takes_an_infinite_or_nan_value(tmp_path: Path, value: str) -> None:
    # Given each float key of the configuration set to a TOML inf or nan (retention_days = inf
    # passed `config check`: no key means "never" by it, and no date is infinite)
    keys = float_keys()
    assert {"retention_days", "cancel_grace_s", "retry.backoff_cap_s", "kinds.noop.timeout_s"} <= {k for k, _ in keys}
    for key, doc in keys:
        path = tmp_path / "inf.toml"
        path.write_text(doc.format(value))
        # Then the key is named, as not a finite number
        with pytest.raises(ConfigError) as e:
            load_settings(path)
        assert f"{key}: Input should be a finite number" in e.value.message, (key, e.value.message)


def test_an_infinite_value_from_the_environment_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    monkeypatch.setenv("EDGE_QUEUE_LIMITS__MAX_REQUESTS_PER_S", "inf")
    with pytest.raises(ConfigError) as e:
        load_settings(empty)
    assert "limits.max_requests_per_s: Input should be a finite number" in e.value.message


@pytest.mark.parametrize(
    ("doc", "key", "top"),
    [
        ("[mqtt]\nsession_expiry_s = {}\n", "mqtt.session_expiry_s", 2**32 - 1),
        ("[mqtt]\nfinished_expiry_s = {}\n", "mqtt.finished_expiry_s", 2**32 - 1),
        ("retention_days = {}\n", "retention_days", 36_500),
        ("[retry]\nbackoff_base_s = {}\n", "retry.backoff_base_s", 365 * 86400),
        ("[retry]\nbackoff_cap_s = {}\n", "retry.backoff_cap_s", 365 * 86400),
    ],
)
def test_a_value_config_check_takes_is_one_the_service_can_use(tmp_path: Path, doc: str, key: str, top: int) -> None:
    # Given the largest value of a key that becomes an MQTT interval (4 bytes) or a date (before,
    # session_expiry_s 2**32 passed config check and the start died on struct.pack;
    # finished_expiry_s 2**32 killed the service at each finished job; retention_days 1,000,000
    # killed it at its first retention run: year -711)
    import struct
    import time as clock

    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    from edge_queue.store.ids import iso

    path = tmp_path / "c.toml"
    path.write_text(doc.format(top))
    s = load_settings(path)
    # Then it is taken, and what it becomes can be sent or stored
    if key.startswith("mqtt."):
        props = Properties(PacketTypes.CONNECT if "session" in key else PacketTypes.PUBLISH)
        value = getattr(s.mqtt, key.split(".")[1])
        if "session" in key:
            props.SessionExpiryInterval = value
        else:
            props.MessageExpiryInterval = value
        assert props.pack()
        over = Properties(PacketTypes.CONNECT)
        over.SessionExpiryInterval = top + 1
        with pytest.raises(struct.error):  # what one more would have done
            over.pack()
    elif key == "retention_days":
        assert iso(clock.time() - s.retention_days * 86400) < iso(clock.time())
    else:
        assert iso(clock.time() + getattr(s.retry, key.split(".")[1]))
    # And one more is named as out of range
    path.write_text(doc.format(top + 1))
    with pytest.raises(ConfigError) as e:
        load_settings(path)
    assert f"{key}: Input should be less than or equal to" in e.value.message


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("EDGE_QUEUE_MEDIA_ROOTS", "/srv/media"),
        ("EDGE_QUEUE_WATCH", "not json"),
        ("EDGE_QUEUE_MQTT__TLS", "x"),
        ("EDGE_QUEUE_KINDS__NOOP__PREFER", "hub"),
    ],
)
def test_an_environment_variable_that_is_not_json_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    # Given a list or a table set from the environment with a value that is not JSON, beside
    # a string key that is not JSON either (before: "cannot read configuration file <a valid
    # file>: error parsing value for field ...", naming neither the variable nor JSON)
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    monkeypatch.setenv(variable, value)
    monkeypatch.setenv("EDGE_QUEUE_MQTT__HOST", "box.lan")
    with pytest.raises(ConfigError) as e:
        load_settings(empty)
    # Then the variable is named, the string key is not, and the file is not blamed
    assert f"the environment variable {variable} should hold JSON" in e.value.message
    assert "MQTT__HOST" not in e.value.message and str(empty) not in e.value.message


def test_full_jitter_backoff_bounds() -> None:
    assert backoff_s(1, 5, 300, rng=lambda: 1.0) == 5
    assert backoff_s(3, 5, 300, rng=lambda: 1.0) == 20
    assert backoff_s(20, 5, 300, rng=lambda: 1.0) == 300
    assert backoff_s(4, 5, 300, rng=lambda: 0.5) == 20
    assert backoff_s(2, 5, 300, rng=lambda: 0.0) == 0


def test_job_object_is_json(tmp_path: Path) -> None:
    from edge_queue.mqtt.payloads import job_object
    from edge_queue.store import JobSpec, Store

    store = Store(tmp_path / "q.db")
    _, (c,) = store.submit([JobSpec("noop", None, {})], 1.0)
    obj = job_object(c.job)
    assert obj["v"] == 1 and json.loads(json.dumps(obj)) == obj
    assert set(obj) >= {
        "job_id",
        "seq",
        "state",
        "progress",
        "attempt",
        "max_attempts",
        "retry_at",
        "error",
        "result",
        "created_at",
        "updated_at",
    }


def test_unknown_environment_variables_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from edge_queue.config.settings import unknown_environment

    env = {
        "EDGE_QUEUE_MQTT__HOST": "x",
        "EDGE_QUEUE_WORKERS": "2",
        "EDGE_QUEUE_KINDS__PROBE__TIMEOUT_S": "3",
        "EDGE_QUEUE_CONFIG": "/etc/x.toml",
        "EDGE_QUEUE_WORKER": "2",
        "EDGE_QUEUE_MQTT__HOTS": "x",
        "EDGE_QUEUE_KINDS__PROBE__TIMEOUT": "3",
        "OTHER": "1",
    }
    assert unknown_environment(env) == [
        "EDGE_QUEUE_KINDS__PROBE__TIMEOUT",
        "EDGE_QUEUE_MQTT__HOTS",
        "EDGE_QUEUE_WORKER",
    ]
    monkeypatch.setenv("EDGE_QUEUE_WORKER", "2")
    with pytest.raises(ConfigError) as e:
        load_settings()
    assert "EDGE_QUEUE_WORKER" in e.value.message


def test_rejected_requests_are_logged_at_most_twenty_per_ten_seconds(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from edge_queue.rules import rates

    now = [1000.0]
    monkeypatch.setattr(rates.time, "monotonic", lambda: now[0])
    rejections = rates.RejectionLog()
    with caplog.at_level("WARNING", logger="edge_queue.rules.rates"):
        # Given 500 bad requests in one second: 20 lines, the rest counted
        for i in range(500):
            rejections.warning("request %s rejected: invalid_json", i)
        assert len(caplog.records) == 20
        # When the next one comes after the window, then the count comes first, in one line
        now[0] += rates.REJECTION_WINDOW_S
        rejections.warning("request %s rejected: invalid_json", "late")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[20] == "480 more rejected request(s) not logged in 10 s"
    assert lines[21] == "request late rejected: invalid_json"


@pytest.mark.parametrize(
    "raw",
    [
        b'{"kind": "noop", "input": "/x\\ud800"}',
        b'{"kind": "noop", "transaction": ["\\udfff"]}',
        b'{"kind": "noop", "options": {"k": "\\ud83d"}}',
        b'"\\udc80"',
    ],
)
def test_lone_surrogate_escapes_are_invalid_requests(raw: bytes) -> None:
    with pytest.raises(RequestError) as e:
        decode_request("submit", raw, max_bytes=10_000, default_kind="noop")
    assert (e.value.code, e.value.field) == ("invalid_request", "(root)")
    assert payloads.peek_envelope(raw)[0] is None


@pytest.mark.parametrize(
    ("command", "raw", "field"),
    [
        ("submit", b'{"kind": "noop", "run_at": "0001-01-01T00:30:00+01:00"}', "run_at"),
        ("submit", b'{"kind": "noop", "run_at": "9999-12-31T23:30:00-01:00"}', "run_at"),
        ("submit", b'{"kind": "noop", "run_at": "1969-12-31T23:59:59Z"}', "run_at"),
        ("submit", b'{"kind": "noop", "run_at": "9999-12-31T23:59:59.999999+00:00"}', "run_at"),
        ("purge", b'{"older_than_s": 1e308}', "older_than_s"),
    ],
)
def test_out_of_range_times_are_invalid_requests(command: str, raw: bytes, field: str) -> None:
    with pytest.raises(RequestError) as e:
        decode_request(command, raw, max_bytes=10_000, default_kind="noop")
    assert (e.value.code, e.value.field) == ("invalid_request", field)


def test_text_that_is_not_unicode_is_encoded_as_escapes() -> None:
    # a file name that is not UTF-8, as Python keeps it (surrogateescape)
    name = os.fsdecode(b"/srv/media/caf\xe9.m4a")
    assert json.loads(payloads.encode({"input": name}))["input"] == name


def test_ha_last_summary_names_the_file_and_has_no_dangling_colon() -> None:
    from edge_queue.publish.discovery import last_payload

    def job(**kw: object) -> dict[str, object]:
        return {"job_id": "j1", "kind": "noop", "state": "succeeded", "input": None, "result": None, **kw}

    assert last_payload(job())["summary"] == "noop succeeded"
    failed = job(kind="transcribe", state="failed", input="/srv/media/call.m4a", error={"code": "timeout"})
    assert last_payload(failed)["summary"] == "transcribe failed: call.m4a"
    spoken = job(kind="transcribe", input="/srv/media/call.m4a", result={"text": " Hello there. " + "x" * 300})
    assert last_payload(spoken)["summary"] == ("Hello there. " + "x" * 300)[:255]
    assert last_payload(job(result={"text": "   "}))["summary"] == "noop succeeded"


_PAYLOADS = [
    b'{"kind": "noop", "input": "x", "transaction": "t1"}',
    b'\xef\xbb\xbf {"kind": "noop", "transaction": 7, "reply_to": "edge-queue/reply/me"}\n',
    b'{"transaction": {"a": [1, 2]}, "reply_to": "x/y", "kind": "noop"}',
    b'{"transaction": "a", "transaction": "b", "reply_to": 5}',
    b'{"\\u0074ransaction": "spelt with an escape", "kind": "noop"}',
    b'{"transaction": "\\ud800", "kind": "noop"}',
    b'{"transaction": "' + b"x" * 2000 + b'", "kind": "noop"}',
    b'{"transaction": NaN, "kind": "noop"}',
    b'{"transaction": 1e999, "kind": "noop"}',
    b'{"kind": "noop", "options": {"a": 1}, "reply_to": "' + "é".encode() * 600 + b'"}',
    b'{"job_id": "abc", "transaction": null}',
    b'{"kind": 5}',
    b"{not json",
    b'["/a", "/b"]',
    b'"/srv/a.m4a"',
    b"/srv/a.m4a",
    b"",
    b"  ",
    b"\xff\xfe{",
    '{"kind": "noop", "transaction": "t"}'.encode("utf-16"),
    b"[" * 5000 + b"]" * 5000,
    b'{"a":' * 3000 + b"1" + b"}" * 3000,
]


@pytest.mark.parametrize("command", ["submit", "get", "cancel", "list", "pause", "purge", "events"])
@pytest.mark.parametrize("raw", _PAYLOADS, ids=range(len(_PAYLOADS)))
def test_a_request_parsed_once_reads_as_when_parsed_twice(command: str, raw: bytes) -> None:
    """Commands.execute parses a request's JSON once (payloads.parse_object) for its envelope
    and its model: the transaction, the reply_to and the request, or the error, are those of
    peek_envelope and decode_request reading the bytes themselves."""
    parsed = payloads.parse_object(raw)
    if parsed is not None:
        assert payloads.envelope(parsed) == payloads.peek_envelope(raw)

    def outcome(**kw: object) -> object:
        try:
            return decode_request(command, raw, max_bytes=100_000, default_kind="noop", **kw)  # type: ignore[arg-type]
        except RequestError as e:
            return (e.code, e.field, e.message)

    assert outcome(parsed=parsed) == outcome()


def test_a_transaction_is_measured_in_utf8_bytes_of_compact_json() -> None:
    """docs/topics.md, "Order of checks": at most 1,024 bytes of JSON, counted in UTF-8."""
    accented = "é" * 511  # 1,022 bytes + 2 quotes = 1,024: the most there may be
    raw = json.dumps({"kind": "noop", "transaction": accented}).encode()
    assert decode_request("submit", raw, max_bytes=10_000, default_kind="noop").transaction == accented
    assert payloads.peek_envelope(raw)[0] == accented
    over = json.dumps({"kind": "noop", "transaction": accented + "e"}).encode()
    with pytest.raises(RequestError) as e:
        decode_request("submit", over, max_bytes=10_000, default_kind="noop")
    assert e.value.field == "transaction"
    assert payloads.peek_envelope(over)[0] is None
    assert payloads.transaction_too_large("x" * 1022) is False
    assert payloads.transaction_too_large("x" * 1023) is True


@pytest.mark.parametrize(
    "text",
    [
        "2026-12-02T19:48:50.780Z",
        "2026-12-02t19:48:50.780z",
        "2026-12-02T19:48:50.780z",
        "2026-12-02t20:48:50.780+01:00",
    ],
)
def test_run_at_takes_the_lower_case_t_and_z_rfc_3339_allows(text: str) -> None:
    """RFC 3339 section 5.6: "T" and "Z" may be lower case."""
    raw = json.dumps({"kind": "noop", "run_at": text}).encode()
    request = decode_request("submit", raw, max_bytes=65536, default_kind="noop")
    assert request.run_at_ts() == pytest.approx(1796240930.78)


@pytest.mark.parametrize("container", [False, True])
def test_a_path_outside_the_media_roots_is_answered_for_where_the_service_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, container: bool
) -> None:
    # Given a service in edge-queue's image (which sets EDGE_QUEUE_IN_CONTAINER=1), or on the box
    # itself (which may be a container of its own, with a /.dockerenv, as a development box is)
    if container:
        monkeypatch.setenv(inputs.CONTAINER_MARK, "1")
    else:
        monkeypatch.delenv(inputs.CONTAINER_MARK, raising=False)
    # When a path of the box is sent
    with pytest.raises(InputError) as e:
        check_input("/work/shared/media/speech/jfk.flac", [Path("/media")])
    # Then the container's answer says to send the container's path, the box's the configuration
    assert e.value.code == ErrorCode.INPUT_OUTSIDE_MEDIA_ROOTS
    assert ("send the path as the container sees it" in e.value.message) == container, e.value.message
    assert ("/media/..." in e.value.message) == container, e.value.message
    assert ("--media-root of edge-queue up/serve" in e.value.message) == (not container), e.value.message
