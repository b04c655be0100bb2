"""Media files made with PyAV from real speech, with the streams that are not the content: cover
art, a picture track, timecode and data tracks, a still video, two audio tracks, commentary."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any

from ..conftest import SPEECH

RATE = 44100


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


def h264(out: Any, rate: int = 10, timecode: str | None = None) -> Any:
    """A new H.264 64x64 stream at ``rate`` fps (with a ``timecode``: a tmcd track beside it)."""
    vs = out.add_stream("libx264", rate=rate)
    vs.width, vs.height, vs.pix_fmt = 64, 64, "yuv420p"
    if timecode:
        vs.metadata["timecode"] = timecode
    return vs


def encode_video(out: Any, vs: Any, frames: int) -> None:
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
        vs = h264(out, timecode="10:00:00:00")
        encode_video(out, vs, 110)
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
        vs = h264(out)
        audio = out.add_stream("aac", rate=RATE, layout="mono")
        encode_video(out, vs, 1)
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
