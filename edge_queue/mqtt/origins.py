"""Which browser pages may open a WebSocket to the broker: the queue page's own origins
(docs/operations.md, "Which pages may connect to the broker"). Used by the embedded broker's
WebSocket listener (:mod:`edge_queue.mqtt.ws_listener`) and the page's ``/mqtt`` relay
(:mod:`edge_queue.http.relay`).

A browser sends the origin of the page that opens a WebSocket in the handshake's ``Origin``
header; a page can neither change it nor add a header of its own to the handshake (the
WebSocket API has no way to). Without this check any web site open in a browser on the box, or
on the LAN, could talk to the broker as that browser (Cross-Site WebSocket Hijacking; RFC 6455
section 10.2). A client that is not a browser (paho, mosquitto_sub, Home Assistant) sends no
``Origin``: it is left to the broker's login, as on any listener.

A handshake is taken when it has no ``Origin``, or when its ``Origin`` is one the page is served
at:

- ``http://<name>:<http.port>`` for ``127.0.0.1``, ``localhost``, ``[::1]``, ``http.host``
  (unless ``0.0.0.0`` or ``::``), and the box's host name (also with ``.local``);
- ``http://<the address the connection reached>:<http.port>``: an IP address, the page opened by
  the box's address on the LAN (a site elsewhere cannot be served from it);
- either of those with the port the connection reached instead of ``http.port``: what paho,
  which is no browser, sends (the address it connects to);
- one of ``http.allowed_origins``;
- the origin a reverse proxy says the browser asked for, ``X-Forwarded-Proto://X-Forwarded-Host``,
  when the connection comes from one of ``http.trusted_proxies`` (Home Assistant's ingress,
  ``172.30.32.2``, sets both): from any other address these headers are the client's own word
  (a script on the LAN may send them), and are not believed.

Names are compared as a browser compares origins: ``http://localhost.:8099`` (a trailing dot) is
another origin than ``http://localhost:8099`` to a browser, and is refused unless listed in
``http.allowed_origins``. A handshake with more than one ``Origin`` header is refused: no browser
sends two, and the relay and the broker's listener must not each pick a different one.

Plain functions over plain data, tested in milliseconds; :func:`page_origins` alone reads the
host name.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from edge_queue.config.http import HttpSettings
from edge_queue.config.values import ip_of

#: Names every box is reached by from its own browser.
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class PageOrigins:
    """The queue page's origins: its port, the host names and addresses it is served at (lower
    case, IPv6 without brackets), ``http.allowed_origins`` (exact, lower case), and the
    addresses of ``http.trusted_proxies``, whose ``X-Forwarded-Host`` and ``X-Forwarded-Proto``
    are believed."""

    port: int
    hosts: frozenset[str]
    allowed: frozenset[str]
    trusted: frozenset[str] = frozenset()


def page_origins(http: HttpSettings, hostname: str | None = None) -> PageOrigins:
    """:class:`PageOrigins` of ``http`` (``[http]``); ``hostname`` defaults to this box's."""
    name = (hostname if hostname is not None else socket.gethostname()).lower().rstrip(".")
    hosts = {*LOOPBACK_NAMES, name}
    if name and "." not in name:
        hosts.add(f"{name}.local")  # mDNS: what a NAS or a Raspberry Pi answers to on the LAN
    if http.host not in ("0.0.0.0", "::", ""):
        hosts.add(http.host.strip("[]").lower())
    return PageOrigins(
        port=http.port,
        hosts=frozenset(h for h in hosts if h),
        allowed=frozenset(o.lower() for o in http.allowed_origins),
        trusted=frozenset(http.trusted_proxies),
    )


def parse_origin(origin: str) -> tuple[str, str, int] | None:
    """``(scheme, host, port)`` of a web origin (``http://[::1]:8099`` -> ``("http", "::1",
    8099)``; the scheme's port when none is written; a trailing dot kept: another origin to a
    browser), or None for anything else (``null``, a path, a scheme other than http and https)."""
    try:
        parts = urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query:
        return None
    if parts.username is not None or parts.fragment:
        return None
    return parts.scheme, parts.hostname.lower(), port or (443 if parts.scheme == "https" else 80)


def _same_address(host: str, address: str | None) -> bool:
    if address is None:
        return False
    a, b = ip_of(host), ip_of(address)
    return a is not None and a == b


def _forwarded(parsed: tuple[str, str, int], headers: Mapping[str, str]) -> bool:
    """The origin is the one a reverse proxy says the browser asked for."""
    host = headers.get("x-forwarded-host", "").split(",", 1)[0].strip()
    proto = headers.get("x-forwarded-proto", "").split(",", 1)[0].strip().lower()
    if not host:
        return False
    forwarded = parse_origin(f"{proto or parsed[0]}://{host}")
    return forwarded == parsed


def origin_refusal(
    origins: PageOrigins,
    origin: str | list[str] | None,
    *,
    local: tuple[str, int] | None,
    remote: str | None,
    headers: Mapping[str, str],
) -> str | None:
    """Why a WebSocket handshake with ``Origin: origin`` is refused, or None when it is taken
    (see the module). ``origin``: the header's value, or every value the handshake has (more
    than one is refused); ``local``: the address and port of ours the connection reached (an
    ``Origin`` of that port is taken too, from the same names: paho sends the address it
    connects to as its ``Origin``); ``remote``: the address the connection comes from (a
    reverse proxy's headers are believed from ``origins.trusted`` only); ``headers``: the
    handshake's headers, names in lower case (``x-forwarded-host``, ``x-forwarded-proto``)."""
    if isinstance(origin, list):
        if len(origin) > 1:
            return "it sends more than one Origin"
        origin = origin[0] if origin else None
    if origin is None:
        return None
    parsed = parse_origin(origin)
    if parsed is None:
        return "its Origin is not a web page's"
    if origin.strip().lower().rstrip("/") in origins.allowed:
        return None
    scheme, host, port = parsed
    address, ports = (local[0], {origins.port, local[1]}) if local else (None, {origins.port})
    if scheme == "http" and port in ports and (host in origins.hosts or _same_address(host, address)):
        return None
    if any(_same_address(proxy, remote) for proxy in origins.trusted) and _forwarded(parsed, headers):
        return None
    return "its Origin is not the queue page's (http.allowed_origins lists others)"
