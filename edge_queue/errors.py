"""The exception tree of edge-queue, and the closed vocabulary of error codes.

Every exception raised on purpose by edge-queue derives from :class:`EdgeQueueError` and
carries one code of the product's error vocabulary (docs/topics.md, "Error codes"), so the one place that turns
exceptions into responses or job states (``service`` for requests, ``worker`` for jobs) never
has to guess.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """Error codes of the wire contract (docs/topics.md, "Error codes"). Extend deliberately, and document."""

    INVALID_JSON = "invalid_json"
    INVALID_REQUEST = "invalid_request"
    UNKNOWN_COMMAND = "unknown_command"
    UNKNOWN_KIND = "unknown_kind"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    QUEUE_FULL = "queue_full"
    DISK_FULL = "disk_full"
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"
    LOCK_HELD = "lock_held"
    FORBIDDEN = "forbidden"
    INPUT_NOT_FOUND = "input_not_found"
    INPUT_OUTSIDE_MEDIA_ROOTS = "input_outside_media_roots"
    #: a worker node cannot read the job's input through its path map: the job goes to
    #: another place, its attempt not counted (docs/nodes.md)
    INPUT_UNREACHABLE = "input_unreachable"
    #: a worker node's ``done`` whose result is not its kind's result shape: a failed attempt
    INVALID_RESULT = "invalid_result"
    UNSUPPORTED_MEDIA = "unsupported_media"
    NO_AUDIO_STREAM = "no_audio_stream"
    TRUNCATED_MEDIA = "truncated_media"
    DECODE_ERROR = "decode_error"
    #: a ``transcribe`` job's language, given or detected, is one its model does not speak, or
    #: an English-only model was asked to tell the language (docs/topics.md, "Languages")
    LANGUAGE_UNSUPPORTED = "language_unsupported"
    #: the model could not tell the spoken language surely enough (below
    #: ``transcribe.language_threshold``) and the job did not give it
    LANGUAGE_UNCERTAIN = "language_uncertain"
    OUTPUT_EXISTS = "output_exists"
    OUTPUT_NOT_WRITABLE = "output_not_writable"
    #: ``get``'s ``result.output_errors``: an output is no longer the file its job wrote, is
    #: gone, or was never recorded as written by the service's own worker (docs/topics.md, "get")
    OUTPUT_CHANGED = "output_changed"
    OUTPUT_MISSING = "output_missing"
    OUTPUT_UNRECORDED = "output_unrecorded"
    #: an answer larger than the broker accepts (its Maximum Packet Size, or mqtt.max_packet_size)
    RESPONSE_TOO_LARGE = "response_too_large"
    TIMEOUT = "timeout"
    WORKER_LOST = "worker_lost"
    CRASH_LOOP = "crash_loop"
    CANCELLED = "cancelled"
    INTERNAL_ERROR = "internal_error"
    # the HTTP API's own (docs/http-api.md, "Errors"): its calls' refusals
    #: no API key, or one not in ``[api] keys``, while ``api.anonymous_user`` is unset
    UNAUTHORIZED = "unauthorized"
    #: a ``model`` not in ``GET /v1/models``
    MODEL_NOT_FOUND = "model_not_found"
    #: a route called with another method
    METHOD_NOT_ALLOWED = "method_not_allowed"
    #: an upload too slow, idle, or past ``api.max_upload_s``
    UPLOAD_TIMEOUT = "upload_timeout"
    #: over ``api.calls_per_minute``
    RATE_LIMITED = "rate_limited"
    #: every upload slot, connection or wait of the caller's share is taken
    BUSY = "busy"
    #: the service is stopping while the call is received or waits
    STOPPING = "stopping"
    #: the user's uploads on disk would pass ``api.max_user_uploads_mb``
    UPLOADS_FULL = "uploads_full"
    # the Wyoming listener's own (docs/home-assistant.md, "Voice (Assist)")
    #: a voice command's audio past ``wyoming.max_audio_s``
    AUDIO_TOO_LONG = "audio_too_long"


#: Codes a later attempt cannot fix: a job failing with one of these fails at once
#: (docs/topics.md, "Error codes": the codes with `retryable` no).
NON_RETRYABLE: frozenset[ErrorCode] = frozenset(
    {
        ErrorCode.INVALID_REQUEST,
        ErrorCode.UNKNOWN_KIND,
        ErrorCode.INPUT_NOT_FOUND,
        ErrorCode.INPUT_OUTSIDE_MEDIA_ROOTS,
        ErrorCode.UNSUPPORTED_MEDIA,
        ErrorCode.NO_AUDIO_STREAM,
        ErrorCode.TRUNCATED_MEDIA,
        ErrorCode.DECODE_ERROR,
        ErrorCode.LANGUAGE_UNSUPPORTED,
        ErrorCode.LANGUAGE_UNCERTAIN,
        ErrorCode.OUTPUT_EXISTS,
        ErrorCode.OUTPUT_NOT_WRITABLE,
        ErrorCode.CANCELLED,
        ErrorCode.CRASH_LOOP,
    }
)


class EdgeQueueError(Exception):
    """Root of every edge-queue exception.

    Attributes:
        code: the wire error code (:class:`ErrorCode`).
        message: a sentence for people; never a stack trace.
    """

    code: ErrorCode = ErrorCode.INTERNAL_ERROR

    def __init__(self, message: str, *, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    @property
    def retryable(self) -> bool:
        """True when another attempt could succeed (the code is not in :data:`NON_RETRYABLE`)."""
        return self.code not in NON_RETRYABLE


class ConfigError(EdgeQueueError):
    """The configuration file or environment holds an unknown key or a bad value."""

    code = ErrorCode.INVALID_REQUEST


class RequestError(EdgeQueueError):
    """A request (an MQTT request, an HTTP call) is refused or cannot be answered; ``code`` says
    why, ``field`` names the culprit (the HTTP API's ``param``), and ``retry_after_s`` the
    seconds after which the same may succeed (HTTP's ``Retry-After``), when it may."""

    code = ErrorCode.INVALID_REQUEST

    def __init__(
        self,
        message: str,
        *,
        code: ErrorCode | None = None,
        field: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message, code=code)
        self.field, self.retry_after_s = field, retry_after_s


class InputError(RequestError):
    """One input of a submit is unusable (missing, outside ``media_roots``); others go on."""


class StoreError(EdgeQueueError):
    """The store refused an operation (unknown job, illegal state transition)."""


class NotFoundError(StoreError):
    """No job or batch has this id."""

    code = ErrorCode.NOT_FOUND


class TransitionError(StoreError):
    """A state change that the transition table (``states.TRANSITIONS``) does not allow."""

    code = ErrorCode.CONFLICT


class JobError(EdgeQueueError):
    """Raised by a job kind: the attempt failed with ``code``; ``retryable`` follows the code
    unless ``retryable`` is given (an ``internal_error`` a later attempt cannot mend: False)."""

    def __init__(self, message: str, *, code: ErrorCode | None = None, retryable: bool | None = None) -> None:
        super().__init__(message, code=code)
        self._retryable = retryable

    @property
    def retryable(self) -> bool:
        """``retryable`` as given, else True when the code is not in :data:`NON_RETRYABLE`."""
        return self.code not in NON_RETRYABLE if self._retryable is None else self._retryable


class MediaError(JobError):
    """The input file cannot be used as media (zero-length, not media, truncated, no audio)."""

    code = ErrorCode.UNSUPPORTED_MEDIA


class JobCancelled(JobError):
    """The job saw its cancel flag at a checkpoint and stopped."""

    code = ErrorCode.CANCELLED


class BrokerUnavailable(EdgeQueueError):
    """No MQTT broker answered at the configured address within the connect timeout."""
