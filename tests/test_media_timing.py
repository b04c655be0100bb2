"""Media timing and encoder limits, through the real service process.

``transcode`` keeps every frame's presentation time (variable frame rate, a video that starts
after its audio), so audio and video stay in sync; ``extract_audio`` refuses at submit the
options its encoder cannot do, and a refusal only the run can see fails once, not retried.
All media are made here with PyAV.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from .conftest import ServiceProcess, Watcher
from .helpers.figures import figures

FPS = 30
SECONDS = 11
AUDIO_RATE = 48000
#: one AAC frame: the finest an audio time can be compared at
AAC_FRAME_S = 1024 / AUDIO_RATE


def make_clip(
    path: Path, *, thin: tuple[float, float] | None = None, video_start: float = 0.0, audio_start: float = 0.0
) -> Path:
    """An MP4 of H.264 at 30 fps until 11 s and AAC 48 kHz stereo until 11 s.

    ``thin=(a, b)``: frames shown from ``a`` to ``b`` seconds are dropped except every tenth,
    the others keeping their real timestamps (a phone's variable frame rate). The video's
    first frame is at ``video_start`` s, the audio's first sample at ``audio_start`` s. The
    audio is silent except a 1 kHz beep of 0.2 s at every whole second, so its timing can be
    read back from the sound itself."""
    import av
    import numpy as np

    with av.open(str(path), "w", format="mp4") as out:
        vs = out.add_stream("libx264", rate=FPS)
        vs.width, vs.height, vs.pix_fmt = 160, 120, "yuv420p"
        aus = out.add_stream("aac", rate=AUDIO_RATE, layout="stereo")
        first = round(video_start * FPS)
        for i in range(first, SECONDS * FPS):
            if thin and thin[0] <= i / FPS < thin[1] and (i - first) % 10:
                continue
            picture = np.full((120, 160, 3), (i * 7) % 255, dtype=np.uint8)
            frame = av.VideoFrame.from_ndarray(picture, format="rgb24")
            frame.pts, frame.time_base = i, Fraction(1, FPS)
            out.mux(vs.encode(frame))
        out.mux(vs.encode(None))
        t = np.arange(round(audio_start * AUDIO_RATE), SECONDS * AUDIO_RATE) / AUDIO_RATE
        sound = np.where(t % 1.0 < 0.2, 0.5 * np.sin(2 * np.pi * 1000 * t), 0.0).astype(np.float32)
        start = round(audio_start * AUDIO_RATE)
        for k in range(0, len(sound), 1024):
            part = sound[k : k + 1024]
            af = av.AudioFrame.from_ndarray(np.stack([part, part]), format="fltp", layout="stereo")
            af.sample_rate, af.pts, af.time_base = AUDIO_RATE, start + k, Fraction(1, AUDIO_RATE)
            out.mux(aus.encode(af))
        out.mux(aus.encode(None))
    return path


def read_timing(path: Path) -> dict[str, Any]:
    """Decode with PyAV: ``video`` (each frame's time, s), ``video_end`` (last frame's time plus
    its duration), ``beeps`` (when each beep of the audio starts, s), ``audio_end`` (s)."""
    import av
    import numpy as np

    video: list[float] = []
    video_end = audio_end = 0.0
    loud: list[Any] = []  # times of the samples above -20 dBFS
    with av.open(str(path)) as c:
        for frame in c.decode(c.streams.video[0], c.streams.audio[0]):
            start = float(frame.time)
            if isinstance(frame, av.VideoFrame):
                video.append(start)
                video_end = start + float((frame.duration or 0) * frame.time_base)
                continue
            level = np.abs(frame.to_ndarray()).max(axis=0)
            loud.append(start + np.nonzero(level > 0.1)[0] / frame.sample_rate)
            audio_end = start + frame.samples / frame.sample_rate
    times = np.concatenate(loud)
    starts = times[np.concatenate([[True], np.diff(times) > 0.5])]  # after half a second of quiet
    return {"video": video, "video_end": video_end, "beeps": [float(t) for t in starts], "audio_end": audio_end}


def submit_and_wait(svc: ServiceProcess, watcher: Watcher, kind: str, path: Path, options: dict[str, Any]) -> Any:
    resp = svc.request("submit", {"kind": kind, "input": str(path), "options": options}, watcher)
    assert resp["status"] == "ok", resp
    job_id = resp["data"]["jobs"][0]["job_id"]
    return watcher.wait_json(
        f"{svc.base}/jobs/{job_id}", lambda m: m["state"] in ("succeeded", "failed", "cancelled"), timeout=180
    )


def test_transcode_keeps_every_frames_time_and_audio_video_sync(mosquitto, service_factory, tmp_path: Path) -> None:
    # Given clips at a constant frame rate, at a variable one (3-6 s thinned to every tenth
    # frame, as phones record), one whose video starts 1 s after its audio, and the reverse
    media = tmp_path / "media"
    media.mkdir()
    clips = {
        "constant": make_clip(media / "constant.mp4"),
        "variable": make_clip(media / "variable.mp4", thin=(3.0, 6.0)),
        "video late": make_clip(media / "video-late.mp4", video_start=1.0),
        "audio late": make_clip(media / "audio-late.mp4", audio_start=1.0),
    }
    svc = service_factory(mosquitto, [media], env={"EDGE_QUEUE_RETRY__BACKOFF_BASE_S": "0.1"}).start()
    watcher = svc.watcher("response/#", "jobs/+")
    # When each is transcoded by the service
    measured: dict[str, dict[str, Any]] = {}
    for name, clip in clips.items():
        final = submit_and_wait(svc, watcher, "transcode", clip, {})
        assert final["state"] == "succeeded", (name, final)
        src, out = read_timing(clip), read_timing(Path(final["result"]["output"]))
        audio_shift = [b - a for a, b in zip(src["beeps"], out["beeps"], strict=False)]
        shift = sum(audio_shift) / max(len(audio_shift), 1)
        video_shift = [b - a for a, b in zip(src["video"], out["video"], strict=False)]
        ends = (out["video_end"] - out["audio_end"]) - (src["video_end"] - src["audio_end"])
        measured[name] = {
            "src": src,
            "out": out,
            "audio_shift": audio_shift,
            "video_shift": video_shift,
            # how far the picture moved against the sound: at any frame, and at the end
            "av_offset_s": max([abs(v - shift) for v in video_shift] + [abs(ends)]),
        }
    figures(
        transcode_av_offset_s={name: round(m["av_offset_s"], 4) for name, m in measured.items()},
        largest_av_offset_s=round(max(m["av_offset_s"] for m in measured.values()), 4),
        video_s={
            name: [round(m["src"]["video_end"], 3), round(m["out"]["video_end"], 3)] for name, m in measured.items()
        },
        audio_s={
            name: [round(m["src"]["audio_end"], 3), round(m["out"]["audio_end"], 3)] for name, m in measured.items()
        },
    )
    # Then every frame is there, each within one frame (1/30 s) of its input time; every beep
    # within one AAC frame of its input time; and audio and video end as they do in the input
    for name, m in measured.items():
        src, out = m["src"], m["out"]
        assert len(out["video"]) == len(src["video"]), (name, len(src["video"]), len(out["video"]))
        assert len(out["beeps"]) == len(src["beeps"]) == SECONDS - (name == "audio late"), (name, out["beeps"])
        worst = max(range(len(src["video"])), key=lambda i: abs(m["video_shift"][i]))
        assert abs(m["video_shift"][worst]) <= 1 / FPS, (name, "frame", worst, src["video"][worst], out["video"][worst])
        assert max(map(abs, m["audio_shift"])) <= AAC_FRAME_S, (name, src["beeps"], out["beeps"])
        assert out["video"][0] == pytest.approx(src["video"][0], abs=1 / FPS), name
        assert abs(out["video_end"] - src["video_end"]) <= 1 / FPS, (name, src["video_end"], out["video_end"])
        assert abs(out["audio_end"] - src["audio_end"]) <= AAC_FRAME_S, (name, src["audio_end"], out["audio_end"])
        assert m["av_offset_s"] <= 1 / FPS, (name, m["av_offset_s"])


def make_audio(path: Path, rate: int, channels: int = 1, seconds: float = 3.0) -> Path:
    """A FLAC of ``seconds`` of a 440 Hz tone at ``rate`` Hz, made with PyAV."""
    import av
    import numpy as np

    layout = "mono" if channels == 1 else "stereo"
    with av.open(str(path), "w", format="flac") as out:
        st = out.add_stream("flac", rate=rate, layout=layout)
        t = np.arange(int(seconds * rate)) / rate
        tone = (0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype(np.int16)
        for k in range(0, len(tone), 4096):
            part = np.repeat(tone[k : k + 4096], channels).reshape(1, -1)
            af = av.AudioFrame.from_ndarray(part, format="s16", layout=layout)
            af.sample_rate, af.pts, af.time_base = rate, k, Fraction(1, rate)
            out.mux(st.encode(af))
        out.mux(st.encode(None))
    return path


def encoder_rates(codec: str) -> list[int] | None:
    """What PyAV says the encoder takes; ``None``: any rate."""
    import av

    rates = av.Codec(codec, "w").audio_rates
    return sorted(rates) if rates else None


def assert_failed_once_plainly(svc: ServiceProcess, watcher: Watcher, final: dict[str, Any], code: str) -> None:
    assert final["state"] == "failed", final
    assert final["attempt"] == 1 and final["error"]["code"] == code and not final["error"]["retryable"], final
    states = [e["state"] for e in watcher.job_events(svc.base, final["job_id"])]
    assert "retrying" not in states, states
    message = final["error"]["message"]
    for internal in ("avcodec", "returned 22", "Traceback", "Error:"):
        assert internal not in message, message


def test_extract_audio_refuses_what_its_encoder_cannot_do(mosquitto, service_factory, tmp_path: Path) -> None:
    from edge_queue.kinds.extract_audio import FORMATS

    media = tmp_path / "media"
    media.mkdir()
    mono = make_audio(media / "mono-16k.flac", 16000)
    hi_res = make_audio(media / "stereo-192k.flac", 192000, channels=2)
    odd = make_audio(media / "mono-9k.flac", 9000)
    svc = service_factory(mosquitto, [media], env={"EDGE_QUEUE_RETRY__BACKOFF_BASE_S": "0.1"}).start()
    watcher = svc.watcher("response/#", "jobs/+", "events")

    # Given every format, and rates its encoder cannot do (PyAV lists what it can)
    refused = 0
    for fmt, (_, codec, _) in FORMATS.items():
        rates = encoder_rates(codec)
        if rates is None:
            # a format that takes any rate takes the schema's odd and extreme ones, and makes them
            for rate in (9000, 192000):
                final = submit_and_wait(svc, watcher, "extract_audio", mono, {"format": fmt, "sample_rate": rate})
                assert final["state"] == "succeeded" and final["result"]["sample_rate"] == rate, (fmt, final)
            continue
        for rate in sorted({9000, 44100, 96000, 192000} - set(rates)):
            # When one is asked for
            body = {"kind": "extract_audio", "input": str(mono), "options": {"format": fmt, "sample_rate": rate}}
            resp = svc.request("submit", body, watcher)
            # Then the submit is refused, naming the field and every rate allowed
            assert resp["status"] == "error", (fmt, rate, resp)
            error = resp["error"]
            assert error["code"] == "invalid_request" and error["field"] == "options.sample_rate", (fmt, rate, error)
            assert all(str(r) in error["message"] for r in rates) and str(rate) in error["message"], error
            refused += 1
    assert refused >= 6
    # An opus bit rate above 256 kbit/s per channel, with mono asked for, is refused at submit
    body = {
        "kind": "extract_audio",
        "input": str(mono),
        "options": {"format": "opus", "channels": 1, "bit_rate": 300000},
    }
    resp = svc.request("submit", body, watcher)
    assert resp["error"]["code"] == "invalid_request" and resp["error"]["field"] == "options.bit_rate", resp
    assert "256000" in resp["error"]["message"]

    # Given the same bit rate without channels: only the source (mono) tells it cannot be done
    final = submit_and_wait(svc, watcher, "extract_audio", mono, {"format": "opus", "bit_rate": 300000})
    # Then the job fails once, not retried, with a plain message naming the limit
    assert_failed_once_plainly(svc, watcher, final, "invalid_request")
    assert "256000" in final["error"]["message"] and "bit_rate" in final["error"]["message"]

    # Source rates the encoder cannot take, with no rate asked for, become the nearest it takes
    final = submit_and_wait(svc, watcher, "extract_audio", hi_res, {"format": "mp3"})
    assert final["state"] == "succeeded" and final["attempt"] == 1, final
    assert final["result"]["sample_rate"] == 48000 and final["result"]["channels"] == 2
    final = submit_and_wait(svc, watcher, "extract_audio", odd, {"format": "opus"})
    assert final["state"] == "succeeded" and final["result"]["sample_rate"] == 12000, final
    final = submit_and_wait(svc, watcher, "transcode", odd, {})
    assert final["state"] == "succeeded" and final["attempt"] == 1, final
    import av

    with av.open(final["result"]["output"]) as c:
        assert c.streams.audio[0].codec_context.sample_rate == 11025
    final = submit_and_wait(svc, watcher, "transcode", hi_res, {})
    assert final["state"] == "succeeded" and final["attempt"] == 1, final
    with av.open(final["result"]["output"]) as c:
        assert c.streams.audio[0].codec_context.sample_rate == 96000


class _Ctx:
    def __init__(self, output_dir: Path) -> None:
        from edge_queue.config.settings import Settings

        self.job_id, self.attempt, self.output_dir = "t", 1, output_dir
        self.settings = Settings(data_dir=output_dir / "data")

    def progress(self, percent: float, stage: str | None = None, eta_s: float | None = None) -> None:
        pass

    def checkpoint(self) -> None:
        pass


@pytest.mark.parametrize("rate", [9000, 96000])
def test_an_encoder_refusal_past_the_submit_check_is_not_retryable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rate: int
) -> None:
    from edge_queue.errors import JobError
    from edge_queue.kinds import extract_audio

    mono = make_audio(tmp_path / "mono.flac", 16000)
    options = extract_audio.ExtractAudioOptions(format="mp3", sample_rate=rate)  # past check_options
    # When the kind is run with it, it checks again before encoding
    with pytest.raises(JobError) as caught:
        extract_audio.ExtractAudio().run(_Ctx(tmp_path / "a"), str(mono), options)
    assert caught.value.code == "invalid_request" and not caught.value.retryable
    assert "options.sample_rate" in caught.value.message and "44100" in caught.value.message
    # And when that check is blinded too, the encoder's own refusal is not retryable either
    monkeypatch.setattr(extract_audio, "settings_problem", lambda *a: ("", ""))
    with pytest.raises(JobError) as caught:
        extract_audio.ExtractAudio().run(_Ctx(tmp_path / "b"), str(mono), options)
    assert caught.value.code == "invalid_request" and not caught.value.retryable, caught.value
    assert f"{rate} Hz" in caught.value.message and "avcodec" not in caught.value.message
    assert not list((tmp_path / "b").glob(".*.part")), "the temporary output is removed"
