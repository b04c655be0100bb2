"""Watch folders (docs/configuration.md, "[[watch]]"), on real files, a real broker and the real
service process: a file becomes one job once it is complete, once per version, whatever
restarts, moves, renames and folders that go away and come back."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from edge_queue.store import parse_iso

from .conftest import SPEECH, need, run_doctor, wait_until

#: Short enough for quick tests, long enough that a writer pausing between pieces (0.5 s)
#: never looks finished on a busy machine.
SETTLE_S = 2.0


def _watch_env(inbox: Path, **watch: Any) -> dict[str, str]:
    table = {
        "path": str(inbox),
        "kind": "noop",
        "include": ["*.wav", "*.flac", "*.mp4"],
        "settle_s": SETTLE_S,
        "mode": "events",
        **watch,
    }
    return {"EDGE_QUEUE_WATCH": json.dumps([table])}


def _start(service_factory: Any, broker: Any, root: Path, inbox: Path, **watch: Any) -> Any:
    return service_factory(broker, [root], _watch_env(inbox, **watch)).start()


def _jobs(svc: Any, path: Path | str) -> list[dict[str, Any]]:
    """The jobs of the store whose input is ``path``, oldest first."""
    with sqlite3.connect(f"file:{svc.db}?mode=ro", uri=True, timeout=10) as conn:
        conn.row_factory = sqlite3.Row
        rows = conn.execute("SELECT * FROM jobs WHERE input = ? ORDER BY job_id", [str(path)]).fetchall()
    return [dict(r) for r in rows]


def _all_inputs(svc: Any) -> list[str]:
    with sqlite3.connect(f"file:{svc.db}?mode=ro", uri=True, timeout=10) as conn:
        return [r[0] for r in conn.execute("SELECT input FROM jobs ORDER BY job_id")]


def _record(svc: Any, path: Path) -> dict[str, Any] | None:
    with sqlite3.connect(f"file:{svc.db}?mode=ro", uri=True, timeout=10) as conn:
        conn.row_factory = sqlite3.Row
        row = conn.execute("SELECT * FROM watch_files WHERE path = ?", [str(path)]).fetchone()
    return None if row is None else dict(row)


def _sentinel(svc: Any, inbox: Path, name: str = "zz-sentinel.wav") -> None:
    """Drop one more file and wait for its job: files dropped before it have had their turn
    (the watcher hands files over in the order they settle)."""
    path = inbox / name
    path.write_bytes(b"sentinel " + name.encode())
    wait_until(lambda: _jobs(svc, path), 30, f"a job for {name}")


def _info_watch(svc: Any, watcher: Any, state: str) -> dict[str, Any]:
    info = watcher.wait_json(f"{svc.base}/info", lambda m: any(w["state"] == state for w in m.get("watch", [])), 30)
    return next(w for w in info["watch"] if w["state"] == state)


@pytest.mark.slow
def test_slowly_written_file_is_one_job_after_its_last_write(
    mosquitto: Any, service_factory: Any, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inbox = root / "inbox"
    svc = _start(service_factory, mosquitto, root, inbox)
    target = inbox / "recording.wav"
    t0 = time.time()
    writes = []
    # Given a recorder that appends a piece every 0.5 s for 5 s, opening and closing the file
    # each time (a close-write event after every piece)
    for _ in range(10):
        with open(target, "ab") as fh:
            fh.write(os.urandom(64 * 1024))
        writes.append(time.time())
        if _jobs(svc, target):
            break
        time.sleep(0.5)
    # Then one job, created after the last write
    job = wait_until(lambda: _jobs(svc, target), 30, "the job of the slowly written file")[0]
    done = wait_until(lambda: [j for j in _jobs(svc, target) if j["state"] == "succeeded"], 30, "the job to succeed")[0]
    created, started = parse_iso(job["created_at"]), parse_iso(done["started_at"])
    _sentinel(svc, inbox)
    with capsys.disabled():
        print("\nslowly written file, seconds from the first write:")
        for i, at in enumerate(writes, 1):
            print(f"  write {i:2d} ({i * 64} KiB so far) at {at - t0:6.3f} s")
        print(f"  job {job['job_id']} created at {created - t0:6.3f} s ({created - writes[-1]:.3f} s after the last)")
        print(f"  job started at {started - t0:6.3f} s, input of {done['input']}")
    assert len(writes) == 10, "a job was created while the file was still being written"
    assert writes[-1] + SETTLE_S * 0.9 < created <= started
    assert len(_jobs(svc, target)) == 1
    assert _record(svc, target)["size"] == 10 * 64 * 1024


@pytest.mark.slow
def test_file_held_open_waits_for_its_close(
    mosquitto: Any, service_factory: Any, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A writer that pauses longer than ``settle_s`` while it holds the file open (a stalled
    network copy): inotify's close-write event, not the pause, ends the wait."""
    inbox = root / "inbox"
    svc = _start(service_factory, mosquitto, root, inbox, settle_s=1.0)
    # (inotify watches before the file is made: a file found only by the start-up scan has no
    # events, and is judged by settle_s alone)
    info = svc.watcher("info")
    _info_watch(svc, info, "watching")
    info.close()
    target = inbox / "stalled-copy.wav"
    t0 = time.time()
    writes = []
    with open(target, "wb") as fh:
        for _ in range(4):
            fh.write(os.urandom(32 * 1024))
            fh.flush()
            writes.append(time.time())
            time.sleep(2.0)  # longer than settle_s, with the file still open
        assert not _jobs(svc, target), "a job was created while the writer held the file open"
    closed = time.time()
    job = wait_until(lambda: _jobs(svc, target), 30, "the job after the close")[0]
    created = parse_iso(job["created_at"])
    with capsys.disabled():
        print("\nfile held open, seconds from the first write:")
        for i, at in enumerate(writes, 1):
            print(f"  write {i} at {at - t0:6.3f} s")
        print(f"  closed at {closed - t0:6.3f} s; job created at {created - t0:6.3f} s")
    assert created > closed
    _sentinel(svc, inbox)
    assert len(_jobs(svc, target)) == 1


@pytest.mark.slow
def test_moved_in_and_part_renamed(mosquitto: Any, service_factory: Any, root: Path) -> None:
    inbox = root / "inbox"
    svc = _start(service_factory, mosquitto, root, inbox)
    # a file written elsewhere, then moved in
    done = root / "elsewhere" / "moved.wav"
    done.write_bytes(os.urandom(10_000))
    os.rename(done, inbox / "moved.wav")
    # a download written under a temporary name, then renamed to its final name
    part = inbox / "download.wav.part"
    with open(part, "wb") as fh:
        for _ in range(4):
            fh.write(os.urandom(10_000))
            fh.flush()
            time.sleep(0.3)
    os.rename(part, inbox / "download.wav")
    # names that are never inputs
    (inbox / ".hidden.wav").write_bytes(b"x")
    (inbox / "copying.wav.tmp").write_bytes(b"x")
    (inbox / "notes.txt").write_bytes(b"x")
    wait_until(lambda: _jobs(svc, inbox / "moved.wav"), 30, "a job for the moved-in file")
    wait_until(lambda: _jobs(svc, inbox / "download.wav"), 30, "a job for the renamed .part file")
    _sentinel(svc, inbox)
    assert sorted(_all_inputs(svc)) == sorted(
        str(inbox / n) for n in ("moved.wav", "download.wav", "zz-sentinel.wav")
    ), "one job per complete file, none for temporary, hidden or text files"


@pytest.mark.slow
def test_fifty_files_dropped_at_once_make_fifty_jobs(mosquitto: Any, service_factory: Any, root: Path) -> None:
    inbox = root / "inbox"
    svc = _start(service_factory, mosquitto, root, inbox)
    staging = root / "elsewhere"
    names = [f"take-{i:02d}.wav" for i in range(50)]
    for name in names:
        (staging / name).write_bytes(os.urandom(2048))
    for name in names:  # as a file manager drops a selection: 50 moves in a burst
        os.rename(staging / name, inbox / name)
    wait_until(lambda: len(_all_inputs(svc)) >= 50, 60, "50 jobs")
    _sentinel(svc, inbox)
    inputs = _all_inputs(svc)
    assert sorted(inputs) == sorted([str(inbox / n) for n in names] + [str(inbox / "zz-sentinel.wav")])
    # every job runs to the end
    with sqlite3.connect(f"file:{svc.db}?mode=ro", uri=True) as conn:
        wait_until(
            lambda: conn.execute("SELECT count(*) FROM jobs WHERE state = 'succeeded'").fetchone()[0] == 51,
            60,
            "51 succeeded jobs",
        )


@pytest.mark.slow
def test_restart_in_the_middle_and_files_added_while_stopped(mosquitto: Any, service_factory: Any, root: Path) -> None:
    inbox = root / "inbox"
    svc = _start(service_factory, mosquitto, root, inbox)
    first = [inbox / f"a-{i:02d}.wav" for i in range(15)]
    for p in first:
        p.write_bytes(os.urandom(4096))
    wait_until(lambda: all(_jobs(svc, p) for p in first), 30, "the jobs of the first files")
    # Given more files still settling when the service is killed (kill -9, as a power cut)
    second = [inbox / f"b-{i:02d}.wav" for i in range(15)]
    for p in second:
        p.write_bytes(os.urandom(4096))
    svc.kill()
    # While it is stopped: more files arrive, and one of the first is touched (same content)
    third = [inbox / f"c-{i:02d}.wav" for i in range(5)]
    for p in third:
        p.write_bytes(os.urandom(4096))
    os.utime(first[0], (time.time() + 5, time.time() + 5))
    svc.start()
    expected = first + second + third
    wait_until(lambda: all(_jobs(svc, p) for p in expected), 60, "a job for every file")
    touched = first[0].stat().st_mtime_ns
    wait_until(lambda: _record(svc, first[0])["mtime_ns"] == touched, 30, "the touch to be recorded")
    # And a restart by SIGTERM in the middle of nothing changes nothing either
    assert svc.stop() == 0
    svc.start()
    _sentinel(svc, inbox)
    inputs = _all_inputs(svc)
    assert sorted(inputs) == sorted(str(p) for p in [*expected, inbox / "zz-sentinel.wav"]), "no duplicate, none lost"


def _drop_speech_in_a_beside_watch(
    service_factory: Any, broker: Any, root: Path, kind: str, options: dict[str, Any], include: list[str]
) -> tuple[Any, Path]:
    """A watch of ``kind`` writing its outputs beside the input, and jfk.flac copied into it."""
    need((SPEECH / "jfk.flac").is_file(), f"speech recordings not found in {SPEECH}")
    inbox = root / "inbox"
    svc = _start(
        service_factory, broker, root, inbox, kind=kind, options={"output": "beside", **options}, include=include
    )
    shutil.copy(SPEECH / "jfk.flac", inbox / "jfk.flac")
    return svc, inbox


@pytest.mark.slow
def test_beside_outputs_make_no_jobs(mosquitto: Any, service_factory: Any, root: Path) -> None:
    svc, inbox = _drop_speech_in_a_beside_watch(
        service_factory, mosquitto, root, "extract_audio", {"format": "wav"}, ["*.flac", "*.wav"]
    )
    job = wait_until(lambda: _jobs(svc, inbox / "jfk.flac"), 30, "the job of jfk.flac")[0]
    # Then its output jfk.wav, written beside the input, is recorded as an output, not a job
    record = wait_until(lambda: _record(svc, inbox / "jfk.wav"), 60, "the watch to see the output jfk.wav")
    assert record["outcome"] == "output" and record["job_id"] == job["job_id"], record
    assert (inbox / "jfk.wav").stat().st_size > 100_000
    # transcripts written beside an input are not inputs either
    for name in ("jfk.en.srt", "jfk.en.txt", "jfk.en.vtt", "jfk.en.json"):
        (inbox / name).write_text("1\n00:00:00,000 --> 00:00:01,000\nAsk not\n")
    # a user's own file with the same stem, older than the job, is an input
    _sentinel(svc, inbox)
    assert sorted(_all_inputs(svc)) == [str(inbox / "jfk.flac"), str(inbox / "zz-sentinel.wav")]


@pytest.mark.slow
def test_later_recordings_named_like_an_output_are_inputs(mosquitto: Any, service_factory: Any, root: Path) -> None:
    # Given a watch whose extract_audio job wrote jfk.wav beside jfk.flac
    svc, inbox = _drop_speech_in_a_beside_watch(
        service_factory, mosquitto, root, "extract_audio", {"format": "wav"}, ["*.flac", "*.wav", "*.mp4"]
    )
    job = wait_until(
        lambda: [j for j in _jobs(svc, inbox / "jfk.flac") if j["state"] in ("succeeded", "failed")], 60, "the job"
    )[0]
    assert job["state"] == "succeeded", job
    record = wait_until(lambda: _record(svc, inbox / "jfk.wav"), 60, "the watch to see the output jfk.wav")
    assert record["outcome"] == "output", record
    # When recordings whose names start with the input's stem are dropped later (a camera's
    # time-stamped files, a second camera, a converted copy): before, each was taken for the
    # job's output and never became a job, for as long as the job was kept
    later = ["jfk.2026-12-03T0740.wav", "jfk.cam2.mp4", "jfk.flac.wav"]
    for name in later:
        shutil.copy(inbox / "jfk.wav", inbox / name)
    _sentinel(svc, inbox)
    # Then each is an input: only what edge-queue wrote is an output
    assert sorted(_all_inputs(svc)) == sorted(str(inbox / n) for n in ["jfk.flac", *later, "zz-sentinel.wav"])
    assert _record(svc, inbox / "jfk.wav")["outcome"] == "output"


@pytest.mark.slow
def test_ten_thousand_files_dropped_at_once_become_jobs_within_a_minute(
    mosquitto: Any, service_factory: Any, root: Path
) -> None:
    # Given a watch folder; when 10,000 recordings are dropped into it at once (before: each
    # file listed the whole folder, 31 ms per file: 8.6 minutes)
    inbox = root / "inbox"
    svc = _start(service_factory, mosquitto, root, inbox)
    for i in range(10_000):
        (inbox / f"rec{i:05d}.wav").write_bytes(b"recording %d" % i)
    t0 = time.monotonic()
    watcher = svc.watcher("response/#")
    answers = []

    def taken() -> bool:
        asked = time.monotonic()
        svc.request("list", {"limit": 1}, watcher, 30)  # another user, meanwhile
        answers.append(time.monotonic() - asked)
        return len(_all_inputs(svc)) == 10_000

    # Then every one is a job within a minute, and the service answers others meanwhile
    wait_until(taken, 60, "10,000 jobs", 0.2)
    took = time.monotonic() - t0
    print(f"10,000 files: {10_000 / took:.0f} files/s; others' list: max {max(answers) * 1000:.0f} ms")
    assert max(answers) < 5, answers


@pytest.mark.slow
def test_replaced_file_makes_a_new_job_a_touch_does_not(mosquitto: Any, service_factory: Any, root: Path) -> None:
    inbox = root / "inbox"
    svc = _start(service_factory, mosquitto, root, inbox)
    path = inbox / "voicemail.wav"
    path.write_bytes(b"first message" * 1000)
    wait_until(lambda: _jobs(svc, path), 30, "the first job")
    # a touch: a new modification time, the same content
    os.utime(path, (time.time() + 10, time.time() + 10))
    touched = path.stat().st_mtime_ns
    wait_until(lambda: _record(svc, path)["mtime_ns"] == touched, 30, "the touch to be recorded")
    assert len(_jobs(svc, path)) == 1
    # replaced with new content (written beside under a hidden name, then renamed over it)
    tmp = inbox / ".voicemail.wav.new"
    tmp.write_bytes(b"second message" * 1000)
    os.replace(tmp, path)
    jobs = wait_until(lambda: len(_jobs(svc, path)) == 2 and _jobs(svc, path), 30, "a second job")
    assert jobs[0]["job_id"] != jobs[1]["job_id"]
    _sentinel(svc, inbox)
    assert len(_jobs(svc, path)) == 2


@pytest.mark.slow
def test_a_folder_replaced_by_a_link_out_of_the_roots_is_outside(
    mosquitto: Any, service_factory: Any, root: Path, tmp_path: Path
) -> None:
    # Given a watched folder, and a folder outside the media roots holding a file
    inbox = root / "inbox"
    svc = _start(service_factory, mosquitto, root, inbox)
    watcher = svc.watcher("info")
    _info_watch(svc, watcher, "watching")
    secret = tmp_path / "elsewhere"
    secret.mkdir()
    (secret / "private-name-outside.wav").write_bytes(os.urandom(4096))
    # When the watched folder is replaced by a symbolic link to it (before: reported
    # "watching", and the outside file's name was logged)
    watcher.messages.clear()
    os.rename(inbox, root / "inbox-away")
    inbox.symlink_to(secret)
    outside = _info_watch(svc, watcher, "outside")
    # Then it is reported outside; nothing there is listed, logged or submitted
    assert outside["path"] == str(inbox)
    wait_until(lambda: f"watch folder {inbox} now leads elsewhere" in svc.log(), 10, "the log line")
    assert "private-name-outside" not in svc.log() and str(secret) not in svc.log()
    doctor = run_doctor(svc.env)
    assert f"FAIL  watch {inbox}" in doctor.stdout and "reports it outside" in doctor.stdout, doctor.stdout
    # And once the folder is back, it is watched again
    watcher.messages.clear()
    inbox.unlink()
    os.rename(root / "inbox-away", inbox)
    _info_watch(svc, watcher, "watching")
    _sentinel(svc, inbox)
    assert "private-name-outside" not in svc.log()
    assert str(secret / "private-name-outside.wav") not in _all_inputs(svc)


@pytest.mark.slow
def test_a_file_name_that_reads_backwards_is_escaped_in_every_watch_line(
    mosquitto: Any, service_factory: Any, root: Path
) -> None:
    # Given a watch, when a file whose name holds a right-to-left override is dropped
    inbox = root / "inbox"
    svc = _start(service_factory, mosquitto, root, inbox)
    name = "evil\u202ewav.exe.wav"
    (inbox / name).write_bytes(os.urandom(4096))
    wait_until(lambda: _jobs(svc, inbox / name), 30, "its job")
    # Then the log says where it went with the override escaped, and holds no raw override
    wait_until(lambda: "evil\\u202ewav.exe.wav -> job" in svc.log(), 10, "the watch's line")
    assert "\u202e" not in svc.log()


@pytest.mark.slow
def test_folder_removed_and_recreated(mosquitto: Any, service_factory: Any, root: Path) -> None:
    inbox = root / "inbox"
    svc = _start(service_factory, mosquitto, root, inbox)
    watcher = svc.watcher("info")
    assert _info_watch(svc, watcher, "watching")["path"] == str(inbox)
    (inbox / "a.wav").write_bytes(os.urandom(4096))
    wait_until(lambda: _jobs(svc, inbox / "a.wav"), 30, "the job of a.wav")
    # Given the folder goes away (a share unmounted: here, moved aside)
    away = root / "inbox-away"
    os.rename(inbox, away)
    missing = _info_watch(svc, watcher, "missing")
    assert missing["path"] == str(inbox)
    wait_until(lambda: f"watch folder {inbox} is missing" in svc.log(), 10, "the log line")
    doctor = run_doctor(svc.env)
    assert f"FAIL  watch {inbox}: missing" in doctor.stdout, doctor.stdout
    # When it comes back, with a new file: watched again, the old file not submitted again
    watcher.messages.clear()
    os.rename(away, inbox)
    _info_watch(svc, watcher, "watching")
    (inbox / "b.wav").write_bytes(os.urandom(4096))
    wait_until(lambda: _jobs(svc, inbox / "b.wav"), 30, "the job of b.wav")
    # And a folder removed and made anew (another inode) is watched too
    shutil.rmtree(inbox)
    _info_watch(svc, watcher, "missing")
    watcher.messages.clear()
    inbox.mkdir()
    (inbox / "c.wav").write_bytes(os.urandom(4096))
    _info_watch(svc, watcher, "watching")
    wait_until(lambda: _jobs(svc, inbox / "c.wav"), 30, "the job of c.wav")
    (inbox / "d.wav").write_bytes(os.urandom(4096))  # an event in the new folder
    wait_until(lambda: _jobs(svc, inbox / "d.wav"), 30, "the job of d.wav")
    assert sorted(_all_inputs(svc)) == [str(inbox / n) for n in ("a.wav", "b.wav", "c.wav", "d.wav")]
    doctor = run_doctor(svc.env)
    assert f"ok    watch {inbox}:" in doctor.stdout and "reports it watching" in doctor.stdout, doctor.stdout
    watcher.close()


def test_real_media_through_a_probe_watch(mosquitto: Any, service_factory: Any, root: Path) -> None:
    """A real kind on real media: probe jobs from a recursive watch, and a file the kind
    cannot read becomes a failed job with its code, not a crash."""
    need((SPEECH / "jfk.flac").is_file(), f"speech recordings not found in {SPEECH}")
    inbox = root / "inbox"
    (inbox / "sub").mkdir()
    svc = _start(service_factory, mosquitto, root, inbox, kind="probe", recursive=True)
    shutil.copy(SPEECH / "jfk.flac", inbox / "sub" / "jfk.flac")
    (inbox / "broken.wav").write_bytes(b"RIFF not really a wave file")
    (inbox / "playlist.mp4").write_bytes(b"#EXTM3U\n/etc/passwd\n")  # refused at submit, as over MQTT
    ok = wait_until(
        lambda: [j for j in _jobs(svc, inbox / "sub" / "jfk.flac") if j["state"] == "succeeded"], 60, "probe of jfk"
    )[0]
    assert json.loads(ok["result"])["duration_s"] > 10
    bad = wait_until(
        lambda: [j for j in _jobs(svc, inbox / "broken.wav") if j["state"] == "failed"], 60, "the failed probe"
    )[0]
    assert json.loads(bad["error"])["code"] in ("unsupported_media", "decode_error", "truncated_media"), bad
    refused = wait_until(lambda: _record(svc, inbox / "playlist.mp4"), 30, "the playlist's record")
    assert refused["outcome"] == "refused:unsupported_media" and refused["job_id"] is None, refused
    assert not _jobs(svc, inbox / "playlist.mp4")
    assert f"watch {inbox}: {inbox / 'playlist.mp4'} refused: unsupported_media" in svc.log()
    assert svc.proc.poll() is None


@pytest.mark.slow
def test_transcripts_beside_the_input_make_no_jobs(
    mosquitto: Any, service_factory: Any, root: Path, model_installed: None
) -> None:
    """The case of the issue: transcripts written beside a recording dropped into the folder."""
    svc, inbox = _drop_speech_in_a_beside_watch(
        service_factory, mosquitto, root, "transcribe", {"formats": ["srt", "txt", "vtt", "json"]}, ["*"]
    )
    job = wait_until(
        lambda: [j for j in _jobs(svc, inbox / "jfk.flac") if j["state"] in ("succeeded", "failed")], 120, "the job"
    )[0]
    assert job["state"] == "succeeded", job
    outputs = sorted(p.name for p in inbox.iterdir())
    assert outputs == ["jfk.en.json", "jfk.en.srt", "jfk.en.txt", "jfk.en.vtt", "jfk.flac"], outputs
    assert "ask not what your country" in (inbox / "jfk.en.txt").read_text().lower()
    _sentinel(svc, inbox)
    assert sorted(_all_inputs(svc)) == [str(inbox / "jfk.flac"), str(inbox / "zz-sentinel.wav")]


@pytest.mark.slow
def test_polled_folder(mosquitto: Any, service_factory: Any, root: Path) -> None:
    """``mode = "poll"`` (network file systems): files found by watchdog's polling observer,
    a folder that goes away reported, and found again."""
    inbox = root / "inbox"
    svc = _start(service_factory, mosquitto, root, inbox, mode="poll", poll_interval_s=1, settle_s=1.0)
    watcher = svc.watcher("info")
    assert _info_watch(svc, watcher, "watching")["mode"] == "poll"
    (inbox / "a.wav").write_bytes(os.urandom(4096))
    wait_until(lambda: _jobs(svc, inbox / "a.wav"), 30, "the job of a.wav")
    os.rename(inbox, root / "away")
    _info_watch(svc, watcher, "missing")
    watcher.messages.clear()
    os.rename(root / "away", inbox)
    (inbox / "b.wav").write_bytes(os.urandom(4096))
    _info_watch(svc, watcher, "watching")
    wait_until(lambda: _jobs(svc, inbox / "b.wav"), 30, "the job of b.wav")
    (inbox / "c.wav").write_bytes(os.urandom(4096))
    wait_until(lambda: _jobs(svc, inbox / "c.wav"), 30, "the job of c.wav")
    assert sorted(_all_inputs(svc)) == [str(inbox / n) for n in ("a.wav", "b.wav", "c.wav")]
    watcher.close()


def test_watch_folders_submit_whatever_roles_senders_have(mosquitto: Any, service_factory: Any, root: Path) -> None:
    # Given roles that let no sender submit anything (docs/configuration.md, "[access]")
    inbox = root / "inbox"
    env = {**_watch_env(inbox), "EDGE_QUEUE_ACCESS__SHARED_ROLE": "none", "EDGE_QUEUE_ACCESS__DEFAULT_ROLE": "none"}
    svc = service_factory(mosquitto, [root], env).start()
    # When a file arrives in a watch folder
    (inbox / "call.wav").write_bytes(os.urandom(10_000))
    # Then it becomes a job all the same (the service's own submit), submitted by no user
    jobs = wait_until(lambda: _jobs(svc, inbox / "call.wav"), 30, "a job for the file")
    assert len(jobs) == 1 and jobs[0]["submitted_by"] is None


@pytest.mark.slow
def test_links_and_names_that_are_not_utf8_are_not_taken(mosquitto: Any, service_factory: Any, root: Path) -> None:
    # Given a watch folder that receives a file whose name is not UTF-8 and a link to another
    # file of the media roots (a hostile upload), besides an ordinary file
    inbox = root / "inbox"
    svc = _start(service_factory, mosquitto, root, inbox)
    with open(os.fsencode(inbox) + b"/bad\xff.wav", "wb") as fh:
        fh.write(os.urandom(10_000))
    (root / "elsewhere" / "private.wav").write_bytes(os.urandom(10_000))
    (inbox / "link.wav").symlink_to(root / "elsewhere" / "private.wav")
    (inbox / "good.wav").write_bytes(os.urandom(10_000))
    # Then the ordinary file becomes a job, the others are logged once and not taken, and the
    # service stays up (a name that is not UTF-8 stopped it, at every start)
    wait_until(lambda: _jobs(svc, inbox / "good.wav"), 30, "a job for the ordinary file")
    wait_until(lambda: svc.log().count("is not taken") >= 2, 30, "the two files logged")
    assert svc.proc.poll() is None
    _sentinel(svc, inbox)
    assert sorted(_all_inputs(svc)) == sorted(str(inbox / n) for n in ("good.wav", "zz-sentinel.wav"))
    assert svc.stop() == 0
    svc.start()  # and it starts again
    _sentinel(svc, inbox, "zz-second.wav")
    assert svc.proc.poll() is None and svc.log().count("bad\\xff.wav is not taken") == 2


def test_a_tree_too_deep_for_the_watcher_is_reported_not_silent(
    mosquitto: Any, service_factory: Any, root: Path
) -> None:
    # Given a recursive watch folder
    inbox = root / "inbox"
    svc = _start(service_factory, mosquitto, root, inbox, recursive=True)
    watcher = svc.watcher("info")
    _info_watch(svc, watcher, "watching")
    # When a folder tree 1,500 levels deep is moved into it (deeper than a walk can recurse)
    deep = root / "elsewhere" / "deep"
    deep.mkdir()
    _deep_tree(deep, 1500)
    os.rename(deep, inbox / "deep")
    try:
        # Then the watch is reported failed, and the service goes on
        failed = _info_watch(svc, watcher, "failed")
        assert failed["path"] == str(inbox) and failed.get("error")
        assert "watching stopped" in svc.log() and svc.proc.poll() is None
    finally:
        watcher.close()
        assert svc.stop() == 0
        _deep_tree(inbox / "deep", 1500, remove=True)


def _deep_tree(top: Path, levels: int, *, remove: bool = False) -> None:
    """Make (or remove) ``top/d/d/...``, ``levels`` deep, without recursion (os.makedirs and
    shutil.rmtree recurse, and fail at such depths)."""
    fds = [os.open(top, os.O_RDONLY | os.O_DIRECTORY)]
    try:
        for _ in range(levels):
            if not remove:
                os.mkdir("d", dir_fd=fds[-1])
            fds.append(os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fds[-1]))
        if remove:
            while len(fds) > 1:
                os.close(fds.pop())
                os.rmdir("d", dir_fd=fds[-1])
    finally:
        for fd in fds:
            os.close(fd)
    if remove:
        top.rmdir()
