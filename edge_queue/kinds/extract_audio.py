"""``extract_audio``: decode the audio a player plays (the default track) to wav, flac, opus or mp3 with PyAV."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from edge_queue.errors import ErrorCode, JobError, RequestError

from .base import JobContext, Kind, OutputOptions, output_stem, temp_path
from .media import (
    container_duration_s,
    encoder_errors,
    encoder_rates,
    end_of_input,
    finish_output,
    open_media,
    pick_rate,
    require_audio,
)
from .outputs import check_free

if TYPE_CHECKING:
    from edge_queue.config.settings import Settings

#: format -> (container format, encoder, file extension)
FORMATS: dict[str, tuple[str, str, str]] = {
    "wav": ("wav", "pcm_s16le", "wav"),
    "flac": ("flac", "flac", "flac"),
    "opus": ("ogg", "libopus", "opus"),
    "mp3": ("mp3", "libmp3lame", "mp3"),
}
#: Highest Opus bit rate per channel, bits/s: FFmpeg's libopus wrapper refuses more
#: (``libavcodec/libopusenc.c``: 500 to 256000 per channel). PyAV does not report it.
OPUS_MAX_BIT_RATE_PER_CHANNEL = 256000


class ExtractAudioOptions(OutputOptions):
    format: Literal["wav", "flac", "opus", "mp3"] = "wav"
    sample_rate: int | None = Field(
        None,
        ge=8000,
        le=192000,
        description="Hz; opus and mp3 take only some rates (a submit with another is refused, naming "
        "them); default: the source's, or the next rate above it the format takes",
    )
    channels: Literal[1, 2] | None = Field(None, description="default: the source's, at most 2")
    bit_rate: int | None = Field(
        None, ge=8000, le=512000, description="bits/s for opus (at most 256000 per channel) and mp3"
    )


def _describe(fmt: str, rate: int, channels: int | None, bit_rate: int | None) -> str:
    parts = [f"{fmt} ({FORMATS[fmt][1]}) at {rate} Hz"]
    if channels:
        parts.append(f"{channels} channel{'s' if channels > 1 else ''}")
    if bit_rate and fmt in ("opus", "mp3"):
        parts.append(f"{bit_rate} bit/s")
    return ", ".join(parts)


def settings_problem(fmt: str, sample_rate: int | None, channels: int | None, bit_rate: int | None) -> tuple[str, str]:
    """What the encoder of ``fmt`` cannot do with these settings: ``(option name, sentence)``,
    or ``("", "")`` when it can. ``sample_rate`` in Hz and ``bit_rate`` in bits/s (``None``:
    not given); ``channels`` 1 or 2, ``None`` when not known yet (the source's). The rates come
    from PyAV (:func:`~.media.encoder_rates`), the Opus bit-rate limit from FFmpeg's source."""
    codec = FORMATS[fmt][1]
    if sample_rate is not None:
        rates = encoder_rates(codec)
        if rates is not None and sample_rate not in rates:
            allowed = ", ".join(map(str, rates))
            return "sample_rate", f"{fmt} ({codec}) takes sample_rate {allowed} Hz, not {sample_rate}"
    if fmt == "opus" and bit_rate is not None and channels is not None:
        most = OPUS_MAX_BIT_RATE_PER_CHANNEL * channels
        if bit_rate > most:
            return "bit_rate", (
                f"opus (libopus) takes at most {OPUS_MAX_BIT_RATE_PER_CHANNEL} bit/s per channel, "
                f"{most} for {channels} channel{'s' if channels > 1 else ''}; not bit_rate {bit_rate}"
            )
    return "", ""


class ExtractAudio(Kind):
    """Result: ``output`` (path), ``format``, ``codec``, ``sample_rate`` (Hz), ``channels``,
    ``duration_s``, ``size_bytes``. Output: ``<stem>.<ext>`` in the job's output folder, or
    beside the input with ``output: "beside"``.

    Settings the format's encoder cannot take are refused at submit (:meth:`check_options`,
    ``invalid_request`` naming ``options.<name>`` and what is allowed); those only the source
    reveals (an opus ``bit_rate`` above 256000 for a mono source without ``channels``) fail
    the job once with ``invalid_request``, not retried. Without ``sample_rate`` the source's
    rate is kept when the encoder takes it, else the nearest above it (else the highest)."""

    name = "extract_audio"
    Options = ExtractAudioOptions
    description = "decode the audio track to wav/flac/opus/mp3"

    @classmethod
    def check_options(cls, options: Any, settings: Settings) -> None:
        """Raise :class:`~edge_queue.errors.RequestError` ``invalid_request`` with field
        ``options.sample_rate`` or ``options.bit_rate`` for a setting the encoder refuses."""
        name, why = settings_problem(options.format, options.sample_rate, options.channels, options.bit_rate)
        if name:
            raise RequestError(f"options.{name}: {why}", field=f"options.{name}")

    def run(self, ctx: JobContext, input_path: str | None, options: Any) -> dict[str, Any]:
        import av

        assert input_path is not None
        container_fmt, codec, ext = FORMATS[options.format]
        folder = Path(input_path).parent if options.output == "beside" else ctx.output_dir
        target = folder / f"{output_stem(input_path, f'.{ext}')}.{ext}"
        overwrite = options.overwrite or options.output == "data_dir"
        if target.resolve() == Path(input_path).resolve():
            overwrite = False  # never replace the input itself
        check_free(ctx, [target], overwrite)
        tmp = temp_path(target)
        try:
            with open_media(input_path) as inp:
                a_in = require_audio(inp)
                declared = container_duration_s(inp)
                rate = options.sample_rate or pick_rate(codec, a_in.rate)
                channels = options.channels or min(a_in.channels or 2, 2)
                bit_rate = options.bit_rate if options.format in ("opus", "mp3") else None
                # again here, with what the source tells: a job may come past the submit's check
                name, why = settings_problem(options.format, rate, channels, bit_rate)
                if name:
                    if name == "bit_rate" and options.channels is None:
                        why += " (the source is mono: give channels 2, or a lower bit_rate)"
                    raise JobError(f"options.{name}: {why}", code=ErrorCode.INVALID_REQUEST)
                layout = "mono" if channels == 1 else "stereo"
                with (
                    encoder_errors(_describe(options.format, rate, channels, bit_rate)),
                    av.open(str(tmp), "w", format=container_fmt) as out,
                ):
                    stream: Any = out.add_stream(codec, rate=rate, layout=layout)
                    if bit_rate:
                        stream.bit_rate = bit_rate
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
            duration = finish_output(ctx, tmp, target, overwrite=overwrite, decoded_s=last, declared_s=declared)
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
