"""The HTTP status of every error code the HTTP API answers with (docs/http-api.md, "Errors"):
one table for every route, so that a caller's fault is a 4xx wherever it is found (clients
resend a 5xx, and a file that is not audio never becomes audio), and the one error every refusal
raises (:class:`HttpError`) and its answer in the error shape (:func:`error_response`).
"""

from __future__ import annotations

from starlette.responses import JSONResponse

#: Error code -> HTTP status. The codes of the queue's vocabulary (docs/topics.md, "Error codes")
#: that a submit or a job's end can give a call, and the HTTP API's own.
STATUS: dict[str, int] = {
    # the caller sent something wrong: resending the same cannot succeed
    "invalid_json": 400,
    "invalid_request": 400,
    "unknown_command": 400,
    "unauthorized": 401,
    "forbidden": 403,
    "not_found": 404,
    "model_not_found": 404,
    "method_not_allowed": 405,
    "upload_timeout": 408,
    "conflict": 409,
    "lock_held": 409,
    "payload_too_large": 413,
    "unsupported_media": 422,
    "no_audio_stream": 422,
    "truncated_media": 422,
    "decode_error": 422,
    "language_unsupported": 422,  # a language the model does not speak
    "language_uncertain": 422,  # speech the model could not place
    "rate_limited": 429,
    # the service failed, or cannot serve now: the same call may succeed later
    "internal_error": 500,
    "input_not_found": 500,  # the upload the service wrote is gone
    "unknown_kind": 500,  # the API's kind is its own: the settings leave no transcribe
    "input_outside_media_roots": 500,
    "input_unreachable": 500,
    "invalid_result": 500,
    "output_exists": 500,
    "output_not_writable": 500,
    "output_changed": 500,
    "output_missing": 500,
    "output_unrecorded": 500,
    "response_too_large": 500,
    "worker_lost": 500,
    "crash_loop": 500,
    "cancelled": 500,  # an admin cancelled the job: the same audio sent again runs it again
    "busy": 503,
    "queue_full": 503,
    "stopping": 503,
    "timeout": 504,
    "disk_full": 507,
    "uploads_full": 507,
}

#: Codes that say the call itself is at fault (never a 5xx).
CALLER_FAULTS = frozenset(code for code, status in STATUS.items() if status < 500 and code != "rate_limited")

#: What OpenAI answers where the table says otherwise, on OpenAI's routes (``/v1/...``): a file
#: it cannot use is a 400, which the ``openai`` package raises as ``BadRequestError``.
OPENAI_STATUS = {422: 400}


def status_of(code: str, *, openai: bool = False) -> int:
    """The HTTP status of error ``code`` (500 for a code not in :data:`STATUS`), as OpenAI's
    routes answer it when ``openai``."""
    status = STATUS.get(code, 500)
    return OPENAI_STATUS.get(status, status) if openai else status


class HttpError(Exception):
    """A call answered with an error: its ``code`` (its status is :func:`status_of` it),
    ``message``, the seconds of ``Retry-After`` when the caller may try again, and the request
    ``param`` at fault (OpenAI's ``param``) when one is."""

    def __init__(self, code: str, message: str, retry_after_s: int | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.retry_after_s, self.param = code, message, retry_after_s, param

    @property
    def status(self) -> int:
        return status_of(self.code)


def error_response(e: HttpError, *, openai: bool = False) -> JSONResponse:
    """OpenAI's error shape for every route: ``{"error": {"message", "type", "param", "code"}}``
    (``type``: ``invalid_request_error`` for 4xx, ``server_error`` for 5xx), with the status
    of :func:`~.statuses.status_of` the code (OpenAI's on its routes: ``openai``). Never 200,
    never a body a subtitle parser would take."""
    status = status_of(e.code, openai=openai)
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 429:
        kind = "rate_limit_error"
    body = {"error": {"message": e.message, "type": kind, "param": e.param, "code": e.code}}
    headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s else None
    return JSONResponse(body, status_code=status, headers=headers)
