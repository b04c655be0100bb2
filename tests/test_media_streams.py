"""Streams that are not the content (docs/topics.md, "Which streams a kind uses"): cover art in
mp3, m4a, flac and mkv, a picture track of one frame, timecode and KLV data tracks, a video
of one still frame, two audio tracks of which the second is the default, a commentary track
before the programme's. Every file is made here with PyAV from real speech, and each kind
(``probe``, ``extract_audio``, ``transcode``, ``transcribe``) runs on each in the real
service. Which audio a kind used is told by the sound itself: the first audio track of the
two-track files is silence."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .conftest import REFERENCE, SPEECH, ServiceProcess, Watcher, need, wer
from .helpers.docs_text import read, section
from .helpers.media_files import encode_video, h264, make_files

#: RMS of the decoded speech is about 0.1; silence is 0
SPEECH_RMS = 0.02


#: what each file's streams are, in order, as ``probe`` reports them: (role, default)
EXPECTED_ROLES: dict[str, list[tuple[str, bool]]] = {
    "cover.mp3": [("audio", False), ("cover", False)],
    "cover.m4a": [("audio", True), ("cover", False)],
    "cover.flac": [("audio", False), ("cover", False)],
    "cover.mkv": [("audio", False), ("cover", False)],
    "picture-track.mkv": [("audio", False), ("still", False)],
    "timecode.mp4": [("audio", True), ("video", True), ("data", False)],
    "klv.ts": [("audio", False), ("metadata", False)],
    "still.mp4": [("still", True), ("audio", True)],
    "two-audio.mkv": [("audio", False), ("audio", True)],
    "two-audio.mp4": [("audio", False), ("audio", True)],
    "commentary.mkv": [("audio", False), ("audio", False)],
}
#: the stream a player would play: (audio index, video index or None)
EXPECTED_PLAY: dict[str, tuple[int, int | None]] = {
    "timecode.mp4": (0, 1),
    "still.mp4": (1, None),
    "two-audio.mkv": (1, None),
    "two-audio.mp4": (1, None),
    "commentary.mkv": (1, None),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    need((SPEECH / "jfk.flac").is_file(), f"speech recordings not found in {SPEECH}")
    made = make_files(tmp_path_factory.mktemp("streams"))
    assert sorted(made) == sorted(EXPECTED_ROLES)
    return made


def run_all(
    svc: ServiceProcess, watcher: Watcher, kind: str, files: dict[str, Path], options: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Submit ``kind`` on every file, then wait for each: name -> final job."""
    ids = {}
    for name, path in files.items():
        resp = svc.request("submit", {"kind": kind, "input": str(path), "options": options}, watcher)
        assert resp["status"] == "ok", (name, resp)
        ids[name] = resp["data"]["jobs"][0]["job_id"]
    return {
        name: watcher.wait_json(
            f"{svc.base}/jobs/{job_id}", lambda m: m["state"] in ("succeeded", "failed"), timeout=180
        )
        for name, job_id in ids.items()
    }


def audio_rms(path: Path) -> float:
    """Root mean square of every decoded sample of the first audio stream of ``path``."""
    import av
    import numpy as np

    with av.open(str(path)) as c:
        resampler = av.AudioResampler(format="flt", layout="mono", rate=16000)
        parts = [f.to_ndarray().reshape(-1) for fr in c.decode(audio=0) for f in resampler.resample(fr)]
    samples = np.concatenate(parts)
    return float(np.sqrt(np.mean(np.square(samples))))


def check_each(files: dict[str, Path], finals: dict[str, dict[str, Any]], check: Callable[[str, Any], None]) -> None:
    """Run ``check(name, result)`` for every file; fail once, naming every file that failed."""
    failures = {}
    for name in files:
        final = finals[name]
        try:
            assert final["state"] == "succeeded", final.get("error")
            check(name, final["result"])
        except AssertionError as e:
            failures[name] = str(e).splitlines()[0][:300]
    assert not failures, "\n".join(f"{n}: {why}" for n, why in failures.items())


def test_probe_says_what_each_stream_is_and_which_a_kind_uses(mosquitto, service_factory, files) -> None:
    # Given the files, When each is probed by the service
    folder = next(iter(files.values())).parent
    svc = service_factory(mosquitto, [folder]).start()
    watcher = svc.watcher("response/#", "jobs/+")
    finals = run_all(svc, watcher, "probe", files, {})

    # Then each stream has its role and default flag, and the streams the kinds use are named
    def check(name: str, result: dict[str, Any]) -> None:
        got = [(s.get("role"), s.get("default")) for s in result["streams"]]
        assert got == EXPECTED_ROLES[name], f"roles {got}"
        audio, video = EXPECTED_PLAY.get(name, (0, None))
        assert (result.get("audio_stream"), result.get("video_stream")) == (audio, video), (
            f"audio_stream {result.get('audio_stream')}, video_stream {result.get('video_stream')}"
        )
        both = [i for i in (video, audio) if i is not None]
        assert result.get("uses") == {"transcribe": [audio], "extract_audio": [audio], "transcode": both}, (
            f"uses {result.get('uses')}"
        )
        for s in result["streams"]:
            assert isinstance(s.get("disposition"), list), f"disposition {s.get('disposition')}"
            assert ("default" in s["disposition"]) == s["default"], s
        covers = [s for s in result["streams"] if s["role"] == "cover"]
        assert all("attached_pic" in s["disposition"] for s in covers), covers

    check_each(files, finals, check)
    # and every field the results carry is documented in the kind's section
    probe_doc = section(read("topics.md"), re.compile(r"^### `probe`"))
    fields = {k for f in finals.values() for k in f["result"]}
    fields |= {k for f in finals.values() for s in f["result"]["streams"] for k in s}
    fields |= {s["role"] for f in finals.values() for s in f["result"]["streams"]}
    missing = sorted(k for k in fields if f"`{k}`" not in probe_doc)
    assert not missing, f"not in docs/topics.md, `probe`: {missing}"


def test_extract_audio_takes_the_audio_a_player_plays(mosquitto, service_factory, files) -> None:
    # Given the files, When the audio of each is extracted
    folder = next(iter(files.values())).parent
    svc = service_factory(mosquitto, [folder]).start()
    watcher = svc.watcher("response/#", "jobs/+")
    finals = run_all(svc, watcher, "extract_audio", files, {"format": "wav", "sample_rate": 16000})

    # Then each output is the 11 s of speech (never the silent first track of two)
    def check(name: str, result: dict[str, Any]) -> None:
        assert result["duration_s"] == pytest.approx(11.0, abs=0.3), result
        rms = audio_rms(Path(result["output"]))
        assert rms > SPEECH_RMS, f"the output is silent (RMS {rms:.4f}): the wrong audio track"

    check_each(files, finals, check)


def test_transcode_never_makes_a_video_of_a_picture(mosquitto, service_factory, files, tmp_path: Path) -> None:
    # Given the files, When each is transcoded
    folder = next(iter(files.values())).parent
    svc = service_factory(mosquitto, [folder, tmp_path]).start()
    watcher = svc.watcher("response/#", "jobs/+")
    finals = run_all(svc, watcher, "transcode", files, {})

    # Then a cover, a picture track or a still frame gives an MP4 of the sound only; a real
    # video stays a video; the audio is the played track's
    def check(name: str, result: dict[str, Any]) -> None:
        import av

        video = EXPECTED_PLAY.get(name, (0, None))[1] is not None
        assert (result["video_codec"] is not None) == video, f"video_codec {result['video_codec']}"
        assert result["audio_codec"] == "aac", result
        with av.open(result["output"]) as c:
            kinds = [s.type for s in c.streams]
        assert kinds == (["video", "audio"] if video else ["audio"]), f"output streams {kinds}"
        assert result["duration_s"] == pytest.approx(11.0, abs=0.3), result
        rms = audio_rms(Path(result["output"]))
        assert rms > SPEECH_RMS, f"the output is silent (RMS {rms:.4f}): the wrong audio track"

    check_each(files, finals, check)


@pytest.mark.usefixtures("model_installed")
@pytest.mark.slow
def test_transcribe_hears_the_audio_a_player_plays(mosquitto, service_factory, files) -> None:
    # Given the files, When each is transcribed
    folder = next(iter(files.values())).parent
    svc = service_factory(mosquitto, [folder]).start()
    watcher = svc.watcher("response/#", "jobs/+")
    finals = run_all(svc, watcher, "transcribe", files, {"formats": ["txt"], "language": "en"})

    # Then each transcript is JFK's sentence
    def check(name: str, result: dict[str, Any]) -> None:
        assert wer(REFERENCE["jfk.flac"], result["text"]) <= 0.2, f"transcript {result['text']!r}"

    check_each(files, finals, check)


def test_a_picture_alone_is_not_a_video(mosquitto, service_factory, tmp_path: Path) -> None:
    # Given an mp4 that holds one H.264 frame and nothing else (a photo saved as a video)
    import av

    media = tmp_path / "media"
    media.mkdir()
    photo = media / "photo.mp4"
    with av.open(str(photo), "w", format="mp4") as out:
        encode_video(out, h264(out), 1)
    svc = service_factory(mosquitto, [media]).start()
    watcher = svc.watcher("response/#", "jobs/+")
    finals = {
        kind: run_all(svc, watcher, kind, {"photo.mp4": photo}, {})["photo.mp4"] for kind in ("probe", "transcode")
    }
    # Then probe calls it a still that no kind reads, and transcode refuses it: no one-frame video
    probed = finals["probe"]
    assert probed["state"] == "succeeded", probed
    assert [s.get("role") for s in probed["result"]["streams"]] == ["still"], probed["result"]["streams"]
    assert probed["result"].get("video_stream", "missing") is None, probed["result"]
    assert probed["result"].get("uses") == {"transcribe": [], "extract_audio": [], "transcode": []}, probed["result"]
    made = finals["transcode"]
    assert made["state"] == "failed", made.get("result")
    assert made["error"]["code"] == "unsupported_media" and "still picture" in made["error"]["message"], made["error"]


def test_chunks_kept_from_another_audio_track_are_not_resumed(files, monkeypatch: pytest.MonkeyPatch) -> None:
    # A later attempt resumes kept chunks only when they were decoded from the same audio track:
    # kept chunks of the first (silent) track, from before the default track was chosen, are
    # not taken for the default track's transcript
    from edge_queue.config.settings import Settings
    from edge_queue.kinds import transcribe

    path, cfg = str(files["two-audio.mkv"]), Settings().transcribe
    chosen = transcribe.input_signature(path, cfg, "tiny.en", True)
    assert chosen == transcribe.input_signature(path, cfg, "tiny.en", True)
    monkeypatch.setattr(transcribe, "best_audio", lambda streams, languages=(): streams[0])  # the first track
    assert transcribe.input_signature(path, cfg, "tiny.en", True) != chosen
