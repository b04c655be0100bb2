"""``extract_audio``: decode the first audio stream to wav, flac, opus or mp3 with PyAV."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from .base import JobContext, Kind, OutputOptions, check_free, output_stem, temp_path
from .media import container_duration_s, end_of_input, finish_output, open_media, require_audio

#: format -> (container format, encoder, file extension)
FORMATS: dict[str, tuple[str, str, str]] = {
    "wav": ("wav", "pcm_s16le", "wav"),
    "flac": ("flac", "flac", "flac"),
    "opus": ("ogg", "libopus", "opus"),
    "mp3": ("mp3", "libmp3lame", "mp3"),
}
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)


class ExtractAudioOptions(OutputOptions):
    format: Literal["wav", "flac", "opus", "mp3"] = "wav"
    sample_rate: int | None = Field(None, ge=8000, le=192000, description="Hz; default: the source's")
    channels: Literal[1, 2] | None = Field(None, description="default: the source's, at most 2")
    bit_rate: int | None = Field(None, ge=8000, le=512000, description="bits/s for opus and mp3")

    @model_validator(mode="after")
    def _opus_rate(self) -> ExtractAudioOptions:
        if self.format == "opus" and self.sample_rate is not None and self.sample_rate not in OPUS_RATES:
            raise ValueError(f"opus supports sample_rate {', '.join(map(str, OPUS_RATES))}")
        return self


class ExtractAudio(Kind):
    """Result: ``output`` (path), ``format``, ``codec``, ``sample_rate``, ``channels``,
    ``duration_s``, ``size_bytes``. Output: ``<stem>.<ext>`` in the job's output folder, or
    beside the input with ``output: "beside"``."""

    name = "extract_audio"
    Options = ExtractAudioOptions
    description = "decode the audio track to wav/flac/opus/mp3"

    def run(self, ctx: JobContext, input_path: str | None, options: Any) -> dict[str, Any]:
        import av

        assert input_path is not None
        container_fmt, codec, ext = FORMATS[options.format]
        folder = Path(input_path).parent if options.output == "beside" else ctx.output_dir
        target = folder / f"{output_stem(input_path, f'.{ext}')}.{ext}"
        overwrite = options.overwrite or options.output == "data_dir"
        if target.resolve() == Path(input_path).resolve():
            overwrite = False  # never replace the input itself
        check_free([target], overwrite)
        tmp = temp_path(target)
        try:
            with open_media(input_path) as inp:
                a_in = require_audio(inp)
                declared = container_duration_s(inp)
                rate = options.sample_rate or a_in.rate or 48000
                if options.format == "opus" and rate not in OPUS_RATES:
                    rate = 48000
                channels = options.channels or min(a_in.channels or 2, 2)
                layout = "mono" if channels == 1 else "stereo"
                with av.open(str(tmp), "w", format=container_fmt) as out:
                    stream: Any = out.add_stream(codec, rate=rate, layout=layout)
                    if options.bit_rate and options.format in ("opus", "mp3"):
                        stream.bit_rate = options.bit_rate
                    fmt = (av.Codec(codec, "w").audio_formats or [av.AudioFormat("s16")])[0].name
                    resampler = av.AudioResampler(format=fmt, layout=layout, rate=rate)
                    ctx.progress(0, "extracting")
                    last = 0.0
                    for frame in end_of_input(inp.decode(a_in)):
                        ctx.checkpoint()
                        if frame is not None and frame.time is not None:
                            last = max(last, float(frame.time))
                            if declared:
                                ctx.progress(100 * min(last / declared, 1.0), "extracting")
                        for out_frame in resampler.resample(frame):
                            out.mux(stream.encode(out_frame))
                    out.mux(stream.encode(None))
            duration = finish_output(tmp, target, overwrite=overwrite, decoded_s=last, declared_s=declared)
        finally:
            tmp.unlink(missing_ok=True)
        return {
            "output": str(target),
            "format": options.format,
            "codec": codec,
            "sample_rate": rate,
            "channels": channels,
            "duration_s": duration,
            "size_bytes": target.stat().st_size,
        }
