"""The HTTP API (docs/http-api.md): whisper-asr-webservice's routes, as Bazarr's Whisper
provider calls them, and OpenAI's audio routes, as the ``openai`` package calls them, each call
a ``transcribe`` job of the queue.

One call: the caller is known from its key (:mod:`.callers`), counted against its rate, given
one of ``api.uploads_at_once`` upload slots; its body is streamed to ``<data_dir>/uploads``
(:mod:`.receiving`, :mod:`.uploads`); the job is submitted through the loop
(:class:`JobGateway`), with an idempotency key made of the audio's SHA-256 and the options, so
the same audio sent again is answered from the same job; the answer waits for the job to end
(or for the caller to go away: the job goes on) and is read from the job's own output files
(:mod:`.transcripts`).

A Starlette application, served by uvicorn (:mod:`.api_server`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import anyio
import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edge_queue.config.settings import Settings
from edge_queue.errors import EdgeQueueError, ErrorCode, RequestError
from edge_queue.rules.rates import MAX_TRACKED_CALLERS, CallRate, RejectionLog
from edge_queue.written import NotTheFileWritten, read_written

from . import transcripts
from .callers import Caller, caller_of, count_call, presented_key
from .openai_form import REFUSED_FIELDS, model_names, read_call
from .receiving import UploadReceiver
from .shares import Shares
from .statuses import RETRY_AFTER_S, code_of, error_response, status_of, stopping
from .uploads import PCM_RATE, PCM_WIDTH, Upload
from .values import flag, speaker_bounds

log = logging.getLogger(__name__)
#: Refused calls, one INFO line each, at most 20 in 10 s (a client can repeat them without end).
refusals = RejectionLog("refused HTTP call(s)", logging.INFO, log)

#: Seconds of a raw PCM upload kept by ``/detect-language`` (Whisper detects on the first 30).
DETECT_S = 30
#: An output file is read up to this many bytes (a ``json`` of a 10-hour recording is ~20 MB).
MAX_OUTPUT_BYTES = 256 * 2**20
#: Codes of a job's error that say the file sent is not usable audio (never run again).
MEDIA_ERRORS = frozenset(
    {ErrorCode.UNSUPPORTED_MEDIA, ErrorCode.NO_AUDIO_STREAM, ErrorCode.TRUNCATED_MEDIA, ErrorCode.DECODE_ERROR}
)
#: A language the model does not speak or could not tell (docs/http-api.md, "Languages"): 422,
#: as a refused submit and as a failed job; the same audio sent again is not run again.
LANGUAGE_ERRORS = frozenset({ErrorCode.LANGUAGE_UNSUPPORTED, ErrorCode.LANGUAGE_UNCERTAIN})


@dataclass(slots=True)
class Ended:
    """A job that ended: its job object (docs/topics.md, "The job object") and the identities of
    the output files the service recorded writing (path -> ``{"size", "sha256"}``)."""

    job: dict[str, Any]
    recorded: dict[str, dict[str, Any]]


class JobGateway(Protocol):
    """The loop's side (:class:`~edge_queue.requests.http_intake.HttpIntake`): a typed submit of
    an upload's job, or a retry of a job, and the response and the job's end as futures."""

    def submit_and_wait(
        self, input: Path, options: dict[str, Any], idempotency_key: str, user: str | None
    ) -> tuple[Future[dict[str, Any]], Future[Ended]]: ...

    def retry_and_wait(self, job_id: str, user: str | None) -> tuple[Future[dict[str, Any]], Future[Ended]]: ...


class Api:
    """The routes, over ``settings`` and the loop's ``gateway``."""

    def __init__(self, settings: Settings, gateway: JobGateway, version: str) -> None:
        self.settings, self.api, self.gateway, self.version = settings, settings.api, gateway, version
        self.uploads = settings.uploads_dir
        self.outputs = str(settings.outputs_dir)
        self.rate = CallRate(self.api.calls_per_minute)
        self.shares = Shares(self.api.uploads_at_once)  # upload slots and waits (the event loop's thread)
        self.placeholders: OrderedDict[str, None] = OrderedDict()  # addresses sending unknown keys
        #: when a stop began (``ApiServer.begin_stop``): the calls still being received are answered
        #: 503 ``stopping`` by then (monotonic seconds), before the server's own grace ends them
        self.stop_receiving_at: float | None = None
        self.receiver = UploadReceiver(settings, self.shares, lambda: self.stop_receiving_at)

    def app(self) -> Starlette:
        """The Starlette application."""
        routes = [
            Route("/asr", self.asr, methods=["POST"]),
            Route("/detect-language", self.detect_language, methods=["POST"]),
            Route("/v1/audio/transcriptions", self.openai_transcriptions, methods=["POST"]),
            Route("/v1/audio/translations", self.openai_translations, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
            Route("/api/system/status", self.status, methods=["GET"]),
        ]
        return Starlette(routes=routes, exception_handlers={HTTPException: _http_error})  # type: ignore[dict-item]

    # -- routes -------------------------------------------------------------------------

    async def status(self, request: Request) -> Response:
        """``GET /api/system/status``: ``{"status": "ok", "version"}`` (Bazarr's "Test")."""
        return await self._guarded(request, lambda caller: self._status())

    async def _status(self) -> Response:
        return JSONResponse({"status": "ok", "service": "edge-queue", "version": self.version})

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``: ``whisper-1`` (the configured model), ``gpt-4o-transcribe-diarize``
        (the same with ``diarize``) and each of ``transcribe.models``."""
        data = [_model_object(n) for n in model_names(self.settings.transcribe.models)]
        return await self._guarded(request, lambda caller: _json({"object": "list", "data": data}))

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{id}``: the model ``id`` of ``GET /v1/models``, or 404 ``model_not_found``."""
        return await self._guarded(request, lambda caller: self._model(request.path_params["model_id"]))

    async def _model(self, name: str) -> Response:
        if name not in model_names(self.settings.transcribe.models):
            raise RequestError(
                f"no model {name[:100]!r}; GET /v1/models lists them", code=ErrorCode.MODEL_NOT_FOUND, field="model"
            )
        return JSONResponse(_model_object(name))

    async def asr(self, request: Request) -> Response:
        """``POST /asr``: whisper-asr-webservice's transcription (query parameters ``task``,
        ``language``, ``initial_prompt``, ``vad_filter``, ``word_timestamps``, ``output``,
        ``encode``, and ``diarize``, ``min_speakers``, ``max_speakers``; the audio as the
        ``audio_file`` part)."""
        return await self._guarded(request, lambda caller: self._asr(request, caller))

    async def _asr(self, request: Request, caller: Caller) -> Response:
        q = request.query_params
        output = q.get("output", "txt")
        if output not in transcripts.ASR_FORMATS:
            raise RequestError(
                f"output must be one of {', '.join(transcripts.ASR_FORMATS)}", code=ErrorCode.INVALID_REQUEST
            )
        upload = await self.receiver.receive(
            request, caller, "audio_file", raw_pcm=not flag(q.get("encode"), True, "encode")
        )
        options: dict[str, Any] = {"task": q.get("task") or "transcribe"}
        if q.get("language"):
            options["language"] = q["language"]
        if q.get("initial_prompt"):
            options["initial_prompt"] = q["initial_prompt"]
        if q.get("vad_filter") is not None:
            options["vad"] = flag(q.get("vad_filter"), True, "vad_filter")
        if flag(q.get("word_timestamps"), False, "word_timestamps"):
            options["word_timestamps"] = True
        if flag(q.get("diarize"), False, "diarize"):
            options["diarize"] = True
        options.update(speaker_bounds(q.get("min_speakers"), q.get("max_speakers")))
        ended = await self._run(request, caller, upload, options)
        if ended is None:
            return Response(status_code=499)
        body = await self._render(ended, output, "asr")
        headers = {"Asr-Engine": "edge-queue"}
        if output in ("txt", "vtt", "srt", "tsv"):
            headers["Content-Disposition"] = (
                f'attachment; filename="{upload.path.stem if upload.path else "audio"}.{output}"'
            )
        return Response(body, media_type=transcripts.CONTENT_TYPES[output], headers=headers)

    async def detect_language(self, request: Request) -> Response:
        """``POST /detect-language``: ``{"detected_language" (its name), "language_code",
        "confidence", "uncertain"}`` of the first :data:`DETECT_S` seconds (raw PCM: the rest is not kept)."""
        return await self._guarded(request, lambda caller: self._detect(request, caller))

    async def _detect(self, request: Request, caller: Caller) -> Response:
        raw_pcm = not flag(request.query_params.get("encode"), True, "encode")
        keep = DETECT_S * PCM_RATE * PCM_WIDTH if raw_pcm else None
        upload = await self.receiver.receive(request, caller, "audio_file", raw_pcm=raw_pcm, keep_bytes=keep)
        ended = await self._run(request, caller, upload, {"task": "detect"})
        if ended is None:
            return Response(status_code=499)
        result = ended.job.get("result") or {}
        code = result.get("language")
        # the model's own probability; "uncertain" below transcribe.language_threshold, and
        # no language at all (null) without speech (docs/http-api.md, "Languages")
        return _json_now(
            {
                "detected_language": transcripts.language_name(code),
                "language_code": code,
                "confidence": result.get("language_probability"),
                "uncertain": bool(result.get("language_uncertain", code is None)),
            }
        )

    async def openai_transcriptions(self, request: Request) -> Response:
        """``POST /v1/audio/transcriptions`` (OpenAI's fields: ``file``, ``model``,
        ``language``, ``prompt``, ``response_format``, ``timestamp_granularities[]``; speakers:
        :mod:`.openai_form`)."""
        return await self._guarded(request, lambda caller: self._openai(request, caller, "transcribe"))

    async def openai_translations(self, request: Request) -> Response:
        """``POST /v1/audio/translations``: into English (``file``, ``model``, ``prompt``,
        ``response_format``)."""
        return await self._guarded(request, lambda caller: self._openai(request, caller, "translate"))

    async def _openai(self, request: Request, caller: Caller, task: str) -> Response:
        upload = await self.receiver.receive(request, caller, "file", raw_pcm=False, refused_fields=REFUSED_FIELDS)
        call = read_call(upload, task, self.settings.transcribe.models)
        ended = await self._run(request, caller, upload, call.options)
        if ended is None:
            return Response(status_code=499)
        fmt = call.response_format
        document_fmt = {"json": "openai_json", "text": "openai_text", "verbose_json": "verbose"}.get(fmt, fmt)
        body = await self._render(ended, document_fmt, "openai", task=task, granularities=set(call.granularities))
        return Response(body, media_type=transcripts.CONTENT_TYPES[fmt])

    # -- one call -----------------------------------------------------------------------

    async def _guarded(self, request: Request, handle: Callable[[Caller], Awaitable[Response]]) -> Response:
        """Who calls, at what rate, with which role, before any of the body is read; every
        refusal and failure in the error shape; the call's upload released at its end."""
        address = request.client.host if request.client else "?"
        try:
            key = presented_key(request.headers.get("authorization"), request.headers.get("x-api-key"))
            try:
                caller = caller_of(self.api, key, address)
            except RequestError:
                count_call(self.rate, f"addr:{address}", time.monotonic())  # wrong keys count against the address
                raise
            count_call(self.rate, caller.key, time.monotonic())
            if caller.placeholder and self._first_placeholder(address):
                log.info("HTTP callers from %s send a key not in [api] keys: they act as %r", address, caller.user)
            if self.settings.access.role_of(caller.user) == "none":
                raise RequestError(f"user {caller.user!r} has the none role ([access])", code=ErrorCode.FORBIDDEN)
            return await handle(caller)
        except EdgeQueueError as e:
            if not isinstance(e, RequestError):  # not a refusal: raised by a part of the service
                log.warning("HTTP %s %s: %s", request.method, request.url.path[:100], e.message, exc_info=True)
            return _refused(request, e, address)
        except ClientDisconnect:
            log.info("HTTP caller from %s went away during its upload", address)
            return Response(status_code=499)
        finally:
            self.receiver.release(getattr(request.state, "upload", None))

    def _first_placeholder(self, address: str) -> bool:
        """True the first time (of the last :data:`MAX_TRACKED_CALLERS` addresses) ``address``
        sends a key that is not one of ``[api] keys``."""
        if address in self.placeholders:
            return False
        self.placeholders[address] = None
        if len(self.placeholders) > MAX_TRACKED_CALLERS:
            self.placeholders.popitem(last=False)
        return True

    async def _run(self, request: Request, caller: Caller, upload: Upload, options: dict[str, Any]) -> Ended | None:
        """Submit the upload's job and wait for its end; None when the caller went away first
        (the job goes on). Raises :class:`~edge_queue.errors.RequestError` for a refused submit, a failed job, or a
        job not ended within ``api.wait_s``."""
        assert upload.path is not None
        digest = hashlib.sha256(orjson.dumps(options, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]
        answered, ended = self.gateway.submit_and_wait(
            upload.path,
            {**options, "output": "data_dir", "formats": ["txt", "srt", "vtt", "json"]},
            f"http:{upload.path.stem}:{digest}",
            caller.user,
        )
        response = await _answer(answered)
        if response.get("status") != "ok":
            err = response.get("error") or {}
            code = code_of(err.get("code", "internal_error"))
            message = str(err.get("message", "")).replace(f"{self.uploads}/", "")  # no path of the box
            raise RequestError(message, code=code, retry_after_s=RETRY_AFTER_S.get(code))
        upload.used = True  # a job names the file now
        job_id = response["data"]["jobs"][0]["job_id"]
        try:
            self.shares.wait(caller, job_id)
        except RequestError:
            ended.cancel()
            raise
        log.debug("HTTP caller %s waits for job %s", caller.user, job_id)
        try:
            done = await self._wait(request, ended)
            if done is not None and response["data"]["jobs"][0].get("duplicate") and again(done.job):
                # the same audio sent again after its job failed: that job runs once more
                log.info("HTTP caller %s sent the audio of failed job %s again: retried", caller.user, job_id)
                answered, ended = self.gateway.retry_and_wait(job_id, caller.user)
                if (await _answer(answered)).get("status") == "ok":
                    done = await self._wait(request, ended)
        finally:
            self.shares.done(caller, job_id)
        if done is None:
            log.info("HTTP caller %s went away; job %s goes on", caller.user, job_id)
            return None
        job = done.job
        if job.get("state") != "succeeded":
            upload.used = False  # the upload goes with its job's failure (the gateway deletes it too)
            err = job.get("error") or {}
            code = code_of(err.get("code") or job.get("state"))
            raise RequestError(f"job {job_id} {job.get('state')}: {err.get('message', '')}", code=code)
        return done

    async def _wait(self, request: Request, ended: Future[Ended]) -> Ended | None:
        """The job's end, or None when the caller disconnects first. Raises
        :class:`~edge_queue.errors.RequestError` 504 after ``api.wait_s``."""
        end: asyncio.Future[Any] = asyncio.ensure_future(asyncio.wrap_future(ended))
        gone: asyncio.Future[Any] = asyncio.ensure_future(_disconnected(request))
        try:
            finished, _ = await asyncio.wait({end, gone}, timeout=self.api.wait_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if end in finished:
            if ended.cancelled():  # the service stops (Gateway.stop): the job stays queued
                raise stopping()
            return end.result()
        ended.cancel()
        end.cancel()
        if gone in finished:
            return None
        raise RequestError(
            f"the job did not end within {self.api.wait_s:g} s ([api] wait_s); "
            "send the same audio again to be answered from it",
            code=ErrorCode.TIMEOUT,
        )

    async def _render(self, ended: Ended, fmt: str, api: str, **kw: Any) -> bytes:
        """The answer's body in ``fmt`` from the job's own files."""
        return await anyio.to_thread.run_sync(lambda: self._render_now(ended, fmt, api, **kw))

    def _render_now(
        self, ended: Ended, fmt: str, api: str, *, task: str = "transcribe", granularities: set[str] | None = None
    ) -> bytes:
        outputs = (ended.job.get("result") or {}).get("outputs") or {}
        if fmt in transcripts.FILE_FORMATS:
            return self._read(outputs.get(fmt), ended)
        document = orjson.loads(self._read(outputs.get("json"), ended))
        if not isinstance(document, dict):
            raise RequestError("the job's json output is not an object", code=ErrorCode.OUTPUT_CHANGED)
        if fmt == "tsv":
            return transcripts.tsv(document)
        if fmt == "json":
            return transcripts.whisper_json(document)
        if fmt == "openai_json":
            return transcripts.openai_json(document)
        if fmt == "openai_text":
            return transcripts.openai_text(document)
        if fmt == "diarized_json":
            return transcripts.openai_diarized(document)
        grains = granularities or set()
        return transcripts.openai_verbose(document, task, "word" in grains, segments=not grains or "segment" in grains)

    def _read(self, path: Any, ended: Ended) -> bytes:
        if not isinstance(path, str) or path not in ended.recorded:
            raise RequestError(
                "the job's output is not a file the service recorded writing", code=ErrorCode.OUTPUT_UNRECORDED
            )
        try:
            data, more = read_written(path, ended.recorded[path], [self.outputs], MAX_OUTPUT_BYTES)
        except NotTheFileWritten as e:
            raise RequestError(f"the job's output cannot be read: {e.why}", code=e.code) from None
        if more:
            raise RequestError(
                f"the job's output is over {MAX_OUTPUT_BYTES // 2**20} MiB", code=ErrorCode.RESPONSE_TOO_LARGE
            )
        return data


def again(job: dict[str, Any]) -> bool:
    """True for a job worth running again when its audio is sent again: it failed or was
    cancelled, and not because the file is not usable audio (:data:`MEDIA_ERRORS`)."""
    if job.get("state") not in ("failed", "cancelled"):
        return False
    return str((job.get("error") or {}).get("code")) not in MEDIA_ERRORS | LANGUAGE_ERRORS


async def _answer(answered: Future[dict[str, Any]]) -> dict[str, Any]:
    """The loop's response to a request handed over; raises :class:`~edge_queue.errors.RequestError` ``stopping``
    when the service let the request go as it stops (``Gateway.stop`` cancels it)."""
    try:
        return await asyncio.wrap_future(answered)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if answered.cancelled() and not (task is not None and task.cancelling()):
            raise stopping() from None
        raise


def _refused(request: Request, error: EdgeQueueError, address: str) -> JSONResponse:
    """A refused call: one INFO line (no traceback; :data:`refusals`), and its answer in the
    error shape, with OpenAI's statuses on OpenAI's routes (``/v1/``)."""
    openai = request.url.path.startswith("/v1/")
    status = status_of(error.code, openai=openai)
    refusals.warning(
        "HTTP %s %s from %s refused: %d %s: %s (%s)",
        request.method,
        request.url.path[:100],
        address,
        status,
        str(error.code),
        error.message[:300],
        request.scope.get("state", {}).get("request_id", "-"),
    )
    return error_response(error, openai=openai)


def _model_object(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "edge-queue"}


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body was read before)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own refusals (no such route 404, another method 405) in the error shape."""
    code = {404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED}.get(exc.status_code, ErrorCode.INVALID_REQUEST)
    error = RequestError(f"{request.method} {request.url.path[:200]}: {exc.detail}", code=code)
    return _refused(request, error, request.client.host if request.client else "?")


async def _json(data: Any) -> Response:
    return JSONResponse(data)


def _json_now(data: Any) -> Response:
    return Response(orjson.dumps(data), media_type="application/json")
