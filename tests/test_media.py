"""Media work (docs/topics.md, "Job kinds"): bad media with exact codes, chunked transcription,
outputs beside the input, transcode and extract_audio read back, per-kind concurrency."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from edge_queue.config.settings import Settings

from .conftest import REFERENCE, SPEECH, need, wer, words, write_wav


def make_video(path: Path, seconds: int = 4, audio: bool = True, faststart: bool = False) -> Path:
    """An H.264 (+ AAC 440 Hz tone) MP4 made with PyAV; the index at the end unless faststart."""
    import av
    import numpy as np

    with av.open(str(path), "w", format="mp4", options={"movflags": "+faststart"} if faststart else {}) as out:
        vs = out.add_stream("libx264", rate=25)
        vs.width, vs.height, vs.pix_fmt = 320, 240, "yuv420p"
        aus = out.add_stream("aac", rate=48000, layout="stereo") if audio else None
        for i in range(seconds * 25):
            frame = av.VideoFrame.from_ndarray(np.full((240, 320, 3), (i * 5) % 255, dtype=np.uint8), format="rgb24")
            frame.pts = i
            out.mux(vs.encode(frame))
        out.mux(vs.encode(None))
        if aus is not None:
            t = np.arange(seconds * 48000) / 48000
            tone = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
            for k in range(0, len(tone), 1024):
                part = tone[k : k + 1024]
                af = av.AudioFrame.from_ndarray(np.stack([part, part]), format="fltp", layout="stereo")
                af.sample_rate, af.pts = 48000, k
                out.mux(aus.encode(af))
            out.mux(aus.encode(None))
    return path


@pytest.fixture
def corpus(tmp_path: Path, speech: Path) -> dict[str, tuple[Path, str, str | None]]:
    """name -> (file, expected final state, expected error code)."""
    import numpy as np

    d = tmp_path / "media"
    d.mkdir()
    made: dict[str, tuple[Path, str, str | None]] = {}
    made["video without audio"] = (make_video(d / "noaudio.mp4", audio=False), "failed", "no_audio_stream")
    fs = make_video(d / "fs-full.mp4", seconds=8, faststart=True).read_bytes()
    (d / "fs-half.mp4").write_bytes(fs[: len(fs) // 2])
    made["faststart mp4 cut in half"] = (d / "fs-half.mp4", "failed", "truncated_media")
    end = make_video(d / "end-full.mp4", seconds=8).read_bytes()
    (d / "end-half.mp4").write_bytes(end[: len(end) // 2])
    made["mp4 with the index at the end cut in half"] = (d / "end-half.mp4", "failed", "unsupported_media")
    flac = (speech / "jfk.flac").read_bytes()
    (d / "half.flac").write_bytes(flac[: len(flac) // 2])
    made["flac cut in half"] = (d / "half.flac", "failed", "truncated_media")
    wav = (speech / "librivox-0870.wav").read_bytes()
    (d / "cut.wav").write_bytes(wav[: len(wav) * 3 // 10])
    made["wav cut at 30 %"] = (d / "cut.wav", "failed", "truncated_media")
    silence = write_wav(d / "streamed.wav", np.zeros(3 * 16000)).read_bytes()
    (d / "streamed.wav").write_bytes(silence[:40] + b"\xff\xff\xff\xff" + silence[44:])  # data size unknown
    made["wav with an unknown data size"] = (d / "streamed.wav", "succeeded", None)
    (d / "empty.wav").write_bytes(b"")
    made["zero-length file"] = (d / "empty.wav", "failed", "unsupported_media")
    (d / "notes.mp3").write_text("this is a text file, not audio\n" * 40)
    made["text renamed .mp3"] = (d / "notes.mp3", "failed", "unsupported_media")
    made["30 s of silence"] = (write_wav(d / "silence.wav", np.zeros(30 * 16000)), "succeeded", None)
    return made


@pytest.mark.usefixtures("model_installed")
@pytest.mark.slow
def test_bad_media_gets_exact_codes_and_service_goes_on(mosquitto, service_factory, corpus, speech: Path) -> None:
    media = next(iter(corpus.values()))[0].parent
    svc = service_factory(mosquitto, [media, speech]).start()
    watcher = svc.watcher("response/#", "jobs/+")
    ids = {}
    for name, (path, _, _) in corpus.items():
        resp = svc.request("submit", {"input": str(path)}, watcher)
        assert resp["status"] == "ok", (name, resp)
        ids[name] = resp["data"]["jobs"][0]["job_id"]
    for name, (_path, state, code) in corpus.items():
        final = watcher.wait_json(
            f"{svc.base}/jobs/{ids[name]}", lambda m: m["state"] in ("succeeded", "failed"), timeout=120
        )
        assert final["state"] == state, (name, final)
        assert final["attempt"] == 1, (name, "not retried")
        if code:
            assert final["error"]["code"] == code and not final["error"]["retryable"], (name, final["error"])
            assert "Traceback" not in final["error"]["message"] and len(final["error"]["message"]) < 300
        else:  # silence: no hallucinated text with VAD on
            assert final["result"]["text"] == "" and final["result"]["segments"] == 0
    # and the service still transcribes real speech correctly
    job_id = svc.request("submit", {"input": str(speech / "jfk.flac")}, watcher)["data"]["jobs"][0]["job_id"]
    done = watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] == "succeeded", timeout=120)
    assert wer(REFERENCE["jfk.flac"], done["result"]["text"]) <= 0.1


class _Ctx:
    """The worker's job context, for running a kind in-process."""

    def __init__(self, settings: Settings, output_dir: Path) -> None:
        self.job_id, self.attempt, self.settings, self.output_dir = "t", 1, settings, output_dir
        self.reports: list[tuple[float, str | None]] = []
        self.kept: list[dict[str, Any]] = []
        self.chunks: list[tuple[int, dict[str, Any]]] = []
        self.written: dict[str, dict[str, Any]] = {}
        self.claimed: dict[str, dict[str, Any]] = {}

    def keep_chunk(self, index: int, data: dict[str, Any]) -> None:
        self.chunks.append((index, data))

    def claim_outputs(self, files: dict[str, dict[str, Any]]) -> None:
        self.claimed.update(files)

    def progress(self, percent: float, stage: str | None = None, eta_s: float | None = None) -> None:
        self.reports.append((percent, stage))

    def checkpoint(self) -> None:
        pass


@pytest.mark.usefixtures("model_installed")
@pytest.mark.slow
def test_chunked_and_unchunked_give_the_same_words(tmp_path: Path, speech: Path) -> None:
    import numpy as np
    from faster_whisper import decode_audio

    from edge_queue.kinds.transcribe import Transcribe

    clips = [name for name in REFERENCE if name.startswith("librivox")]
    audio = np.concatenate([decode_audio(str(speech / n)) for n in clips])
    src = write_wav(tmp_path / "librivox.wav", audio)
    results = {}
    for chunk_s in (8.0, 600.0):
        settings = Settings(data_dir=tmp_path / "d", transcribe={"chunk_s": chunk_s})
        ctx = _Ctx(settings, tmp_path / f"out{chunk_s}")
        results[chunk_s] = Transcribe().run(ctx, str(src), Transcribe.Options())
        percents = [p for p, stage in ctx.reports if stage == "transcribing"]
        assert percents == sorted(percents) and percents[-1] == pytest.approx(100, abs=1)
    chunked, whole = results[8.0], results[600.0]
    assert chunked["chunks"] >= 2 and whole["chunks"] == 1
    assert wer(whole["text"], chunked["text"]) <= 0.05, (whole["text"], chunked["text"])
    assert wer(" ".join(REFERENCE[n] for n in clips), chunked["text"]) <= 0.1
    segments = json.loads(Path(chunked["outputs"]["json"]).read_text())["segments"]
    starts = [s["start"] for s in segments]
    assert starts == sorted(starts) and all(s["end"] >= s["start"] for s in segments)
    assert segments[-1]["end"] == pytest.approx(len(audio) / 16000, abs=1.5)
    assert len(words(chunked["text"])) > 30


@pytest.mark.usefixtures("model_installed")
@pytest.mark.slow
def test_beside_output_and_output_exists(mosquitto, service_factory, tmp_path: Path, speech: Path) -> None:
    media = tmp_path / "library"
    media.mkdir()
    clip = media / "interview.flac"
    clip.write_bytes((speech / "jfk.flac").read_bytes())
    svc = service_factory(mosquitto, [media]).start()
    watcher = svc.watcher("response/#", "jobs/+")
    body = {"input": str(clip), "options": {"output": "beside", "formats": ["srt", "txt"], "language": "en"}}
    first = svc.request("submit", body, watcher)["data"]["jobs"][0]["job_id"]
    done = watcher.wait_json(f"{svc.base}/jobs/{first}", lambda m: m["state"] in ("succeeded", "failed"), timeout=120)
    assert done["state"] == "succeeded", done
    srt = media / "interview.en.srt"
    assert done["result"]["outputs"] == {"srt": str(srt), "txt": str(media / "interview.en.txt")}
    original = srt.read_bytes()
    assert b"-->" in original
    second = svc.request("submit", body, watcher)["data"]["jobs"][0]["job_id"]
    final = watcher.wait_json(f"{svc.base}/jobs/{second}", lambda m: m["state"] in ("succeeded", "failed"), timeout=120)
    assert final["state"] == "failed" and final["error"]["code"] == "output_exists" and final["attempt"] == 1
    assert srt.read_bytes() == original
    assert sorted(p.name for p in media.iterdir()) == ["interview.en.srt", "interview.en.txt", "interview.flac"]
    # with overwrite it is replaced
    body["options"]["overwrite"] = True
    third = svc.request("submit", body, watcher)["data"]["jobs"][0]["job_id"]
    watcher.wait_json(f"{svc.base}/jobs/{third}", lambda m: m["state"] == "succeeded", timeout=120)


def test_transcode_and_extract_audio_read_back(mosquitto, service_factory, tmp_path: Path, speech: Path) -> None:
    media = tmp_path / "videos"
    media.mkdir()
    video = make_video(media / "clip.mp4", seconds=4)
    svc = service_factory(mosquitto, [tmp_path, speech])
    # outputs are probed too: their folder is a media root
    (svc.data_dir / "outputs").mkdir(parents=True)
    svc.env["EDGE_QUEUE_MEDIA_ROOTS"] = json.dumps([str(tmp_path), str(speech), str(svc.data_dir / "outputs")])
    svc.start()
    watcher = svc.watcher("response/#", "jobs/+")

    def run(kind: str, path: Path, options: dict[str, Any]) -> dict[str, Any]:
        job_id = svc.request("submit", {"kind": kind, "input": str(path), "options": options}, watcher)["data"]["jobs"][
            0
        ]["job_id"]
        final = watcher.wait_json(
            f"{svc.base}/jobs/{job_id}", lambda m: m["state"] in ("succeeded", "failed"), timeout=120
        )
        assert final["state"] == "succeeded", final
        return final["result"]

    result = run("transcode", video, {"max_height": 120, "crf": 30})
    out = Path(result["output"])
    data = out.read_bytes()
    assert data.find(b"moov") < data.find(b"mdat"), "faststart: the index comes first"
    probed = run("probe", out, {})
    codecs = {s["type"]: s for s in probed["streams"]}
    assert codecs["video"]["codec"] == "h264" and codecs["audio"]["codec"] == "aac"
    assert codecs["video"]["height"] == 120 and codecs["video"]["width"] == 160
    assert probed["duration_s"] == pytest.approx(4.0, abs=0.2)
    for fmt, codec, rate in (
        ("wav", "pcm_s16le", 16000),
        ("flac", "flac", 44100),
        ("opus", "opus", 48000),
        ("mp3", "mp3", 44100),
    ):
        options: dict[str, Any] = {"format": fmt, "channels": 1}
        if fmt == "wav":
            options["sample_rate"] = 16000
        res = run("extract_audio", speech / "jfk.flac", options)
        back = run("probe", Path(res["output"]), {})
        stream = back["streams"][0]
        assert stream["codec"].startswith(codec) and stream["sample_rate"] == rate and stream["channels"] == 1
        assert back["duration_s"] == pytest.approx(11.0, abs=0.2)
    # bad options are refused at submit, naming the field
    resp = svc.request(
        "submit",
        {"kind": "extract_audio", "input": str(video), "options": {"format": "opus", "sample_rate": 44100}},
        watcher,
    )
    assert resp["error"]["code"] == "invalid_request" and resp["error"]["field"].startswith("options")


@pytest.mark.usefixtures("model_installed")
@pytest.mark.slow
def test_probe_runs_beside_a_long_transcription(mosquitto, service_factory, long_speech: Path, speech: Path) -> None:
    # no short lane: it would take the 11-s second transcription beside the long one, as it is
    # meant to (tests/test_short_lane.py); here the kind's max_concurrency is what is tested
    env = {"EDGE_QUEUE_TRANSCRIBE__BATCH_SIZE": "1", "EDGE_QUEUE_SHORT_LANE_S": "0"}
    svc = service_factory(mosquitto, [long_speech.parent, speech], env).start()
    watcher = svc.watcher("response/#", "jobs/+")
    long_id = svc.request("submit", {"input": str(long_speech)}, watcher)["data"]["jobs"][0]["job_id"]
    watcher.wait_json(f"{svc.base}/jobs/{long_id}", lambda m: m["stage"] == "transcribing", timeout=60)
    # a second transcription waits (max_concurrency 1), a probe does not
    second = svc.request("submit", {"input": str(speech / "jfk.flac")}, watcher)["data"]["jobs"][0]["job_id"]
    probe = svc.request("submit", {"kind": "probe", "input": str(speech / "jfk.flac")}, watcher)["data"]["jobs"][0][
        "job_id"
    ]
    watcher.wait_json(f"{svc.base}/jobs/{probe}", lambda m: m["state"] == "succeeded", timeout=30)
    assert watcher.json_on(f"{svc.base}/jobs/{long_id}")[-1]["state"] == "running"
    assert watcher.json_on(f"{svc.base}/jobs/{second}")[-1]["state"] == "queued"
    svc.request("cancel", {"all": True}, watcher)


def test_model_allow_list(mosquitto, service_factory, speech: Path) -> None:
    need(SPEECH.is_dir(), "speech")
    svc = service_factory(mosquitto, [speech]).start()
    watcher = svc.watcher("response/#")
    resp = svc.request("submit", {"input": str(speech / "jfk.flac"), "options": {"model": "large-v3"}}, watcher)
    assert resp["error"]["code"] == "invalid_request" and resp["error"]["field"] == "options.model"


@pytest.mark.slow
@pytest.mark.usefixtures("model_installed")
def test_chunking_keeps_every_word_of_a_longer_recording(tmp_path: Path, long_speech: Path) -> None:
    from edge_queue.kinds.transcribe import Transcribe

    texts = {}
    for chunk_s in (30.0, 600.0):
        settings = Settings(data_dir=tmp_path / "d", transcribe={"chunk_s": chunk_s})
        result = Transcribe().run(_Ctx(settings, tmp_path / f"o{chunk_s}"), str(long_speech), Transcribe.Options())
        texts[chunk_s] = result["text"]
        assert result["chunks"] == (4 if chunk_s == 30.0 else 1), result["chunks"]
    assert wer(texts[600.0], texts[30.0]) <= 0.05, texts
    assert wer(" ".join(list(REFERENCE.values()) * 4), texts[30.0]) <= 0.1
