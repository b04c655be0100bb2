"""``[api]``: the HTTP API (docs/configuration.md, "[api]"; docs/http-api.md).

Speech-to-text over HTTP in the two shapes subtitle tools speak: whisper-asr-webservice's
(``POST /asr``, Bazarr's Whisper provider) and OpenAI's audio API (``POST
/v1/audio/transcriptions``). Each call becomes a ``transcribe`` job of the queue, submitted as
the user its API key names (docs/configuration.md, "[access]").
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from edge_queue.config.values import NOT_IN_USER, Host

#: The shortest API key taken: 16 characters (``openssl rand -hex 16`` makes 32).
MIN_KEY_CHARS = 16


class ApiSettings(BaseModel):
    """``[api]``: who may call the HTTP API, on which address, and its bounds."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    #: Serve the HTTP API; false: no listener.
    enabled: bool = True
    #: Address to listen on (``0.0.0.0``: every IPv4 interface).
    host: Host = Field("0.0.0.0", min_length=1, max_length=255)
    #: TCP port: 9000, whisper-asr-webservice's (Bazarr's default address is ``http://<box>:9000``).
    port: int = Field(9000, ge=1, le=65535)
    #: API keys: user name -> key. A caller sends ``Authorization: Bearer <key>`` (or
    #: ``X-API-Key``) and its jobs are that user's, with that user's role ([access]).
    keys: dict[str, SecretStr] = {}
    #: The user a caller without a key acts as (Bazarr sends no key); unset: such a caller is
    #: refused with 401. Anyone who reaches the port may then submit as this user.
    anonymous_user: str | None = Field(None, min_length=1, max_length=64)
    #: Largest upload, MiB (a 2-hour film's 16-kHz PCM is about 230 MB).
    max_upload_mb: int = Field(1024, ge=1, le=1024 * 1024)
    #: Uploads received at once, over every caller; one more is answered 503 with Retry-After.
    uploads_at_once: int = Field(32, ge=1, le=1024)
    #: Calls one caller (an API key, or an address without one) may start per minute; one more
    #: is answered 429 with Retry-After.
    calls_per_minute: int = Field(120, ge=1, le=100_000)
    #: Seconds an upload may send nothing before it is dropped (408).
    idle_timeout_s: float = Field(60.0, gt=0, le=3600)
    #: Seconds one upload may take from its head to its last byte; then it is dropped (408).
    max_upload_s: float = Field(3600.0, gt=0, le=7 * 86400)
    #: MiB one user's uploads may have on disk, those kept for its jobs and those being
    #: received (also at most half of what uploads can have); past it, 507 ``uploads_full``.
    max_user_uploads_mb: int = Field(2048, ge=1, le=1024 * 1024)
    #: Seconds a call waits for its job to end (Bazarr waits 3,600); then it is answered 504
    #: and the job goes on: the same audio sent again is answered from it.
    wait_s: float = Field(3 * 3600.0, gt=0, le=7 * 86400)

    @field_validator("keys")
    @classmethod
    def _keys(cls, v: dict[str, SecretStr]) -> dict[str, SecretStr]:
        seen: set[str] = set()
        for user, key in v.items():
            if not user or NOT_IN_USER.search(user):
                raise ValueError(f"{user[:100]!r} cannot be a user name: not empty, without '/', '+', '#' or controls")
            secret = key.get_secret_value()
            if len(secret) < MIN_KEY_CHARS or not secret.isprintable() or " " in secret:
                raise ValueError(
                    f"the key of {user[:100]!r} must be at least {MIN_KEY_CHARS} printable characters "
                    "without spaces (openssl rand -hex 16)"
                )
            if secret in seen:
                raise ValueError(f"the key of {user[:100]!r} is also another user's")
            seen.add(secret)
        return v

    @field_validator("anonymous_user")
    @classmethod
    def _anonymous(cls, v: str | None) -> str | None:
        if v is not None and NOT_IN_USER.search(v):
            raise ValueError(f"{v[:100]!r} cannot be a user name: without '/', '+', '#' or controls")
        return v
