"""``transcode``: a browser-playable MP4 (H.264 + AAC, ``faststart``) with PyAV (libx264)."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from ..errors import ErrorCode, MediaError
from .base import JobContext, Kind, OutputOptions, check_free, output_stem, temp_path
from .media import container_duration_s, end_of_input, finish_output, open_media


class TranscodeOptions(OutputOptions):
    max_height: int | None = Field(None, ge=64, le=4320, description="scale down to at most this many lines")
    crf: int = Field(23, ge=0, le=51, description="x264 constant rate factor: lower is better and bigger")
    preset: Literal["ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow"] = (
        "veryfast"
    )
    audio_bit_rate: int = Field(128000, ge=32000, le=512000, description="AAC bits/s")


def _even(n: float) -> int:
    return max(2, int(round(n / 2)) * 2)


class Transcode(Kind):
    """Result: ``output``, ``duration_s``, ``width``, ``height``, ``video_codec`` (h264),
    ``audio_codec`` (aac or null), ``size_bytes``. Output ``<stem>.mp4`` (``<stem>.web.mp4``
    beside the input). Progress follows the timestamp of the decoded frames."""

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
        check_free([target], overwrite)
        tmp = temp_path(target)
        try:
            with open_media(input_path) as inp:
                v_in = inp.streams.video[0] if inp.streams.video else None
                a_in = inp.streams.audio[0] if inp.streams.audio else None
                if v_in is None and a_in is None:
                    raise MediaError("no video or audio stream", code=ErrorCode.UNSUPPORTED_MEDIA)
                declared = container_duration_s(inp)
                with av.open(str(tmp), "w", format="mp4", options={"movflags": "+faststart"}) as out:
                    width = height = None
                    if v_in is not None:
                        src_w, src_h = v_in.codec_context.width, v_in.codec_context.height
                        height = _even(min(src_h, options.max_height or src_h))
                        width = _even(src_w * height / src_h)
                        rate = v_in.average_rate or v_in.guessed_rate or Fraction(25)
                        vs = out.add_stream("libx264", rate=rate)
                        vs.width, vs.height, vs.pix_fmt = width, height, "yuv420p"
                        vs.options = {"crf": str(options.crf), "preset": options.preset}
                        v_tb = vs.codec_context.time_base or Fraction(1, int(rate))
                        last_pts = -1
                    if a_in is not None:
                        layout = "mono" if (a_in.channels or 2) == 1 else "stereo"
                        a_rate = a_in.rate or 48000
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
                            scaled = frame.reformat(width=width, height=height, format="yuv420p")
                            pts = int(round(float(frame.time or 0) / v_tb)) if frame.time is not None else last_pts + 1
                            scaled.pts, last_pts = max(pts, last_pts + 1), max(pts, last_pts + 1)
                            scaled.time_base = v_tb
                            out.mux(vs.encode(scaled))
                        else:
                            for af in resampler.resample(frame):
                                out.mux(aus.encode(af))
                    if v_in is not None:
                        out.mux(vs.encode(None))
                    if a_in is not None:
                        out.mux(aus.encode(None))
            duration = finish_output(tmp, target, overwrite=overwrite, decoded_s=last, declared_s=declared)
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
