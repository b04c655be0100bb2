"""Zeroconf for the Wyoming listener (``wyoming.zeroconf``): the listener announced by mDNS
(DNS-SD, RFC 6762/6763) as ``<name>._wyoming._tcp.local.`` with its address and port, the service
type Home Assistant's ``wyoming`` integration browses for (``zeroconf`` in its manifest), so
Home Assistant offers it under Settings → Devices & services → Discovered without anyone typing
an address. Goodbye packets at stop withdraw it.

Through python-zeroconf (``zeroconf.asyncio``), the library Home Assistant browses with, on the
listener's own asyncio loop: the announcement's probing (about 1.5 s) never delays the service.
It is imported only when an announcement is made (some 100 ms and 14 MiB).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from typing import TYPE_CHECKING

from edge_queue.config.settings import Settings
from edge_queue.config.values import ip_of, is_loopback
from edge_queue.publish.discovery import device_name

if TYPE_CHECKING:
    from zeroconf.asyncio import AsyncZeroconf

log = logging.getLogger(__name__)

#: The DNS-SD service type of Wyoming servers (Home Assistant's wyoming manifest).
SERVICE_TYPE = "_wyoming._tcp.local."
#: The mDNS IPv4 group: the interface a datagram to it leaves by is the one announced.
MDNS_GROUP = "224.0.0.251"
#: Bytes of a DNS label, at most (RFC 1035): the instance name is cut to it.
MAX_LABEL_BYTES = 63


def announced_address(host: str) -> str | None:
    """The IPv4 address announced for a listener on ``host`` (``wyoming.host``).

    - every interface (``0.0.0.0``, ``::``, empty): the address of the interface the box
      reaches the mDNS group through (its LAN address);
    - an IPv4 address (an IPv4-mapped IPv6 one too): itself;
    - a host name: the first IPv4 address it resolves to.

    ``None`` when nothing on the LAN could reach the listener (a loopback address), or when no
    address is found (no network: the caller logs it). Never raises.
    """
    if host in ("", "0.0.0.0", "::"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((MDNS_GROUP, 5353))  # no datagram is sent: only a route is chosen
                address = str(probe.getsockname()[0])
        except OSError:
            return None
        return None if is_loopback(address) or address == "0.0.0.0" else address
    ip = ip_of(host)
    if ip is None:
        try:
            found = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
        except OSError:
            return None
        ip = ipaddress.ip_address(found[0][4][0]) if found else None
    if ip is None or ip.version != 4 or is_loopback(str(ip)):
        return None
    return str(ip)


def instance_name(settings: Settings, instance_id: str = "") -> str:
    """The service instance's name: the Home Assistant device's (``homeassistant.name``, else
    ``edge-queue <host name>``, with the base topic when it is not the default), so the two
    entries of one installation read alike, then the first 6 digits of the installation's id
    (``edge-queue raspberrypi 3f7c9a``): two boxes of the same host name, or a name another
    host announced first, are not one service to Home Assistant (mDNS's own conflict check
    sees only hosts that answer its probes). At most :data:`MAX_LABEL_BYTES` bytes of UTF-8."""
    name = device_name(settings.homeassistant.name, socket.gethostname(), settings.mqtt.base_topic)
    suffix = f" {instance_id[:6]}" if instance_id else ""
    room = MAX_LABEL_BYTES - len(suffix.encode())
    return (name.encode()[:room].decode(errors="ignore").strip() or "edge-queue") + suffix


class Announcement:
    """One listener's announcement: :meth:`start` and :meth:`stop` run on the listener's loop."""

    def __init__(self, name: str, address: str, port: int, ttl_s: int = 120) -> None:
        from zeroconf.asyncio import AsyncServiceInfo

        self.info = AsyncServiceInfo(
            SERVICE_TYPE,
            f"{name}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(address)],
            port=port,
            server=f"{socket.gethostname().split('.')[0]}.local.",
            # every record lives 2 minutes (python-zeroconf gives the service's 75): a service
            # killed without its goodbye leaves a browser's list within 2 minutes
            host_ttl=ttl_s,
            other_ttl=ttl_s,
        )
        self.zeroconf: AsyncZeroconf | None = None

    @property
    def name(self) -> str:
        """The announced instance's full name (``<name>._wyoming._tcp.local.``; renamed by
        python-zeroconf when a host that answers its probes has the name)."""
        return str(self.info.name)

    async def start(self) -> None:
        """Probe for the name and announce it (about 1.5 s). Errors are logged, not raised: the
        listener serves without it, added by hand in Home Assistant."""
        from zeroconf import IPVersion
        from zeroconf.asyncio import AsyncZeroconf

        try:
            self.zeroconf = AsyncZeroconf(ip_version=IPVersion.V4Only)
            registered = await self.zeroconf.async_register_service(self.info, allow_name_change=True)
            await registered
        except Exception as e:  # no multicast route, a socket refused: the service runs without it
            log.warning("Wyoming: not announced by zeroconf (add it by address in Home Assistant): %s", e)
            await self.stop()
            return
        log.info("Wyoming: announced by zeroconf as %r", self.name)

    async def stop(self) -> None:
        """Withdraw the announcement (goodbye packets) and close the mDNS sockets."""
        zeroconf, self.zeroconf = self.zeroconf, None
        if zeroconf is None:
            return
        try:
            await zeroconf.async_unregister_all_services()
        finally:
            await zeroconf.async_close()


def announcement(settings: Settings, port: int, instance_id: str = "") -> Announcement | None:
    """The announcement of a listener bound on ``port`` when ``wyoming.zeroconf`` is on and the
    listener is reachable from the LAN (named by :func:`instance_name`); ``None`` otherwise
    (logged when it was asked for)."""
    if not settings.wyoming.zeroconf:
        return None
    address = announced_address(settings.wyoming.host)
    if address is None:
        log.info("Wyoming: not announced by zeroconf: %s is not reachable from the LAN", settings.wyoming.host)
        return None
    return Announcement(instance_name(settings, instance_id), address, port)
