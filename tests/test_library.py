"""A media library's rules for ``transcribe`` (docs/topics.md, "Media libraries"): subtitles
already there (beside or embedded, forced ones not counting) skip the job; the audio track is
chosen by its language tag; beside outputs are named with two- or three-letter codes. The rules
in milliseconds, then real Matroska files (two audio tracks, subtitle streams) through a real
service."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_queue.kinds.library import (
    existing_subtitle,
    language_codes,
    language_rank,
    language_tag,
    subtitle_beside,
)

from .conftest import ROOT, ServiceProcess, need, wait_until, wer

JFK = "And so my fellow Americans, ask not what your country can do for you, ask what you can do for your country."


def test_language_codes_and_tags() -> None:
    assert {"de", "deu", "ger"} <= language_codes("de") and language_codes("ger") == language_codes("de")
    assert language_codes("jw") == {"jw"}  # Whisper's own code for Javanese
    assert (language_tag("de", "alpha2"), language_tag("de", "alpha3"), language_tag("en", "alpha3")) == (
        "de",
        "ger",
        "eng",
    )
    assert language_tag("fr", "alpha3") == "fre" and language_tag("haw", "alpha2") == "haw"
    assert (
        language_rank("ENG", ["de", "en"]) == 1 and language_rank(None, ["en"]) == 1 and language_rank("eng", []) == 0
    )


def test_subtitles_beside(tmp_path: Path) -> None:
    film = tmp_path / "Film (2001).mkv"
    film.write_bytes(b"")
    (tmp_path / "Film (2001).en.forced.srt").write_text("x")  # forced: foreign lines only
    (tmp_path / "Film (2001) extended.en.srt").write_text("x")  # another stem
    (tmp_path / "Film (2001).en.txt").write_text("x")  # not a subtitle
    assert subtitle_beside(str(film), "en") is None
    (tmp_path / "Film (2001).ger.sdh.ass").write_text("x")
    assert subtitle_beside(str(film), "de") == str(tmp_path / "Film (2001).ger.sdh.ass")
    assert subtitle_beside(str(film), "en") is None
    (tmp_path / "Film (2001).eng.srt").write_text("x")
    assert existing_subtitle(str(film), "en", [])["reason"] == "subtitle_beside"


def test_an_empty_or_unreadable_subtitle_is_no_subtitle(tmp_path: Path) -> None:
    film = tmp_path / "film.mkv"
    film.write_bytes(b"")
    (tmp_path / "film.en.srt").write_bytes(b"")  # 0 bytes
    (tmp_path / "film.eng.srt").write_bytes(b"\xef\xbb\xbf\r\n \n")  # a BOM and blank lines
    os.mkfifo(tmp_path / "film.en.vtt")  # not a file: never waited on
    (tmp_path / "film.en.ass").symlink_to(tmp_path / "gone.ass")  # a link to nothing
    assert subtitle_beside(str(film), "en") is None
    assert existing_subtitle(str(film), "en", []) is None
    (tmp_path / "film.en.sdh.srt").write_text("1\n00:00:01,000 --> 00:00:02,000\nHello\n")
    assert subtitle_beside(str(film), "en") == str(tmp_path / "film.en.sdh.srt")


def test_subtitles_embedded() -> None:
    forced = [{"index": 2, "language": "eng", "forced": True, "codec": "subrip"}]
    assert existing_subtitle("/nowhere/film.mkv", "en", forced) is None
    full = [*forced, {"index": 3, "language": "eng", "forced": False, "codec": "ass"}]
    assert existing_subtitle("/nowhere/film.mkv", "en", full) == {
        "reason": "subtitle_embedded",
        "existing": "stream 3 (ass, eng)",
    }
    assert existing_subtitle("/nowhere/film.mkv", "de", full) is None


# -- real files through a real service ----------------------------------------------------------


def speech_pcm(path: Path) -> np.ndarray:
    from faster_whisper import decode_audio

    return (decode_audio(str(path)) * 32767).astype(np.int16)


def film(path: Path, speech: np.ndarray, *, subtitle: tuple[str, bool] | None) -> Path:
    """A Matroska file: a German track (the default, silence) and an English one (``speech``),
    and optionally a subtitle stream of (language, forced)."""
    import av

    srt = path.with_suffix(".src.srt")
    srt.write_text("1\n00:00:00,000 --> 00:00:02,000\nHello\n")
    with av.open(str(path), "w") as out:
        tracks = []
        for lang, default in (("ger", True), ("eng", False)):
            stream = out.add_stream("pcm_s16le", rate=16000, layout="mono")
            stream.metadata["language"] = lang
            stream.disposition = av.stream.Disposition.default if default else av.stream.Disposition(0)
            tracks.append(stream)
        if subtitle is not None:
            src = av.open(str(srt))
            sub = out.add_stream_from_template(src.streams.subtitles[0])
            sub.metadata["language"] = subtitle[0]
            sub.disposition = av.stream.Disposition.forced if subtitle[1] else av.stream.Disposition(0)
        for stream, samples in zip(tracks, (np.zeros_like(speech), speech), strict=True):
            frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
            frame.rate = 16000
            for packet in [*stream.encode(frame), *stream.encode(None)]:
                out.mux(packet)
        if subtitle is not None:
            for packet in src.demux(src.streams.subtitles[0]):
                if packet.dts is not None:
                    packet.stream = sub
                    out.mux(packet)
            src.close()
    srt.unlink()
    return path


def run_job(svc: ServiceProcess, body: dict[str, Any]) -> dict[str, Any]:
    with svc.watcher("response/#", "jobs/#") as w:
        resp = svc.request("submit", body, w)
        assert resp["status"] == "ok", resp
        job_id = resp["data"]["jobs"][0]["job_id"]
        topic = f"{svc.base}/jobs/{job_id}"
        wait_until(lambda: (w.json_on(topic) or [{}])[-1].get("state") in ("succeeded", "failed"), 120, "the job")
        job = w.json_on(topic)[-1]
    assert job["state"] == "succeeded", job
    return job["result"]


@pytest.mark.slow
def test_a_library_s_rules_through_the_service(
    service_factory: Any, mosquitto: Any, speech: Path, tmp_path: Path, model_installed: None
) -> None:
    media = tmp_path / "media"
    media.mkdir()
    jfk = speech_pcm(speech / "jfk.flac")
    movie = film(media / "Movie (1961).mkv", jfk, subtitle=("eng", True))
    svc = service_factory(mosquitto, [media], {"EDGE_QUEUE_WORKERS": "1"}).start()
    library = {"output": "beside", "skip_if_subtitled": True, "audio_languages": ["en"], "language_tag": "alpha3"}

    # the English track (not the default), a forced English subtitle does not count, eng in the name
    first = run_job(svc, {"input": str(movie), "options": {**library, "language": "en"}})
    assert "skipped" not in first and wer(JFK, first["text"]) < 0.15
    assert first["outputs"]["srt"] == str(media / "Movie (1961).eng.srt")
    # the default track is the silent German one: without audio_languages, no Kennedy
    default = run_job(svc, {"input": str(movie), "options": {"language": "en", "formats": ["json"]}})
    assert "americans" not in default["text"].lower()

    # now an English subtitle is beside it: skipped, not failed (and not output_exists)
    again = run_job(svc, {"input": str(movie), "options": {**library, "language": "en"}})
    assert again["skipped"] == {"reason": "subtitle_beside", "existing": str(media / "Movie (1961).eng.srt")}
    assert again["outputs"] == {}

    # an empty subtitle beside a film is no subtitle: transcribed, not skipped
    empty = film(media / "Empty.mkv", jfk, subtitle=("eng", True))
    (media / "Empty.en.srt").write_bytes(b"")
    done = run_job(svc, {"input": str(empty), "options": {**library, "language": "en", "formats": ["srt"]}})
    assert "skipped" not in done and done["outputs"]["srt"] == str(media / "Empty.eng.srt")

    # embedded and not forced, the language detected on the first chunk: skipped
    other = film(media / "Other.mkv", jfk, subtitle=("eng", False))
    embedded = run_job(svc, {"input": str(other), "options": library})
    assert embedded["skipped"]["reason"] == "subtitle_embedded" and embedded["language"] == "en"
    assert not list(media.glob("Other.*.srt"))


def jellyfin_template() -> str:
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("## Jellyfin: a job for each new film or episode", 1)[1]
    return section.split("```handlebars\n", 1)[1].split("```", 1)[0].strip()


def render_handlebars(template: str, data: dict[str, Any]) -> str:
    """The template rendered by Handlebars itself (handlebars.js, the reference implementation
    Jellyfin's Handlebars.Net follows), from tests/browser/node_modules."""
    node_modules = ROOT / "tests" / "browser" / "node_modules"
    need(shutil.which("node") is not None and (node_modules / "handlebars").is_dir(), "cd tests/browser && npm ci")
    script = (
        "const H = require('handlebars'); let s = ''; process.stdin.on('data', d => s += d);"
        "process.stdin.on('end', () => { const [t, d] = JSON.parse(s); process.stdout.write(H.compile(t)(d)); });"
    )
    out = subprocess.run(
        ["node", "-e", script],
        input=json.dumps([template, data]),
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "NODE_PATH": str(node_modules)},
        check=True,
    )
    return out.stdout


@pytest.mark.slow
def test_jellyfin_s_webhook_template_submits_the_film(
    service_factory: Any, mosquitto: Any, speech: Path, tmp_path: Path, model_installed: None
) -> None:
    """docs/operations.md's template, rendered by Handlebars with an Item Added data object as
    Jellyfin's Webhook plugin builds it, published as the plugin's MQTT destination does: the job
    is the film's, with the template's options, whatever the characters of its path."""
    media = tmp_path / "Films"
    folder = media / "Tom & Jerry's (1940) — été"
    folder.mkdir(parents=True)
    movie = film(folder / "Tom & Jerry's <1940>.mkv", speech_pcm(speech / "jfk.flac"), subtitle=None)
    data = {
        "ServerName": "jellyfin",
        "NotificationType": "ItemAdded",
        "Name": "Tom &amp; Jerry's",
        "ItemType": "Movie",
        "ItemId": "a5f3c1e2b4d6",
        "Path": str(movie),
        "Audio_0_Language": "ger",
        "Audio_1_Language": "eng",
    }
    payload = render_handlebars(jellyfin_template(), data)
    assert json.loads(payload)["input"] == str(movie)
    svc = service_factory(mosquitto, [media], {"EDGE_QUEUE_WORKERS": "1"}).start()
    with svc.watcher("response/#", "jobs/#") as w:
        resp = svc.request("submit", payload, w)
        assert resp["status"] == "ok", resp
        job_id = resp["data"]["jobs"][0]["job_id"]
        topic = f"{svc.base}/jobs/{job_id}"
        wait_until(lambda: (w.json_on(topic) or [{}])[-1].get("state") == "succeeded", 120, "the film's job")
        result = w.json_on(topic)[-1]["result"]
    assert result["outputs"]["srt"] == str(folder / "Tom & Jerry's <1940>.en.srt")
    assert wer(JFK, result["text"]) < 0.15  # the English track, by the template's audio_languages
