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
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from .conftest import REFERENCE, SPEECH, ServiceProcess, Watcher, need, wer
from .test_docs import read, section

RATE = 44100
#: RMS of the decoded speech is about 0.1; silence is 0
SPEECH_RMS = 0.02


def _picture(codec: str, size: int = 64) -> bytes:
    """One encoded picture (``mjpeg`` or ``png``) of ``size`` x ``size`` pixels."""
    import av
    import numpy as np

    cc: Any = av.CodecContext.create(codec, "w")
    cc.width = cc.height = size
    cc.pix_fmt = "yuvj420p" if codec == "mjpeg" else "rgb24"
    cc.time_base = Fraction(1, 25)
    image = np.zeros((size, size, 3), dtype=np.uint8)
    image[:, :, 0] = 200
    frame = av.VideoFrame.from_ndarray(image, format="rgb24").reformat(format=cc.pix_fmt)
    return b"".join(bytes(p) for p in [*cc.encode(frame), *cc.encode(None)])


def _speech() -> Any:
    """JFK's 11 s as 44.1 kHz mono float32 samples."""
    import av
    import numpy as np

    with av.open(str(SPEECH / "jfk.flac")) as c:
        resampler = av.AudioResampler(format="flt", layout="mono", rate=RATE)
        parts = [f.to_ndarray().reshape(-1) for frame in c.decode(audio=0) for f in resampler.resample(frame)]
        parts += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
    return np.concatenate(parts)


def _encode_audio(out: Any, stream: Any, samples: Any) -> None:
    """Encode mono float samples into ``stream`` (any audio encoder) and flush it."""
    import av

    fmt = (stream.codec_context.codec.audio_formats or [av.AudioFormat("flt")])[0].name
    resampler = av.AudioResampler(format=fmt, layout="mono", rate=RATE)
    for k in range(0, len(samples), 1024):
        frame = av.AudioFrame.from_ndarray(samples[None, k : k + 1024], format="flt", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = RATE, k, Fraction(1, RATE)
        for f in resampler.resample(frame):
            out.mux(stream.encode(f))
    for f in resampler.resample(None):
        out.mux(stream.encode(f))
    out.mux(stream.encode(None))


def _cover_stream(out: Any, codec: str) -> Any:
    """A stream carrying one picture flagged as an attached picture (cover art), muxed."""
    import av

    stream = out.add_mux_stream(codec, width=64, height=64)
    stream.disposition = av.stream.Disposition.attached_pic
    packet = av.Packet(_picture(codec))
    packet.stream, packet.pts, packet.dts, packet.time_base = stream, 0, 0, Fraction(1, 90000)
    out.mux(packet)
    return stream


def _h264(out: Any, rate: int = 10, timecode: str | None = None) -> Any:
    """A new H.264 64x64 stream at ``rate`` fps (with a ``timecode``: a tmcd track beside it)."""
    vs = out.add_stream("libx264", rate=rate)
    vs.width, vs.height, vs.pix_fmt = 64, 64, "yuv420p"
    if timecode:
        vs.metadata["timecode"] = timecode
    return vs


def _encode_video(out: Any, vs: Any, frames: int) -> None:
    """Encode ``frames`` frames, each a new shade, into ``vs`` and flush it."""
    import av
    import numpy as np

    for i in range(frames):
        frame = av.VideoFrame.from_ndarray(np.full((64, 64, 3), (i * 9) % 255, dtype=np.uint8), format="rgb24")
        frame.pts = i
        out.mux(vs.encode(frame))
    out.mux(vs.encode(None))


def make_files(folder: Path) -> dict[str, Path]:
    """name -> file; each holds JFK's speech (11 s) and something that is not the content."""
    import av
    import numpy as np

    speech = _speech()
    made: dict[str, Path] = {}

    def audio_with_cover(name: str, fmt: str, codec: str, picture: str) -> None:
        path = folder / name
        with av.open(str(path), "w", format=fmt) as out:
            audio = out.add_stream(codec, rate=RATE, layout="mono")
            _cover_stream(out, picture)
            _encode_audio(out, audio, speech)
        made[name] = path

    audio_with_cover("cover.mp3", "mp3", "libmp3lame", "mjpeg")
    audio_with_cover("cover.m4a", "mp4", "aac", "mjpeg")
    audio_with_cover("cover.flac", "flac", "flac", "png")
    # Matroska keeps cover art as an attachment named cover.jpg (Matroska's cover-art rule)
    with av.open(str(folder / "cover.mkv"), "w", format="matroska") as out:
        audio = out.add_stream("flac", rate=RATE, layout="mono")
        out.add_attachment("cover.jpg", "image/jpeg", _picture("mjpeg"))
        _encode_audio(out, audio, speech)
    made["cover.mkv"] = folder / "cover.mkv"
    # a picture as a plain video track of one frame (no flag says it is a picture)
    with av.open(str(folder / "picture-track.mkv"), "w", format="matroska") as out:
        audio = out.add_stream("flac", rate=RATE, layout="mono")
        picture = out.add_mux_stream("mjpeg", width=64, height=64)
        packet = av.Packet(_picture("mjpeg"))
        packet.stream, packet.pts, packet.dts, packet.time_base = picture, 0, 0, Fraction(1, 1000)
        out.mux(packet)
        _encode_audio(out, audio, speech)
    made["picture-track.mkv"] = folder / "picture-track.mkv"
    # a camera's clip: video, audio and a timecode (tmcd) data track
    with av.open(str(folder / "timecode.mp4"), "w", format="mp4") as out:
        audio = out.add_stream("aac", rate=RATE, layout="mono")
        vs = _h264(out, timecode="10:00:00:00")
        _encode_video(out, vs, 110)
        _encode_audio(out, audio, speech)
    made["timecode.mp4"] = folder / "timecode.mp4"
    # MPEG-TS with a KLV (SMPTE 336M) timed metadata track, as drones record
    with av.open(str(folder / "klv.ts"), "w", format="mpegts") as out:
        audio = out.add_stream("aac", rate=RATE, layout="mono")
        klv = out.add_data_stream("klv")
        for i in range(11):
            packet = av.Packet(bytes(16) + b"\x05abcde")
            packet.stream, packet.pts, packet.dts, packet.time_base = klv, i * 90000, i * 90000, Fraction(1, 90000)
            out.mux(packet)
        _encode_audio(out, audio, speech)
    made["klv.ts"] = folder / "klv.ts"
    # a still picture with a recording (one H.264 frame, then 11 s of sound)
    with av.open(str(folder / "still.mp4"), "w", format="mp4") as out:
        vs = _h264(out)
        audio = out.add_stream("aac", rate=RATE, layout="mono")
        _encode_video(out, vs, 1)
        _encode_audio(out, audio, speech)
    made["still.mp4"] = folder / "still.mp4"
    # two audio tracks: the first silence, the second (the default one) speech
    for name, fmt, codec in (("two-audio.mkv", "matroska", "flac"), ("two-audio.mp4", "mp4", "aac")):
        with av.open(str(folder / name), "w", format=fmt) as out:
            quiet = out.add_stream(codec, rate=RATE, layout="mono")
            quiet.disposition = av.stream.Disposition(0)
            spoken = out.add_stream(codec, rate=RATE, layout="mono")
            spoken.disposition = av.stream.Disposition.default
            _encode_audio(out, quiet, np.zeros_like(speech))
            _encode_audio(out, spoken, speech)
        made[name] = folder / name
    # a commentary track first (silence here), then the programme, neither flagged default
    with av.open(str(folder / "commentary.mkv"), "w", format="matroska") as out:
        comment = out.add_stream("flac", rate=RATE, layout="mono")
        comment.disposition = av.stream.Disposition.comment
        programme = out.add_stream("flac", rate=RATE, layout="mono")
        programme.disposition = av.stream.Disposition(0)
        _encode_audio(out, comment, np.zeros_like(speech))
        _encode_audio(out, programme, speech)
    made["commentary.mkv"] = folder / "commentary.mkv"
    return made


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
        _encode_video(out, _h264(out), 1)
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
    from edge_queue.config import Settings
    from edge_queue.kinds import transcribe

    path, cfg = str(files["two-audio.mkv"]), Settings().transcribe
    chosen = transcribe.input_signature(path, cfg, "tiny.en", True)
    assert chosen == transcribe.input_signature(path, cfg, "tiny.en", True)
    monkeypatch.setattr(transcribe, "best_audio", lambda streams, languages=(): streams[0])  # the first track
    assert transcribe.input_signature(path, cfg, "tiny.en", True) != chosen
