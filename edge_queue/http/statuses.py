"""The HTTP status of every error code (docs/http-api.md, "Errors"): one table for every route,
so that a caller's fault is a 4xx wherever it is found (clients resend a 5xx, and a file that is
not audio never becomes audio), and the answer to any :class:`~edge_queue.errors.EdgeQueueError`
in the error shape (:func:`error_response`). The HTTP side raises the errors of
:mod:`edge_queue.errors` (a refused call: :class:`~edge_queue.errors.RequestError` with its
code), and has none of its own.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from edge_queue.errors import EdgeQueueError, ErrorCode, RequestError

#: Error code -> HTTP status, for every code of the vocabulary (docs/topics.md, "Error codes"):
#: those a submit or a job's end can give a call, and the HTTP API's own.
STATUS: dict[ErrorCode, int] = {
    # the caller sent something wrong: resending the same cannot succeed
    ErrorCode.INVALID_JSON: 400,
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.UNKNOWN_COMMAND: 400,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.MODEL_NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.UPLOAD_TIMEOUT: 408,
    ErrorCode.CONFLICT: 409,
    ErrorCode.LOCK_HELD: 409,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.AUDIO_TOO_LONG: 413,
    ErrorCode.UNSUPPORTED_MEDIA: 422,
    ErrorCode.NO_AUDIO_STREAM: 422,
    ErrorCode.TRUNCATED_MEDIA: 422,
    ErrorCode.DECODE_ERROR: 422,
    ErrorCode.LANGUAGE_UNSUPPORTED: 422,  # a language the model does not speak
    ErrorCode.LANGUAGE_UNCERTAIN: 422,  # speech the model could not place
    ErrorCode.RATE_LIMITED: 429,
    # the service failed, or cannot serve now: the same call may succeed later
    ErrorCode.INTERNAL_ERROR: 500,
    ErrorCode.INPUT_NOT_FOUND: 500,  # the upload the service wrote is gone
    ErrorCode.UNKNOWN_KIND: 500,  # the API's kind is its own: the settings leave no transcribe
    ErrorCode.INPUT_OUTSIDE_MEDIA_ROOTS: 500,
    ErrorCode.INPUT_UNREACHABLE: 500,
    ErrorCode.INVALID_RESULT: 500,
    ErrorCode.OUTPUT_EXISTS: 500,
    ErrorCode.OUTPUT_NOT_WRITABLE: 500,
    ErrorCode.OUTPUT_CHANGED: 500,
    ErrorCode.OUTPUT_MISSING: 500,
    ErrorCode.OUTPUT_UNRECORDED: 500,
    ErrorCode.RESPONSE_TOO_LARGE: 500,
    ErrorCode.WORKER_LOST: 500,
    ErrorCode.CRASH_LOOP: 500,
    ErrorCode.CANCELLED: 500,  # an admin cancelled the job: the same audio sent again runs it again
    ErrorCode.BUSY: 503,
    ErrorCode.QUEUE_FULL: 503,
    ErrorCode.STOPPING: 503,
    ErrorCode.TIMEOUT: 504,
    ErrorCode.DISK_FULL: 507,
    ErrorCode.UPLOADS_FULL: 507,
}

#: Codes that say the call itself is at fault (never a 5xx).
CALLER_FAULTS = frozenset(code for code, status in STATUS.items() if status < 500 and code != "rate_limited")

#: What OpenAI answers where the table says otherwise, on OpenAI's routes (``/v1/...``): a file
#: it cannot use is a 400, which the ``openai`` package raises as ``BadRequestError``.
OPENAI_STATUS = {422: 400}


def status_of(code: str, *, openai: bool = False) -> int:
    """The HTTP status of error ``code`` (an :class:`ErrorCode`, or its text; 500 for a code not
    in :data:`STATUS`), as OpenAI's routes answer it when ``openai``."""
    status = STATUS.get(code_of(code), 500)
    return OPENAI_STATUS.get(status, status) if openai else status


#: Seconds a caller is told to wait (``Retry-After``) before sending again after a refusal of
#: these codes (docs/http-api.md, "Errors").
RETRY_AFTER_S = {ErrorCode.QUEUE_FULL: 30, ErrorCode.STOPPING: 10}


def stopping() -> RequestError:
    """503 ``stopping``: the service stops while the call is received or waits for its job
    (which stays queued)."""
    return RequestError(
        "edge-queue is stopping; the job stays queued: send the same call again",
        code=ErrorCode.STOPPING,
        retry_after_s=RETRY_AFTER_S[ErrorCode.STOPPING],
    )


def code_of(value: object) -> ErrorCode:
    """``value`` (a code from a response or a job's error, as text) as the :class:`ErrorCode`
    it names, or ``internal_error`` when it names none."""
    try:
        return ErrorCode(str(value))
    except ValueError:
        return ErrorCode.INTERNAL_ERROR


def error_response(e: EdgeQueueError, *, openai: bool = False) -> JSONResponse:
    """OpenAI's error shape for every route: ``{"error": {"message", "type", "param", "code"}}``
    (``type``: ``invalid_request_error`` for 4xx, ``server_error`` for 5xx), with the status
    of :func:`status_of` the code (OpenAI's on its routes: ``openai``); ``param`` and
    ``Retry-After`` from a :class:`~edge_queue.errors.RequestError`'s ``field`` and
    ``retry_after_s``. Never 200, never a body a subtitle parser would take."""
    status = status_of(e.code, openai=openai)
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 429:
        kind = "rate_limit_error"
    param, retry_after_s = (e.field, e.retry_after_s) if isinstance(e, RequestError) else (None, None)
    body = {"error": {"message": e.message, "type": kind, "param": param, "code": str(e.code)}}
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s else None
    return JSONResponse(body, status_code=status, headers=headers)
