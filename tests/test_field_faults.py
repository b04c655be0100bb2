"""Faults users met in the field, each as the user met it, against the real service process and
a real broker (docs/operations.md "Logs", "Files the service writes"; docs/cli.md "doctor";
docs/topics.md "Error codes")."""

from __future__ import annotations

import os
import re
import shutil
import signal
import sqlite3
import stat
import time
from pathlib import Path

import pytest

from .conftest import ServiceProcess, clean_broker, publish, retained_under, run_doctor, wait_until

FORGED = "INFO edge_queue.service: job 0000forged00000 succeeded"
#: What every line of the service's log starts with: a record, or the continuation of one.
RECORD = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: |^  \| ")


def _umask(mask: str) -> list[str]:
    return ["sh", "-c", f'umask {mask} && exec "$@"', "sh"]


@pytest.mark.slow
def test_text_from_clients_and_files_cannot_start_a_log_line(broker, service_factory, tmp_path: Path) -> None:
    # Given a media root holding a file whose name carries a newline and a forged record
    # (the file system allows any byte but "/" and NUL), and a running service
    media = tmp_path / "media"
    media.mkdir()
    odd = media / f"clip\n{FORGED}\x1b[2J.wav"
    odd.write_bytes(b"RIFF not really a wav")
    svc = service_factory(broker, [media]).start()
    watcher = svc.watcher("response/#", "jobs/+")
    evil = f"x\n{FORGED}\r\u2028{FORGED}"
    # When clients put the forged record into every text field the service may log
    ok = svc.request("submit", {"kind": "probe", "input": str(odd), "idempotency_key": evil}, watcher)
    assert ok["status"] == "ok", ok
    job_id = ok["data"]["jobs"][0]["job_id"]
    watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] == "failed", timeout=60)
    # (an unexpected error whose message holds client text: its traceback is logged)
    raised = svc.request("submit", {"kind": "test_fail", "options": {"raise_message": evil}}, watcher)
    assert raised["status"] == "ok", raised
    raised_id = raised["data"]["jobs"][0]["job_id"]
    watcher.wait_json(f"{svc.base}/jobs/{raised_id}", lambda m: m["state"] in ("failed", "retrying"), timeout=60)
    # (a key of its own: the key above, used again, would return the probe job)
    bad = svc.request("submit", {"kind": "noop", "options": {evil: evil}, "idempotency_key": evil + "2"}, watcher)
    assert bad["status"] == "error", bad
    assert svc.request("submit", {"kind": "nope\n" + FORGED, "input": evil}, watcher)["status"] == "error"
    assert svc.request("get", {"job_id": evil}, watcher)["status"] == "error"
    svc.request("cancel\u2028" + FORGED, {"job_id": evil}, watcher)  # an unknown command, named by its topic
    assert svc.stop() == 0
    # Then every line of the log is a record of the service, or the continuation of one:
    # the forged record appears only inside other records, escaped
    log = svc.log()
    assert "forged" in log  # the texts were logged, so the check below is not empty
    lines = log.splitlines()
    strays = [line for line in lines if not RECORD.match(line)]
    assert strays == [], strays
    assert not any(line.startswith(FORGED) or line.startswith("  | " + FORGED) for line in lines)
    assert "\x1b" not in log and "\u2028" not in log and "\r" not in log


@pytest.mark.parametrize(("mask", "mode"), [("022", 0o644), ("027", 0o640)])
def test_outputs_beside_the_input_follow_the_umask(
    broker, service_factory, tmp_path: Path, speech: Path, mask: str, mode: int
) -> None:
    # Given a 0644 recording in a media folder, and the service started with a umask
    media = tmp_path / "media"
    media.mkdir()
    clip = media / "clip.flac"
    shutil.copy(speech / "jfk.flac", clip)
    clip.chmod(0o644)
    svc = service_factory(broker, [media])
    svc.prefix = _umask(mask)
    svc.start()
    watcher = svc.watcher("response/#", "jobs/+")
    # When its audio is extracted beside it
    options = {"output": "beside", "format": "wav"}
    ok = svc.request("submit", {"kind": "extract_audio", "input": str(clip), "options": options}, watcher)
    assert ok["status"] == "ok", ok
    job_id = ok["data"]["jobs"][0]["job_id"]
    done = watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] in ("succeeded", "failed"), 120)
    assert done["state"] == "succeeded", done
    # Then the output has the mode the umask gives a new file (a media server's user can read
    # it with 022), not 0600
    out = Path(done["result"]["output"])
    assert out.parent == media
    assert stat.S_IMODE(out.stat().st_mode) == mode, oct(out.stat().st_mode)


def test_a_traceback_cannot_hold_a_line_that_passes_for_a_record() -> None:
    # Given the service's log format, and an exception whose message holds a forged record
    # (a library quoting a file name or a client's text in its error)
    import io
    import logging

    from edge_queue.logfmt import OneLineFormatter

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(OneLineFormatter("%(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("edge_queue.test_logfmt")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        raise RuntimeError(f"cannot read /srv/media/a\n{FORGED}\x1b[2J")
    except RuntimeError:
        # When it is logged with its traceback, and a message with client text is logged
        logger.exception("job %s: unexpected error", "j1")
    logger.warning("input %s", f"b\r\n{FORGED}\u2028")
    logger.removeHandler(handler)
    # Then every line is a record or the continuation of one, and the text is all there
    lines = out.getvalue().splitlines()
    assert [line for line in lines if not RECORD.match(line)] == []
    assert sum(line.startswith(("ERROR", "WARNING")) for line in lines) == 2
    assert any(line.startswith("  | ") and "forged" in line for line in lines)
    assert "\\x1b[2J" in out.getvalue() and "\x1b" not in out.getvalue()


def test_a_refused_input_names_the_media_roots_and_the_start_names_them_too(
    broker, service_factory, tmp_path: Path
) -> None:
    # Given a service with two media roots
    roots = [tmp_path / "media", tmp_path / "recordings"]
    for root in roots:
        root.mkdir()
    svc = service_factory(broker, roots).start()
    watcher = svc.watcher("response/#")
    # When a file outside them, and a relative path, are submitted
    for raw in ("/etc/hostname", "media/clip.wav"):
        resp = svc.request("submit", {"kind": "probe", "input": raw}, watcher)
        # Then the refusal says what the roots are and where they are set
        assert resp["status"] == "error", resp
        err = resp["error"]
        assert err["code"] == "input_outside_media_roots", err
        assert all(str(r) in err["message"] for r in roots), err
        assert "media_roots" in err["message"] and "--media-root" in err["message"] or raw[0] != "/", err
    # and the start-up line names the data folder and the roots
    line = next(line for line in svc.log().splitlines() if "serving on" in line)
    assert str(svc.data_dir) in line and all(str(r) in line for r in roots), line


@pytest.mark.slow
def test_doctor_checks_the_media_roots_the_running_service_uses(mosquitto, service_factory, tmp_path: Path) -> None:
    # Given a service started as the README starts it: no roots in any configuration, one
    # given with --media-root on its command line
    media = tmp_path / "media"
    media.mkdir()
    (media / "call.flac").write_bytes(b"x")
    svc = service_factory(mosquitto, [])
    svc.env["EDGE_QUEUE_MEDIA_ROOTS"] = "[]"
    svc.prefix = ["sh", "-c", f'exec "$@" --media-root {media}', "sh"]
    svc.start()
    # When doctor runs with the same configuration (none)
    out = run_doctor(svc.env)
    # Then it checks the roots the service uses, and passes
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"the service uses {media}" in out.stdout and f"ok    media root {media}: readable" in out.stdout
    # and with --media-root, as for up and serve, it checks that folder
    other = tmp_path / "other"
    out = run_doctor(svc.env, "--media-root", str(other))
    assert out.returncode == 1 and f"FAIL  media root {other}" in out.stdout, out.stdout
    # and an empty one (a container's mount of a folder of the box that did not exist) is named
    other.mkdir()
    out = run_doctor(svc.env, "--media-root", str(other))
    assert out.returncode == 0 and f"warn  media root {other}: readable, but empty" in out.stdout, out.stdout
    # and with the service stopped, before its next start, the roots it used are checked
    assert svc.stop() == 0
    out = run_doctor(svc.env)
    assert out.returncode == 0 and f"the service used when it last ran {media}" in out.stdout, out.stdout
    # and with no roots anywhere (a base topic no service used), it fails saying how to set them
    fresh = {**svc.env, "EDGE_QUEUE_MQTT__BASE_TOPIC": svc.base + "-none"}
    out = run_doctor(fresh)
    assert out.returncode == 1 and "FAIL  media_roots: none configured" in out.stdout and "--media-root" in out.stdout


def test_a_mistyped_option_is_answered_with_the_valid_options(broker, service_factory, tmp_path: Path) -> None:
    # Given a running service
    svc = service_factory(broker, [tmp_path]).start()
    watcher = svc.watcher("response/#")
    # When a submit misspells an option of its kind
    resp = svc.request("submit", {"kind": "noop", "options": {"sleeps": 1}}, watcher)
    # Then the error names the field and lists the options the kind has
    assert resp["status"] == "error" and resp["error"]["field"] == "options.sleeps", resp
    assert "the options of noop are: " in resp["error"]["message"] and "sleep_s" in resp["error"]["message"], resp


def _responses(watcher, topic: str) -> list[dict]:
    return watcher.json_on(topic)


def test_an_empty_request_after_a_cleared_retained_one_is_answered(broker, service_factory, tmp_path: Path) -> None:
    # Given a running service, and a client that published a request with the retain flag by
    # mistake (answered with an error, and cleared)
    svc = service_factory(broker, [tmp_path]).start()
    watcher = svc.watcher("response/#", "queue")
    topic = f"{svc.base}/response/pause"
    publish(svc.broker, f"{svc.base}/request/pause", "{}", retain=True)
    wait_until(lambda: len(_responses(watcher, topic)) >= 1, 30, "the answer to the retained request")
    # (MQTT 3.1.1 brokers clear the retain flag on live delivery: amqtt's copy is executed,
    # docs/topics.md "Retained requests")
    assert _responses(watcher, topic)[0]["status"] == ("error" if broker.kind == "mosquitto" else "ok")
    # When it sends the documented empty request at once, without the retain flag
    publish(svc.broker, f"{svc.base}/request/pause", "")
    # Then that request is executed and answered too
    wait_until(lambda: len(_responses(watcher, topic)) >= 2, 30, "the answer to the empty request")
    second = _responses(watcher, topic)[1]
    assert second["status"] == "ok", second
    watcher.wait_json(f"{svc.base}/queue", lambda q: q["paused"] is True)
    # and a marker request answered after it shows no further response came for either
    svc.request("resume", {}, watcher)
    assert len(_responses(watcher, topic)) == 2


@pytest.mark.slow
def test_a_retained_request_sent_while_the_service_is_down_is_answered_once(
    broker, service_factory, tmp_path: Path
) -> None:
    # Given a service that has run once (the broker keeps its session) and is stopped
    svc = service_factory(broker, [tmp_path]).start()
    assert svc.stop() == 0
    watcher = svc.watcher("response/#")
    # When a client publishes a request with the retain flag while it is down, and it starts
    publish(svc.broker, f"{svc.base}/request/submit", '{"kind": "noop", "transaction": "r1"}', retain=True)
    svc.start()
    topic = f"{svc.base}/response/submit"
    wait_until(lambda: _responses(watcher, topic), 30, "the answer to the retained request")
    # Then it is answered once (not once from the session's queue and once as retained), with
    # the error, and a later request is answered after it
    marker = svc.request("submit", {"kind": "noop"}, watcher)
    assert marker["status"] == "ok"
    answers = [r for r in _responses(watcher, topic) if r.get("transaction") == "r1"]
    assert len(answers) == 1 and answers[0]["status"] == "error", answers


def _running(watcher, base: str, job_id: str) -> None:
    watcher.wait_json(f"{base}/jobs/{job_id}", lambda m: m["state"] == "running", timeout=60)


@pytest.mark.slow
@pytest.mark.usefixtures("model_installed")
def test_stopping_with_a_job_running_keeps_its_word(mosquitto, service_factory, long_speech: Path) -> None:
    # Given a service with a 2 s grace period, transcribing 100 s of speech one window after
    # another (batched, it can end before the signal arrives)
    svc = service_factory(
        mosquitto, [long_speech.parent], {"EDGE_QUEUE_CANCEL_GRACE_S": "2", "EDGE_QUEUE_TRANSCRIBE__BATCH_SIZE": "1"}
    ).start()
    watcher = svc.watcher("response/#", "jobs/+")
    job_id = svc.request("submit", {"input": str(long_speech)}, watcher)["data"]["jobs"][0]["job_id"]
    _running(watcher, svc.base, job_id)
    wait_until(
        lambda: any(m.get("progress", 0) > 0 for m in watcher.json_on(f"{svc.base}/jobs/{job_id}")), 60, "progress"
    )
    # When it is stopped (SIGTERM, as systemd does)
    started = time.monotonic()
    svc.proc.send_signal(signal.SIGTERM)
    code = svc.proc.wait(30)
    took = time.monotonic() - started
    # Then it stops within the grace period it announced, plus the time to end the worker
    assert code == 0
    assert "waiting up to 2 s" in svc.log()
    assert took < 2 + 2.5, took
    # and the job is queued again without its attempt counted, with no warning about leaked
    # resources of the ended worker
    last = watcher.json_on(f"{svc.base}/jobs/{job_id}")[-1]
    assert last["state"] == "queued" and last["attempt"] == 0, last
    assert "leaked" not in svc.log(), svc.log()[-2000:]


def test_a_second_interrupt_stops_at_once(mosquitto, service_factory, tmp_path: Path) -> None:
    # Given a service (10 s grace period) running a job that never reaches a checkpoint
    svc = service_factory(mosquitto, [tmp_path]).start()
    watcher = svc.watcher("response/#", "jobs/+")
    job_id = svc.request("submit", {"kind": "test_hang"}, watcher)["data"]["jobs"][0]["job_id"]
    _running(watcher, svc.base, job_id)
    # When Ctrl-C is pressed twice
    started = time.monotonic()
    svc.proc.send_signal(signal.SIGINT)
    wait_until(lambda: "stopping: waiting up to 10 s" in svc.log(), 10, "the graceful stop to begin")
    svc.proc.send_signal(signal.SIGINT)
    code = svc.proc.wait(30)
    took = time.monotonic() - started
    # Then the second one stops it at once, the job queued again for the next start
    assert code == 0
    assert took < 5, took
    assert "stopping now" in svc.log()
    last = watcher.json_on(f"{svc.base}/jobs/{job_id}")[-1]
    assert last["state"] == "queued" and last["attempt"] == 0, last


def test_a_tests_service_leaves_nothing_on_the_shared_broker(mosquitto, tmp_path: Path) -> None:
    # Given a service of a test on the system broker that ran jobs and a batch and was stopped
    svc = ServiceProcess(mosquitto, tmp_path, [tmp_path]).start()
    watcher = svc.watcher("response/#", "jobs/+")
    batch = svc.request("submit", {"kind": "noop", "inputs": ["a", "b"]}, watcher)["data"]
    for job in batch["jobs"]:
        watcher.wait_json(f"{svc.base}/jobs/{job['job_id']}", lambda m: m["state"] == "succeeded")
    watcher.close()
    assert svc.stop() == 0
    assert len(retained_under(mosquitto, svc.base)) >= 6  # status, info, queue, 2 jobs, batch
    # When the cleanup that service_factory runs after every test runs
    clean_broker(mosquitto, svc.base, svc.env["EDGE_QUEUE_MQTT__CLIENT_ID"])
    # Then no retained topic of it is left
    assert retained_under(mosquitto, svc.base) == set()


def test_info_stays_small_and_the_option_schemas_have_a_request(broker, service_factory, tmp_path: Path) -> None:
    # Given a running service, seen by a subscriber of everything
    svc = service_factory(broker, [tmp_path]).start()
    watcher = svc.watcher("info", "response/#")
    info = watcher.wait_json(f"{svc.base}/info", lambda m: True)
    # Then <base>/info names each kind's options but carries no schema (it was 4.6 KB)
    raw = watcher.on(f"{svc.base}/info")[-1]
    assert len(raw) < 2048, len(raw)
    assert "sleep_s" in info["kinds"]["noop"]["options"] and "language" in info["kinds"]["transcribe"]["options"]
    # and the kinds request answers with the JSON Schemas, an empty payload as for pause
    publish(svc.broker, f"{svc.base}/request/kinds", "")
    resp = watcher.wait_json(f"{svc.base}/response/kinds", lambda m: True)
    assert resp["status"] == "ok", resp
    schema = resp["data"]["kinds"]["transcribe"]["options"]
    assert schema["type"] == "object" and "language" in schema["properties"]
    assert set(resp["data"]["kinds"]) == set(info["kinds"])


def test_a_kind_that_returns_numpy_numbers_or_a_set_fails_its_job_not_the_service(
    mosquitto, service_factory, tmp_path: Path
) -> None:
    # Given a kind whose result and kept chunk hold numpy numbers (JSON once converted), and
    # one whose result is a set (never JSON): before, the chunk's numpy float ended the service
    svc = service_factory(mosquitto, [tmp_path]).start()
    watcher = svc.watcher("response/#", "jobs/+")
    ids = {}
    for returns in ("numpy", "set"):
        resp = svc.request("submit", {"kind": "test_odd", "options": {"returns": returns}, "max_attempts": 1}, watcher)
        ids[returns] = resp["data"]["jobs"][0]["job_id"]
    done = {
        r: watcher.wait_json(f"{svc.base}/jobs/{j}", lambda m: m["state"] in ("succeeded", "failed"), 30)
        for r, j in ids.items()
    }
    # Then the numpy values arrive as plain JSON, the set fails its own job with a clear error
    assert done["numpy"]["state"] == "succeeded", done["numpy"]
    assert done["numpy"]["result"] == {"value": {"x": 0.5, "n": 3, "a": [0, 1, 2]}}
    assert done["set"]["state"] == "failed" and done["set"]["error"]["code"] == "internal_error"
    assert "not JSON" in done["set"]["error"]["message"], done["set"]["error"]
    # And the service goes on
    assert svc.proc is not None and svc.proc.poll() is None
    later = svc.request("submit", {"kind": "noop"}, watcher)["data"]["jobs"][0]["job_id"]
    watcher.wait_json(f"{svc.base}/jobs/{later}", lambda m: m["state"] == "succeeded", 30)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_worker_that_half_closes_its_pipe_is_one_worker_death_and_the_loop_does_not_spin(
    mosquitto, service_factory, tmp_path: Path
) -> None:
    # Given a kind that shuts down the sending side of its worker's pipe and goes on running
    # for 4 s (before: the loop read the end of file again on every turn, 54 % of a CPU, and
    # the job ended crash_loop)
    svc = service_factory(mosquitto, [tmp_path]).start()
    watcher = svc.watcher("response/#", "jobs/+")
    resp = svc.request("submit", {"kind": "test_half_close", "options": {"seconds": 4}, "max_attempts": 2}, watcher)
    job_id = resp["data"]["jobs"][0]["job_id"]
    assert svc.proc is not None
    cpu0, t0 = _cpu_s(svc.proc.pid), time.monotonic()
    # Then each attempt is one worker death (worker_lost), and the job fails once its two
    # attempts are spent, not crash_loop
    end = watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] in ("failed", "succeeded"), 60)
    assert end["state"] == "failed" and end["error"]["code"] == "worker_lost", end
    assert end["attempt"] == 2, end
    assert "closed its pipe" in end["error"]["message"], end
    # And the service did not spin meanwhile
    spent, took = _cpu_s(svc.proc.pid) - cpu0, time.monotonic() - t0
    assert spent < 0.25 * took + 0.5, f"service used {spent:.2f} CPU-s in {took:.1f} s"
    later = svc.request("submit", {"kind": "noop"}, watcher)["data"]["jobs"][0]["job_id"]
    watcher.wait_json(f"{svc.base}/jobs/{later}", lambda m: m["state"] == "succeeded", 30)
    assert svc.log().count("closed its pipe") >= 2


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the direct children of ``pid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out.append((int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
        except (OSError, ValueError, IndexError):
            continue
    return out


@pytest.mark.parametrize("moment", ["forkserver starting", "job running"])
@pytest.mark.slow
def test_ctrl_c_in_the_terminal_reaches_only_the_service_and_costs_no_job_an_attempt(
    mosquitto, service_factory, tmp_path: Path, moment: str
) -> None:
    # Given a job that becomes due just as a service starts in a terminal (its own session,
    # as a shell runs it: the terminal's Ctrl-C goes to the whole foreground process group);
    # before, a Ctrl-C while the workers' forkserver was still importing killed it and the
    # workers, the job being started lost an attempt, and a KeyboardInterrupt traceback was
    # logged
    first = service_factory(mosquitto, [tmp_path]).start()
    watcher = first.watcher("response/#", "jobs/+")
    run_at = time.time() + 3
    due = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(run_at)) + f".{int(run_at % 1 * 1000):03d}Z"
    resp = first.request("submit", {"kind": "noop", "options": {"sleep_s": 3}, "run_at": due}, watcher)
    job_id = resp["data"]["jobs"][0]["job_id"]
    assert first.stop() == 0
    wait_until(lambda: time.time() > run_at, 10, "the job to be due")
    svc = service_factory(mosquitto, [tmp_path], {"EDGE_QUEUE_CANCEL_GRACE_S": "0"})
    svc.data_dir, svc.base, svc.env = first.data_dir, first.base, first.env | {"EDGE_QUEUE_CANCEL_GRACE_S": "0"}
    svc.prefix = ["setsid"]
    svc.start(wait_online=False)
    assert svc.proc is not None
    pid = svc.proc.pid
    # When Ctrl-C comes at that moment
    if moment == "forkserver starting":
        wait_until(lambda: any("forkserver" in c for _, c in _children(pid)), 30, "the forkserver to start", 0.002)
    else:
        watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] == "running", 60)
    forkserver = next(p for p, c in _children(pid) if "forkserver" in c)
    blocked = int(Path(f"/proc/{forkserver}/status").read_text().split("SigBlk:")[1].split()[0], 16)
    assert blocked & (1 << (signal.SIGINT - 1)), f"SigBlk {blocked:x}"
    os.killpg(pid, signal.SIGINT)
    # Then only the service stops, gracefully, and the job keeps all its attempts
    assert svc.proc.wait(30) == 0, svc.log()
    log = svc.log()
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
    assert "worker_lost" not in log, log
    third = service_factory(mosquitto, [tmp_path])
    third.data_dir, third.base, third.env = first.data_dir, first.base, first.env
    third.start()
    end = watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] in ("succeeded", "failed"), 60)
    assert end["state"] == "succeeded" and end["attempt"] == 1, end


def test_a_worker_that_dies_during_the_graceful_stop_costs_its_job_no_attempt(
    mosquitto, service_factory, tmp_path: Path
) -> None:
    # Given a running job and a graceful stop waiting for it
    svc = service_factory(mosquitto, [tmp_path], {"EDGE_QUEUE_CANCEL_GRACE_S": "30"}).start()
    watcher = svc.watcher("response/#", "jobs/+")
    resp = svc.request("submit", {"kind": "test_hang", "options": {"seconds": 60}}, watcher)
    job_id = resp["data"]["jobs"][0]["job_id"]
    watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] == "running", 30)
    assert svc.proc is not None
    svc.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: "stopping: waiting" in svc.log(), 30, "the graceful stop")
    # When the job's worker dies meanwhile (as a terminal's Ctrl-C did to it)
    forkserver = next(p for p, c in _children(svc.proc.pid) if "forkserver" in c)
    workers = [p for p, _ in _children(forkserver)]
    assert workers
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    # Then the stop ends at once and the job is queued again with its attempt taken back
    assert svc.proc.wait(30) == 0, svc.log()
    end = svc.watcher("jobs/+")
    final = end.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] != "running", 30)
    assert final["state"] == "queued" and final["attempt"] == 0, final
    assert "worker_lost" not in svc.log()


@pytest.mark.slow
def test_the_write_ahead_log_shrinks_once_an_outside_reader_lets_go(mosquitto, service_factory, tmp_path: Path) -> None:
    # Given a service, and an outside program holding a read of its store open (a backup, the
    # sqlite3 shell): SQLite cannot reset the write-ahead log meanwhile, so it grows
    svc = service_factory(mosquitto, [tmp_path]).start()
    watcher = svc.watcher("response/#")
    reader = sqlite3.connect(svc.db, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM jobs").fetchone()
    wal = svc.db.with_name(svc.db.name + "-wal")
    for i in range(10):
        resp = svc.request("submit", {"kind": "noop", "inputs": [f"w{i}-{k}" for k in range(1000)]}, watcher, 60)
        assert resp["status"] == "ok", resp
    grown = wait_until(lambda: wal.stat().st_size > 12 * 2**20 and wal.stat().st_size, 120, "the log to grow", 0.2)

    def done() -> int:
        with sqlite3.connect(f"file:{svc.db}?mode=ro", uri=True) as conn:
            return conn.execute("SELECT count(*) FROM jobs WHERE state = 'succeeded'").fetchone()[0]

    wait_until(lambda: done() == 10_000, 180, "10,000 jobs to succeed", 0.5)
    wait_until(lambda: "holds a read of the database open" in svc.log(), 30, "the log line")
    grown = wal.stat().st_size
    # When the reader lets go
    reader.execute("COMMIT")
    reader.close()
    # Then the log is cut back within seconds, the service idle (before: it stayed at its
    # largest until the service stopped)
    wait_until(lambda: wal.stat().st_size <= 8 * 2**20, 20, f"the log ({grown / 2**20:.1f} MiB) to shrink", 0.2)
    print(f"write-ahead log: {grown / 2**20:.1f} MiB with the reader, {wal.stat().st_size / 2**20:.1f} MiB after")


def test_a_recycling_limit_below_a_fresh_workers_size_is_said_at_start(
    mosquitto, service_factory, tmp_path: Path
) -> None:
    # Given max_worker_rss_mb below what a worker takes as soon as it starts (before: accepted
    # silently, and every job paid a worker start)
    svc = service_factory(mosquitto, [tmp_path], {"EDGE_QUEUE_MAX_WORKER_RSS_MB": "10"}).start()
    # Then the start says so, once
    wait_until(lambda: "but a worker just started takes" in svc.log(), 30, "the warning")
    lines = [li for li in svc.log().splitlines() if "but a worker just started takes" in li]
    assert len(lines) == 1 and lines[0].startswith("WARNING") and "max_worker_rss_mb is 10 MiB" in lines[0]
