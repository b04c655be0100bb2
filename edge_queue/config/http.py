"""``[http]``: the queue page's server (docs/configuration.md, "[http]"; docs/operations.md,
"The queue page"): its address, the broker's WebSocket it points the page at, and which pages
and proxies may reach that WebSocket.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from edge_queue.config.values import Host, address_problem, origin_problem


class HttpSettings(BaseModel):
    """``[http]``: the queue page (docs/configuration.md, "[http]"), static files served by
    ``edge-queue serve``. The page talks to the broker over MQTT over WebSocket; no job data
    passes through this server."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    #: Serve the page; false: no HTTP server at all.
    enabled: bool = True
    #: Address to listen on (``0.0.0.0``: every IPv4 interface, so phones on the LAN reach it).
    host: Host = Field("0.0.0.0", min_length=1, max_length=255)
    #: TCP port of the page: ``http://<host>:8099/``.
    port: int = Field(8099, ge=1, le=65535)
    #: The broker's MQTT-over-WebSocket port; the page connects to ``ws://<the host it was
    #: loaded from>:<port>/``. The embedded broker without ``broker.config_file`` listens there.
    websocket_port: int = Field(9001, ge=1, le=65535)
    #: Relay the page's WebSocket to the broker's listener (``mqtt.host``, ``websocket_port``)
    #: on the page's own ``/mqtt``: one origin for Home Assistant's ingress and reverse proxies.
    websocket_proxy: bool = False
    #: The whole WebSocket URL instead (``wss://nas.example.org:8443/mqtt`` behind a proxy or
    #: with TLS); unset: built from ``websocket_port``.
    websocket_url: str | None = Field(None, pattern=r"^wss?://[^\s]+$", max_length=2048)
    #: Origins (``scheme://host[:port]``, no path) allowed to show the page in a frame: the
    #: Home Assistant of a Webpage card or panel (docs/operations.md, "In a Home Assistant
    #: dashboard"). Empty: no page may frame it (``frame-ancestors 'none'``).
    frame_ancestors: list[str] = Field([], max_length=16)
    #: Origins (``scheme://host[:port]``) of pages allowed to open the broker's WebSocket besides
    #: the page's own (docs/operations.md, "Which pages may connect to the broker"): the
    #: address a reverse proxy serves the page at, or a name of the box the page is opened by.
    allowed_origins: list[str] = Field([], max_length=16)
    #: Addresses of reverse proxies in front of the page (Home Assistant's ingress:
    #: ``172.30.32.2``): their relayed WebSockets are not bounded per address, and their
    #: ``X-Forwarded-Host`` and ``X-Forwarded-Proto`` are believed (from no other address).
    trusted_proxies: list[str] = Field([], max_length=16)

    @field_validator("frame_ancestors", "allowed_origins")
    @classmethod
    def _origins(cls, v: list[str], info: ValidationInfo) -> list[str]:
        for origin in v:  # 'self': the page's own origin only (Home Assistant's ingress's frame)
            if (origin != "'self'" or info.field_name == "allowed_origins") and (why := origin_problem(origin)):
                raise ValueError(why)
        return v

    @field_validator("trusted_proxies")
    @classmethod
    def _proxies(cls, v: list[str]) -> list[str]:
        for address in v:
            if (why := address_problem(address)) is not None:
                raise ValueError(why)
        return v
