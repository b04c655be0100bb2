"""``transcode``: a browser-playable MP4 (H.264 + AAC, ``faststart``) with PyAV (libx264)."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from edge_queue.errors import ErrorCode, MediaError

from .base import JobContext, Kind, OutputOptions, output_stem, temp_path
from .media import container_duration_s, encoder_errors, end_of_input, finish_output, open_media, pick_rate
from .outputs import check_free
from .streams import layout as stream_layout


class TranscodeOptions(OutputOptions):
    max_height: int | None = Field(None, ge=64, le=4320, description="scale down to at most this many lines")
    crf: int = Field(23, ge=0, le=51, description="x264 constant rate factor: lower is better and bigger")
    preset: Literal["ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow"] = (
        "veryfast"
    )
    audio_bit_rate: int = Field(128000, ge=32000, le=512000, description="AAC bits/s")


def _even(n: float) -> int:
    return max(2, int(round(n / 2)) * 2)


class _VideoClock:
    """Timestamps of the video frames on the input stream's own time base ``tb``.

    :meth:`stamp` gives each frame its decoded presentation time (no grid: a variable frame
    rate stays variable), strictly increasing by at least one tick of ``tb``; a frame without
    a timestamp follows the previous one by its duration (else by ``1 / rate``).
    :meth:`durations` gives the encoded packets the duration of the frame they carry, so the
    last frame lasts as long as in the input and the track ends where the input's ends.
    """

    def __init__(self, tb: Fraction, rate: Fraction) -> None:
        self.tb = tb
        self.step = max(1, round(1 / (rate * tb)))
        self.last: int | None = None
        self.last_duration = self.step
        self.length: dict[int, int] = {}

    def stamp(self, frame: Any) -> int:
        ftb = frame.time_base or self.tb
        pts = None if frame.pts is None else round(Fraction(frame.pts) * ftb / self.tb)
        if pts is None:
            pts = 0 if self.last is None else self.last + self.last_duration
        elif self.last is not None and pts <= self.last:
            pts = self.last + 1
        duration = round(Fraction(frame.duration) * ftb / self.tb) if frame.duration else 0
        self.last, self.last_duration = pts, duration if duration > 0 else self.step
        self.length[pts] = self.last_duration
        return pts

    def durations(self, packets: list[Any]) -> list[Any]:
        for packet in packets:
            if packet.pts is not None and packet.pts in self.length:
                packet.duration = self.length.pop(packet.pts)
        return packets


class Transcode(Kind):
    """Result: ``output``, ``duration_s``, ``width``, ``height``, ``video_codec`` (h264),
    ``audio_codec`` (aac or null), ``size_bytes``. Output ``<stem>.mp4`` (``<stem>.web.mp4``
    beside the input). Progress follows the timestamp of the decoded frames.

    The streams are those a player plays (:func:`~.streams.layout`): the default audio track,
    and a video that is not a picture. Cover art, thumbnails and a video track of one frame
    are left out, so an album track with its cover gives an MP4 of AAC audio only."""

    name = "transcode"
    Options = TranscodeOptions
    description = "browser-playable H.264/AAC MP4 with faststart"

    def run(self, ctx: JobContext, input_path: str | None, options: Any) -> dict[str, Any]:
        import av

        assert input_path is not None
        stem = output_stem(input_path, ".web.mp4")
        if options.output == "beside":
            target = Path(input_path).parent / f"{stem}.web.mp4"
        else:
            target = ctx.output_dir / f"{stem}.mp4"
        overwrite = options.overwrite or options.output == "data_dir"
        check_free(ctx, [target], overwrite)
        tmp = temp_path(target)
        with open_media(input_path) as first:  # reads packets: the decode opens the file anew
            seen = stream_layout(first)
        try:
            with open_media(input_path) as inp:
                v_in = None if seen.video is None else inp.streams[seen.video]
                a_in = None if seen.audio is None else inp.streams[seen.audio]
                if v_in is None and a_in is None:
                    pictures = any(r in ("cover", "thumbnail", "still") for r in seen.roles)
                    raise MediaError(
                        "no video or audio stream" + (" (a still picture is not a video)" if pictures else ""),
                        code=ErrorCode.UNSUPPORTED_MEDIA,
                    )
                declared = container_duration_s(inp)
                width = height = None
                settings = []
                if v_in is not None:
                    src_w, src_h = v_in.codec_context.width, v_in.codec_context.height
                    v_h = _even(min(src_h, options.max_height or src_h))
                    v_w = _even(src_w * v_h / src_h)
                    width, height = v_w, v_h
                    rate = v_in.average_rate or v_in.guessed_rate or Fraction(25)
                    # The encoder runs on the input's own clock, so every frame keeps its
                    # timestamp: a variable frame rate (phones) stays variable. ``rate`` is
                    # only x264's rate-control hint and the stream's declared average.
                    v_tb = v_in.time_base or Fraction(1, 90000)
                    clock = _VideoClock(v_tb, rate)
                    settings.append(f"H.264 (libx264) {v_w}x{v_h}, crf {options.crf}, preset {options.preset}")
                if a_in is not None:
                    layout = "mono" if (a_in.channels or 2) == 1 else "stereo"
                    a_rate = pick_rate("aac", a_in.rate)  # AAC takes 7350..96000 Hz, not any
                    settings.append(f"AAC {a_rate} Hz {layout}, {options.audio_bit_rate} bit/s")
                with (
                    encoder_errors(" with ".join(settings)),
                    av.open(str(tmp), "w", format="mp4", options={"movflags": "+faststart"}) as out,
                ):
                    if v_in is not None:
                        vs = out.add_stream("libx264", rate=rate, time_base=v_tb)
                        vs.width, vs.height, vs.pix_fmt = v_w, v_h, "yuv420p"
                        vs.options = {"crf": str(options.crf), "preset": options.preset}
                    if a_in is not None:
                        aus = out.add_stream("aac", rate=a_rate, layout=layout)
                        aus.bit_rate = options.audio_bit_rate
                        resampler = av.AudioResampler(format="fltp", layout=layout, rate=a_rate)
                    ctx.progress(0, "transcoding")
                    last = 0.0
                    streams = [s for s in (v_in, a_in) if s is not None]
                    for frame in end_of_input(inp.decode(*streams)):
                        ctx.checkpoint()
                        if frame is None:
                            if a_in is not None:
                                for af in resampler.resample(None):
                                    out.mux(aus.encode(af))
                            continue
                        if frame.time is not None:
                            last = max(last, float(frame.time))
                            if declared:
                                ctx.progress(100 * min(last / declared, 1.0), "transcoding")
                        if isinstance(frame, av.VideoFrame):
                            scaled = frame.reformat(width=v_w, height=v_h, format="yuv420p")
                            scaled.pts, scaled.time_base = clock.stamp(frame), v_tb
                            out.mux(clock.durations(vs.encode(scaled)))
                        else:
                            for af in resampler.resample(frame):
                                out.mux(aus.encode(af))
                    if v_in is not None:
                        out.mux(clock.durations(vs.encode(None)))
                    if a_in is not None:
                        out.mux(aus.encode(None))
            duration = finish_output(ctx, tmp, target, overwrite=overwrite, decoded_s=last, declared_s=declared)
        finally:
            tmp.unlink(missing_ok=True)
        return {
            "output": str(target),
            "duration_s": duration,
            "width": width,
            "height": height,
            "video_codec": "h264" if v_in is not None else None,
            "audio_codec": "aac" if a_in is not None else None,
            "size_bytes": target.stat().st_size,
        }
