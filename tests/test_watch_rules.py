"""Watch folders without a running service (docs/configuration.md, "[[watch]]"): which names are inputs,
content identity, the store of seen files, inotify loss and limits, bad settings and failed commits."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edge_queue.watch.files import file_digest, is_network_fs, skip_reason

from .conftest import ROOT, need, run_doctor, wait_until

# -- pure logic ------------------------------------------------------------------------


def test_names_that_are_never_inputs() -> None:
    inc, exc = ["*.wav", "*.MP4"], ["*-draft.*"]
    assert skip_reason("talk.wav", inc, exc) is None
    assert skip_reason("CLIP.mp4", inc, exc) is None  # case-insensitive
    for name, why in [
        (".talk.wav", "hidden"),
        ("talk.wav.part", "temporary"),
        ("talk.wav.tmp", "temporary"),
        (".~lock.talk.wav#", "hidden"),
        ("~$talk.wav", "temporary"),
        ("talk.en.srt", "output"),
        ("talk.en.txt", "output"),
        ("talk.und.json", "output"),
        ("talk.vtt", "output"),
        ("talk.web.mp4", "output"),
        ("talk.flac", "not included"),
        ("talk-draft.wav", "excluded"),
    ]:
        assert skip_reason(name, inc, exc) == why, name


def test_digest_is_content_identity(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"x" * 1000)
    b.write_bytes(b"x" * 1000)
    os.utime(b, (1, 1))  # another modification time: the same content
    assert file_digest(str(a), 1000) == file_digest(str(b), 1000)
    b.write_bytes(b"x" * 999 + b"y")
    assert file_digest(str(a), 1000) != file_digest(str(b), 1000)
    assert is_network_fs("nfs4") and is_network_fs("cifs") and is_network_fs("fuse.sshfs")
    assert not is_network_fs("ext4") and not is_network_fs(None)


def test_store_keeps_one_version_per_path(tmp_path: Path) -> None:
    from edge_queue.store import JobSpec, Store

    store = Store(tmp_path / "s.db")
    store.watched.record_watched("/m/inbox/a.wav", 10, 111, "sha256:a", "job", "job1", 1.0)
    store.watched.record_watched("/m/inbox/sub/c.wav", 30, 333, "sha256:c", "refused:unsupported_media", None, 1.0)
    store.watched.record_watched("/m/inbox2/b.wav", 20, 222, "sha256:b", "job", "job2", 1.0)
    # a folder's files, not those of a folder whose name merely starts the same
    assert store.watched.watched_files(["/m/inbox"]) == {
        "/m/inbox/a.wav": (10, 111, "sha256:a"),
        "/m/inbox/sub/c.wav": (30, 333, "sha256:c"),
    }
    store.watched.touch_watched("/m/inbox/a.wav", 999, 2.0)
    assert store.watched.watched_files(["/m/inbox"])["/m/inbox/a.wav"] == (10, 999, "sha256:a")
    assert store.watched.watch_counts("/m/inbox") == {"job": 1, "refused:unsupported_media": 1}
    # a new version replaces the old one; its job too
    store.watched.record_watched("/m/inbox/a.wav", 11, 1000, "sha256:a2", "job", "job3", 3.0)
    row = store.conn.execute("SELECT size, job_id FROM watch_files WHERE path = '/m/inbox/a.wav'").fetchone()
    assert row == (11, "job3")
    # jobs writing beside their input, directly in the folder
    store.submit([JobSpec("extract_audio", "/m/inbox/talk.flac", {"output": "beside"})], 5.0)
    store.submit([JobSpec("extract_audio", "/m/inbox/sub/x.flac", {"output": "beside"})], 5.0)
    store.submit([JobSpec("extract_audio", "/m/inbox/y.flac", {})], 5.0)
    assert [(j.input, j.created, j.state, j.written) for j in store.watched.beside_jobs("/m/inbox")] == [
        ("/m/inbox/talk.flac", 5.0, "queued", frozenset())
    ]
    store.close()


def test_watch_outside_media_roots_is_a_config_error(tmp_path: Path, root: Path) -> None:
    outside = tmp_path / "not-media"
    outside.mkdir()
    config = tmp_path / "config.toml"
    config.write_text(
        f'media_roots = ["{root}"]\n\n[[watch]]\npath = "{outside}"\nkind = "probe"\n'
        f'options = {{}}\ninclude = ["*.wav"]\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_QUEUE_")}
    env["PYTHONPATH"] = str(ROOT)
    check = subprocess.run(
        [sys.executable, "-m", "edge_queue", "config", "check", str(config)], env=env, capture_output=True, text=True
    )
    assert check.returncode == 2, check
    assert f"watch[0].path: {outside} is not inside a media root" in check.stderr, check.stderr
    serve = subprocess.run(
        [sys.executable, "-m", "edge_queue", "serve", "--config", str(config)],
        env={**env, "EDGE_QUEUE_DATA_DIR": str(tmp_path / "data")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert serve.returncode == 2 and "is not inside a media root" in serve.stderr, serve


# -- inotify ---------------------------------------------------------------------------


def test_lost_inotify_events_make_a_scan(tmp_path: Path) -> None:
    """When the kernel's inotify queue overflows, watchdog logs it and events are lost: the
    folder is scanned again, so a file whose event was lost still becomes ready."""
    import logging

    from edge_queue.watch.watcher import OVERFLOW_LOGGER

    folder = tmp_path / "inbox"
    folder.mkdir()
    with _folder_watcher(folder) as watcher:
        wait_until(lambda: watcher.describe()[0]["state"] == "watching", 10, "watching")
        watcher.states[0].observer.stop()  # events from here on are lost
        watcher.states[0].observer.join(5)
        (folder / "lost.wav").write_bytes(b"data")
        logging.getLogger(OVERFLOW_LOGGER).warning("Inotify queue overflowed; filesystem events were lost")
        ready = wait_until(lambda: watcher.take(10), 10, "the file found by the scan")
        assert [Path(r.path).name for r in ready] == ["lost.wav"]


def test_inotify_limit_falls_back_to_polling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """When inotify cannot watch (``fs.inotify.max_user_watches`` reached: ENOSPC), the folder
    is polled instead, and ``<base>/info`` says why."""
    import errno

    import watchdog.observers

    class NoWatches(watchdog.observers.Observer):  # type: ignore[misc,valid-type]
        def start(self) -> None:
            raise OSError(errno.ENOSPC, "inotify watch limit reached")

    monkeypatch.setattr(watchdog.observers, "Observer", NoWatches)
    folder = tmp_path / "inbox"
    folder.mkdir()
    with _folder_watcher(folder, poll_interval_s=1) as watcher:
        state = wait_until(lambda: watcher.describe()[0]["state"] == "watching" and watcher.describe()[0], 10, "it")
        assert state["mode"] == "poll" and "inotify watch limit reached" in state["error"], state
        assert type(watcher.states[0].observer).__name__ == "PollingObserver"
        (folder / "new.wav").write_bytes(b"data")
        ready = wait_until(lambda: watcher.take(10), 10, "the file found by polling")
        assert [Path(r.path).name for r in ready] == ["new.wav"]


@contextlib.contextmanager
def _folder_watcher(folder: Path, **settings: Any) -> Iterator[Any]:
    """A started FolderWatcher of ``folder`` (noop jobs, inotify events, settle 0.2 s) with a
    wake-up socket pair of its own; stopped and closed on exit."""
    import socket

    from edge_queue.config.settings import WatchSettings
    from edge_queue.watch.watcher import FolderWatcher

    wake_r, wake_w = socket.socketpair()
    cfg = WatchSettings(path=folder, kind="noop", settle_s=0.2, mode="events", **settings)
    watcher = FolderWatcher([cfg], {}, wake_w)
    watcher.start()
    try:
        yield watcher
    finally:
        watcher.stop()
        wake_r.close()
        wake_w.close()


@pytest.mark.parametrize(
    ("watch", "message"),
    [
        ({"kind": "no_such_kind"}, "watch[0].kind: unknown job kind 'no_such_kind'"),
        ({"kind": "noop", "options": {"sleep_s": 1000}}, "watch[0].options.sleep_s:"),
        ({"kind": "noop", "path": "inbox"}, "watch.0.path: Value error, a watch path must be absolute"),
    ],
)
def test_bad_watch_stops_the_start(tmp_path: Path, root: Path, watch: dict[str, Any], message: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_QUEUE_")}
    env.update(
        PYTHONPATH=str(ROOT),
        EDGE_QUEUE_DATA_DIR=str(tmp_path / "data"),
        EDGE_QUEUE_MEDIA_ROOTS=json.dumps([str(root)]),
        EDGE_QUEUE_WATCH=json.dumps([{"path": str(root / "inbox"), **watch}]),
    )
    serve = subprocess.run(
        [sys.executable, "-m", "edge_queue", "serve"], env=env, capture_output=True, text=True, timeout=60
    )
    assert serve.returncode == 2 and message in serve.stderr, serve


def test_a_failed_commit_offers_the_files_again(tmp_path: Path, root: Path) -> None:
    """A turn whose commit fails (a full disk) loses neither the job nor the file: the file is
    offered again, and becomes one job when a commit succeeds."""
    from edge_queue.config.settings import Settings, WatchSettings
    from edge_queue.service import Service
    from edge_queue.store import Store

    inbox = root / "inbox"
    settings = Settings(
        data_dir=tmp_path / "data",
        media_roots=[root],
        watch=[WatchSettings(path=inbox, kind="noop", settle_s=0.2, mode="events")],
    )
    svc = Service(settings)
    svc.store = Store(settings.db_path)
    folders = svc.watch_folders
    folders.boot()
    assert folders.watcher is not None
    try:
        (inbox / "a.wav").write_bytes(b"recording")
        wait_until(lambda: folders.watcher.pending(), 10, "a complete file")  # type: ignore[union-attr]
        # When the turn that made its job fails to commit
        with pytest.raises(sqlite3.OperationalError), svc.store.group():
            folders.turn(time.time())
            assert svc.store.counts()["queued"] == 1
            raise sqlite3.OperationalError("database or disk is full")
        folders.turn_failed()
        assert svc.store.counts()["queued"] == 0
        assert svc.store.watched.watched_files([str(inbox)]) == {}
        # Then the next turn makes it, once
        with svc.store.group():
            folders.turn(time.time())
        folders.committed()
        jobs = svc.store.list_jobs()
        assert [j["input"] for j in jobs] == [str(inbox / "a.wav")]
        assert list(svc.store.watched.watched_files([str(inbox)])) == [str(inbox / "a.wav")]
        with svc.store.group():
            folders.turn(time.time())
        assert len(svc.store.list_jobs()) == 1
    finally:
        folders.stop()
        svc.close()


@pytest.mark.slow
def test_doctor_fails_a_beside_watch_folder_where_no_file_can_be_made(tmp_path: Path, root: Path) -> None:
    inbox = root / "inbox"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_QUEUE_")}
    env.update(
        PYTHONPATH=str(ROOT),
        EDGE_QUEUE_DATA_DIR=str(tmp_path / "data"),
        EDGE_QUEUE_MEDIA_ROOTS=json.dumps([str(root)]),
        EDGE_QUEUE_HTTP__ENABLED="false",
        EDGE_QUEUE_WATCH=json.dumps([{"path": str(inbox), "kind": "transcribe", "options": {"output": "beside"}}]),
    )
    # Given a watch folder whose outputs go beside the files, made immutable (root cannot write it)
    made = subprocess.run(["chattr", "+i", str(inbox)], capture_output=True, text=True)
    need(made.returncode == 0, f"chattr +i is refused here ({made.stderr.strip()})")
    try:
        doctor = run_doctor(env)
    finally:
        subprocess.run(["chattr", "-i", str(inbox)], check=True)
    # Then doctor fails it, saying why; once writable, it is ok again
    line = next(x for x in doctor.stdout.splitlines() if f"watch {inbox}:" in x)
    assert line.startswith("FAIL") and "output = beside" in line and "Operation not permitted" in line, line
    assert not list(inbox.iterdir())  # doctor's own try left nothing
    again = run_doctor(env)
    assert f"ok    watch {inbox}:" in again.stdout, again.stdout
