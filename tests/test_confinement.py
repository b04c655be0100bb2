"""Media cannot reach outside the media roots, and no file name comes from client text
(docs/topics.md, "submit" Inputs, "Job kinds").

Against the real service and real FFmpeg: playlists and lists that name a private recording
outside the roots, inputs replaced after the submit by a link or a FIFO, option values and long
names that would end up in output file names. The private recording is a real speech clip
whose words must appear in no result, output or log.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from edge_queue.errors import MediaError
from edge_queue.kinds import media
from edge_queue.kinds.base import MAX_NAME_BYTES, output_stem
from edge_queue.kinds.transcribe import WHISPER_LANGUAGES

from .conftest import Broker, ServiceProcess
from .kinds_for_tests import SWAP_ENV

#: Words of the private recording (jfk.flac), none of which may leak.
SECRET_WORDS = ("ask not what your country", "country can do for you")


@pytest.fixture
def layout(tmp_path: Path, speech: Path) -> tuple[Path, Path]:
    """``(root, secret)``: a media root with a real clip in it, and a private recording outside."""
    root, private = tmp_path / "media", tmp_path / "private"
    root.mkdir()
    private.mkdir()
    shutil.copy(speech / "librivox-0870.wav", root / "clip.wav")
    secret = private / "secret.flac"
    shutil.copy(speech / "jfk.flac", secret)
    return root, secret


def _everything_written(svc: ServiceProcess, root: Path) -> str:
    """The service's log, every file under data_dir (store, outputs) and every output it could
    have written beside the inputs."""
    parts = [svc.log()]
    files = [p for p in svc.data_dir.rglob("*")]
    files += [p for p in root.rglob("*") if p.suffix in (".txt", ".srt", ".vtt", ".json")]
    for p in files:
        if p.is_file() and not p.is_symlink():
            parts.append(p.read_bytes().decode("utf-8", "replace"))
    return "\n".join(parts).lower()


def _no_leak(svc: ServiceProcess, root: Path, secret: Path) -> None:
    written = _everything_written(svc, root)
    for words in SECRET_WORDS:
        assert words not in written
    assert str(secret).lower() not in written


LISTS = {
    "list.m3u8": "#EXTM3U\n#EXT-X-TARGETDURATION:20\n#EXTINF:20,\n{secret}\n#EXT-X-ENDLIST\n",
    "disguised.m4a": "#EXTM3U\n#EXTINF:20,\n{secret}\n",
    "list.ffconcat": "ffconcat version 1.0\nfile {secret}\n",
    "plain.concat": "file '{secret}'\n",
    "list.pls": "[playlist]\nFile1={secret}\nNumberOfEntries=1\n",
    "stream.mpd": '<?xml version="1.0"?><MPD><Period><BaseURL>file://{secret}</BaseURL></Period></MPD>',
    "session.sdp": "v=0\no=- 0 0 IN IP4 127.0.0.1\ns=x\nc=IN IP4 127.0.0.1\nm=audio 5004 RTP/AVP 0\n",
}


def test_lists_that_name_other_files_are_refused_at_submit(
    mosquitto: Broker, service_factory, layout: tuple[Path, Path]
) -> None:
    root, secret = layout
    for name, text in LISTS.items():
        (root / name).write_text(text.format(secret=secret))
    svc = service_factory(mosquitto, [root]).start()
    watcher = svc.watcher("response/#")
    for kind in ("transcribe", "probe", "extract_audio"):
        resp = svc.request("submit", {"kind": kind, "inputs": [str(root / n) for n in LISTS]}, watcher)
        # Then every list is rejected with unsupported_media, and no job is made
        assert resp["status"] == "error", resp
        rejected = resp["error"]["rejected"]
        assert [r["code"] for r in rejected] == ["unsupported_media"] * len(LISTS), rejected
        assert all("refers to other files" in r["message"] for r in rejected)
    assert svc.request("list", {}, watcher)["data"]["jobs"] == []
    _no_leak(svc, root, secret)


#: A 1x1 PNG image: an image is no audio or video input (FFmpeg would read it as image2).
PNG_1X1 = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082"
)


@pytest.mark.parametrize(
    ("name", "code"),
    [
        ("list.m3u8", "unsupported_media"),
        ("list.ffconcat", "unsupported_media"),
        ("frame.png", "unsupported_media"),
        ("img%03d.png", "input_not_found"),
    ],
)
def test_ffmpeg_in_the_worker_never_follows_a_list(layout: tuple[Path, Path], name: str, code: str) -> None:
    # Given, inside the root, a list naming the private recording, a still image, or an
    # image-sequence pattern (img%03d.png) whose frames img001.png... exist but which itself
    # does not, opened as a worker opens its inputs
    root, secret = layout
    path = root / name
    if name.startswith("img"):
        for i in (1, 2, 3):
            (root / f"img{i:03d}.png").write_bytes(PNG_1X1)
    elif name == "frame.png":
        path.write_bytes(PNG_1X1)
    else:
        path.write_text(LISTS["list.m3u8" if name.endswith("m3u8") else "list.ffconcat"].format(secret=secret))
    media.confine_inputs([root])
    try:
        # Then FFmpeg refuses it: it reads that one file, with single-file demuxers only
        with pytest.raises(MediaError) as e:
            with media.open_media(str(path)) as c:
                pytest.fail(f"opened as {c.format.name}: {[s.type for s in c.streams]}")
        assert e.value.code == code, e.value
    finally:
        media._roots = None


def test_an_input_with_a_name_too_long_is_rejected_and_costs_the_batch_nothing(
    mosquitto: Broker, service_factory, layout: tuple[Path, Path]
) -> None:
    # Given a batch of a good file and one whose name is longer than the file system allows
    root, _ = layout
    svc = service_factory(mosquitto, [root]).start()
    watcher = svc.watcher("response/#", "jobs/+")
    long_name = str(root / ("L" * 300 + ".flac"))
    resp = svc.request("submit", {"kind": "probe", "inputs": [str(root / "clip.wav"), long_name]}, watcher)
    # Then the long one is rejected with input_not_found and the good one runs
    assert resp["status"] == "ok", resp
    assert [r["code"] for r in resp["data"]["rejected"]] == ["input_not_found"], resp
    (job,) = resp["data"]["jobs"]
    watcher.wait_json(f"{svc.base}/jobs/{job['job_id']}", lambda m: m["state"] == "succeeded", 60)
    # and alone it is answered with the code, not an internal error
    alone = svc.request("submit", {"kind": "probe", "input": long_name}, watcher)
    assert alone["status"] == "error" and alone["error"]["code"] == "input_not_found", alone


def test_a_link_to_a_name_that_is_not_utf8_is_rejected_and_costs_the_batch_nothing(
    mosquitto: Broker, service_factory, layout: tuple[Path, Path]
) -> None:
    # Given links with UTF-8 names to a file and into a folder whose names are not UTF-8 (the
    # store, the job object and MQTT carry text only)
    root, _ = layout
    odd = os.fsencode(root) + b"/odd\xff"
    os.mkdir(odd)
    shutil.copy(root / "clip.wav", os.fsdecode(odd + b"/clip\xfe.wav"))
    os.symlink(odd + b"/clip\xfe.wav", os.fsencode(root / "to-file.wav"))
    shutil.copy(root / "clip.wav", os.fsdecode(odd + b"/x.wav"))
    os.symlink(odd, os.fsencode(root / "to-dir"))
    svc = service_factory(mosquitto, [root]).start()
    watcher = svc.watcher("response/#", "jobs/+")
    bad = [str(root / "to-file.wav"), str(root / "to-dir" / "x.wav")]
    resp = svc.request("submit", {"kind": "probe", "inputs": [str(root / "clip.wav"), *bad]}, watcher)
    # Then each is rejected with input_not_found and the good one runs
    assert resp["status"] == "ok", resp
    assert [r["code"] for r in resp["data"]["rejected"]] == ["input_not_found"] * 2, resp
    assert "not UTF-8" in resp["data"]["rejected"][0]["message"]
    (job,) = resp["data"]["jobs"]
    watcher.wait_json(f"{svc.base}/jobs/{job['job_id']}", lambda m: m["state"] == "succeeded", 60)
    # and alone it is answered with the code, not an internal error
    alone = svc.request("submit", {"kind": "probe", "input": bad[0]}, watcher)
    assert alone["status"] == "error" and alone["error"]["code"] == "input_not_found", alone
    assert "Traceback" not in svc.log()


def _later(seconds: float) -> str:
    return (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("swap", "code"),
    [
        ("link-out", "input_outside_media_roots"),
        ("dir-link-out", "input_outside_media_roots"),
        ("fifo", "input_not_found"),
        ("link-not-utf8", "input_not_found"),
        ("playlist", "unsupported_media"),
    ],
)
def test_an_input_replaced_after_the_submit_is_checked_again_when_opened(
    mosquitto: Broker, service_factory, layout: tuple[Path, Path], swap: str, code: str
) -> None:
    # Given a valid input inside the root, submitted to run 3 s later
    root, secret = layout
    folder = root / "in"
    folder.mkdir()
    clip = folder / "clip.wav"
    shutil.copy(root / "clip.wav", clip)
    svc = service_factory(mosquitto, [root]).start()
    watcher = svc.watcher("response/#", "jobs/+")
    resp = svc.request("submit", {"kind": "transcribe", "input": str(clip), "run_at": _later(3)}, watcher)
    job_id = resp["data"]["jobs"][0]["job_id"]
    # When the input is replaced before the job starts
    if swap == "link-out":
        clip.unlink()
        clip.symlink_to(secret)
    elif swap == "dir-link-out":  # a folder on the path becomes a link out of the roots
        shutil.rmtree(folder)
        shutil.copy(secret, secret.parent / "clip.wav")
        folder.symlink_to(secret.parent)
    elif swap == "fifo":
        clip.unlink()
        os.mkfifo(clip)
    elif swap == "link-not-utf8":  # inside the roots, but its real path is not text
        odd = os.fsencode(root) + b"/real\xe9.wav"
        shutil.copy(root / "clip.wav", os.fsdecode(odd))
        clip.unlink()
        os.symlink(odd, os.fsencode(clip))
    else:
        clip.write_text(LISTS["list.m3u8"].format(secret=secret))
    # Then the job fails with a clear code, promptly (a FIFO does not hold the worker)
    t0 = time.monotonic()
    final = watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] in ("failed", "succeeded"), 60)
    assert final["state"] == "failed", final
    assert final["error"]["code"] == code, final["error"]
    assert final["attempt"] == 1  # not retried
    assert time.monotonic() - t0 < 30
    _no_leak(svc, root, secret)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("swap", "code"), [("none", None), ("fifo", "input_not_found"), ("link-out", "input_outside_media_roots")]
)
def test_the_worker_opens_its_input_once_and_a_swap_at_that_moment_fails_fast(
    mosquitto: Broker, service_factory, layout: tuple[Path, Path], tmp_path: Path, swap: str, code: str | None
) -> None:
    # Given a share writer who swaps the input the moment the worker first opens it, and one slot
    root, secret = layout
    clip, opens = root / "swapped.wav", tmp_path / "opens.log"
    shutil.copy(root / "clip.wav", clip)
    spec = {"path": str(clip), "to": swap, "target": str(secret), "log": str(opens)}
    env = {SWAP_ENV: json.dumps(spec), "EDGE_QUEUE_WORKERS": "1"}
    svc = service_factory(mosquitto, [root], env).start()
    watcher = svc.watcher("response/#", "jobs/+")
    resp = svc.request("submit", {"kind": "transcribe", "input": str(clip)}, watcher)
    job_id = resp["data"]["jobs"][0]["job_id"]
    # Then the job fails at once with a clear code (a FIFO does not hold the only slot)...
    final = watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] in ("failed", "succeeded"), 30)
    if code is None:
        assert final["state"] == "succeeded", final
    else:
        assert final["state"] == "failed", final
        assert final["error"]["code"] == code, final["error"]
    # ...the worker opened the input's path once, for hashing, the track and decoding alike...
    assert len(opens.read_text().splitlines()) == 1, opens.read_text()
    # ...and the slot takes the next job
    resp = svc.request("submit", {"kind": "transcribe", "input": str(root / "clip.wav")}, watcher)
    next_id = resp["data"]["jobs"][0]["job_id"]
    done = watcher.wait_json(f"{svc.base}/jobs/{next_id}", lambda m: m["state"] in ("failed", "succeeded"), 60)
    assert done["state"] == "succeeded", done
    _no_leak(svc, root, secret)


def test_client_text_never_becomes_a_file_name(mosquitto: Broker, service_factory, layout: tuple[Path, Path]) -> None:
    root, secret = layout
    # (an English-only model, configured by its bundled name)
    svc = service_factory(mosquitto, [root], {"EDGE_QUEUE_TRANSCRIBE__MODEL": "tiny.en"}).start()
    watcher = svc.watcher("response/#")
    clip = str(root / "clip.wav")
    # A language that is not a Whisper code (here a path) is refused, naming the field
    for language in ("/../../z", "../x", "EN", "xx", "english"):
        resp = svc.request(
            "submit",
            {"kind": "transcribe", "input": clip, "options": {"language": language, "output": "beside"}},
            watcher,
        )
        assert resp["status"] == "error", resp
        assert resp["error"]["field"] in ("options.language", "input"), resp
    # ... and an English-only model takes only "en"
    resp = svc.request("submit", {"kind": "transcribe", "input": clip, "options": {"language": "fr"}}, watcher)
    assert resp["status"] == "error" and resp["error"]["field"] == "options.language", resp
    assert resp["error"]["code"] == "language_unsupported", resp
    # (named as results name it, with the setting that chose it)
    assert "the model 'tiny.en' (transcribe.model) is English-only" in resp["error"]["message"], resp
    assert svc.request("list", {}, watcher)["data"]["jobs"] == []


def test_the_languages_are_whispers() -> None:
    from faster_whisper.tokenizer import _LANGUAGE_CODES

    assert frozenset(_LANGUAGE_CODES) == WHISPER_LANGUAGES


@pytest.mark.parametrize("stem", ["a" * 250, "é" * 125, "ü" * 119 + "a" * 9, "clip"])
def test_output_stems_fit_the_file_system(stem: str) -> None:
    out = output_stem(f"/srv/media/{stem}.wav", ".und.json")
    assert len(os.fsencode(out + ".und.json")) <= MAX_NAME_BYTES
    out.encode("utf-8")  # whole characters only
    assert out == output_stem(f"/srv/media/{stem}.wav", ".und.json")  # the same every time
    if len(os.fsencode(stem + ".und.json")) <= MAX_NAME_BYTES:
        assert out == stem
    else:
        assert out != output_stem(f"/srv/media/{stem[:-1]}b.wav", ".und.json")  # ends differ: names differ


def test_an_input_with_a_255_byte_name_gets_its_outputs(
    mosquitto: Broker, service_factory, layout: tuple[Path, Path]
) -> None:
    # Given an input whose name is as long as the file system allows
    root, _ = layout
    long_input = root / ("é" * 125 + ".wav")  # 250 + 4 bytes
    shutil.copy(root / "clip.wav", long_input)
    svc = service_factory(mosquitto, [root]).start()
    watcher = svc.watcher("response/#", "jobs/+")
    resp = svc.request(
        "submit", {"kind": "extract_audio", "input": str(long_input), "options": {"output": "beside"}}, watcher
    )
    job_id = resp["data"]["jobs"][0]["job_id"]
    final = watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] in ("failed", "succeeded"), 60)
    # Then it succeeds at the first attempt, with a shortened, deterministic name beside it
    assert final["state"] == "succeeded", final
    assert final["attempt"] == 1
    out = Path(final["result"]["output"])
    assert out.parent == root and out.is_file()
    assert len(os.fsencode(out.name)) <= MAX_NAME_BYTES and "~" in out.name


def test_no_file_of_data_dir_is_an_input_even_inside_a_media_root(tmp_path: Path) -> None:
    # the default data_dir (~/.local/share/edge-queue) lies inside `up --media-root "$HOME"`
    from edge_queue.errors import InputError
    from edge_queue.rules.inputs import check_input

    data_dir = tmp_path / ".local" / "share" / "edge-queue"
    (data_dir / "outputs" / "job").mkdir(parents=True)
    (data_dir / "edge-queue.db").write_bytes(b"SQLite format 3\x00")
    (data_dir / "outputs" / "job" / "call.txt").write_text("a transcript, which get shows to every user")
    (tmp_path / "call.m4a").write_bytes(b"audio")
    (tmp_path / "link.db").symlink_to(data_dir / "edge-queue.db")
    for taken in (tmp_path / "call.m4a", data_dir / "outputs" / "job" / "call.txt"):
        assert check_input(str(taken), [tmp_path], data_dir) == str(taken)
    for inside in (data_dir / "edge-queue.db", tmp_path / "link.db"):
        with pytest.raises(InputError) as e:
            check_input(str(inside), [tmp_path], data_dir)
        assert e.value.code == "input_outside_media_roots" and "data_dir" in e.value.message
