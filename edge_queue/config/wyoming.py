"""``[wyoming]``: the Wyoming listener (docs/configuration.md, "[wyoming]";
docs/home-assistant.md, "Voice (Assist)").

Home Assistant's Assist reaches speech-to-text over the Wyoming protocol (a TCP port, JSON lines
and PCM audio; OHF-Voice/wyoming's README). Each voice command becomes a ``transcribe`` job of
the queue, ahead of batch work, submitted as ``wyoming.user``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from edge_queue.config.values import NOT_IN_USER, Host


class WyomingSettings(BaseModel):
    """``[wyoming]``: where the Wyoming listener listens, as whom its commands run, its bounds."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    #: Serve the Wyoming protocol; false (the default): no listener.
    enabled: bool = False
    #: Address to listen on (``0.0.0.0``: every IPv4 interface).
    host: Host = Field("0.0.0.0", min_length=1, max_length=255)
    #: TCP port: 10300, the one Wyoming speech-to-text servers use (wyoming-faster-whisper's).
    port: int = Field(10300, ge=1, le=65535)
    #: Announce the listener by mDNS (``_wyoming._tcp.local.``) so Home Assistant discovers it;
    #: only a listener reachable from the LAN is announced.
    zeroconf: bool = True
    #: The user the voice commands' jobs are submitted as (its role from [access]).
    user: str = Field("assist", min_length=1, max_length=64)
    #: Connections open at once from one address; one more is answered with ``error`` ``busy``.
    connections_per_address: int = Field(4, ge=1, le=1024)
    #: Connections open at once over every address.
    max_connections: int = Field(32, ge=1, le=4096)
    #: Seconds of audio one command may send (Home Assistant's commands end at silence, a few
    #: seconds); past it the command is refused with ``error`` ``audio_too_long``.
    max_audio_s: float = Field(30.0, gt=0, le=600)
    #: Seconds a connection may send nothing (between events, or within one) before it is closed.
    idle_timeout_s: float = Field(30.0, gt=0, le=3600)
    #: Seconds a command waits for its job to end, and its job's timeout; then ``error`` ``timeout``.
    wait_s: float = Field(60.0, gt=0, le=3600)

    @field_validator("user")
    @classmethod
    def _user(cls, v: str) -> str:
        if NOT_IN_USER.search(v):
            raise ValueError(f"{v[:100]!r} cannot be a user name: without '/', '+', '#' or controls")
        return v
