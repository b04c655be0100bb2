"""Rules for one configuration value at a time, used by :mod:`edge_queue.config`'s validators:
host names and addresses, origins, and the broker user names of ``[access]`` (docs/configuration.md).
Plain functions and patterns: they import nothing of the package.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated

from pydantic import AfterValidator

#: A host name (RFC 1123 section 2.1; RFC 3696 section 2: the last label is not all digits,
#: so ``999.1.1.1`` is neither a name nor an address).
_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def host_problem(host: str) -> str | None:
    """Why ``host`` is neither an IP address nor a host name (RFC 1123), or None."""
    try:
        ipaddress.ip_address(host.strip("[]"))
        return None
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if len(host) > 253 or not all(_HOST_LABEL.match(label) for label in labels):
        return (
            f"{host[:100]!r} is neither an IP address nor a host name (letters, digits and '-' in dot-separated labels)"
        )
    if labels[-1].isdigit():
        return f"{host[:100]!r} is not an IP address (each of the four numbers is 0-255), nor a host name"
    return None


def origin_problem(origin: str) -> str | None:
    """Why ``origin`` is not a web origin of scheme, host and port (``http://nas.local:8099``), or None."""
    if re.fullmatch(r"https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?", origin):
        return None
    return (
        f"{origin[:100]!r} is not an origin: scheme, host and port only, "
        'like "http://homeassistant.local:8123" (no path, no wildcard, no trailing /)'
    )


def ip_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` as an IP address, the way a listener sees it: brackets and an IPv6 zone
    (``%eth0``) left out, an IPv4-mapped IPv6 address (``::ffff:172.30.32.2``, how a
    dual-stack listener on ``::`` sees an IPv4 client) as its IPv4 address; None for a name."""
    try:
        ip = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    return (ip.ipv4_mapped or ip) if isinstance(ip, ipaddress.IPv6Address) else ip


def canonical_address(address: str) -> str:
    """``address`` in one spelling per host (:func:`ip_of`, compressed), so that a client
    address compares equal to a configured one whatever form either arrives in; a name is
    returned as it is."""
    ip = ip_of(address)
    return address if ip is None else str(ip)


def is_loopback(host: str) -> bool:
    """``host`` (an address in any of its spellings, or ``localhost``) reaches this box only."""
    if host == "localhost":
        return True
    ip = ip_of(host)
    return ip is not None and ip.is_loopback


def address_problem(address: str) -> str | None:
    """Why ``address`` is not an IP address (a proxy's, ``172.30.32.2``), or None."""
    try:
        ipaddress.ip_address(address)
        return None
    except ValueError:
        return f'{address[:100]!r} is not an IP address (a proxy\'s, like "172.30.32.2")'


#: What a broker user name in ``[access]`` may not hold: it is a topic level of the ACL's
#: ``%u`` patterns (``<base>/request/<command>/<user>``), where ``/`` would add levels and
#: ``+`` and ``#`` are wildcards (mosquitto denies %u patterns to such names).
NOT_IN_USER = re.compile(r"[/+#\x00-\x1f\x7f]")
#: A worker node's broker user name: its node id, a topic level of ``<base>/nodes/<node_id>``.
NODE_ID_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"


def checked_host(host: str) -> str:
    """``host`` itself; raises ``ValueError`` with :func:`host_problem`'s reason."""
    if (problem := host_problem(host)) is not None:
        raise ValueError(problem)
    return host


#: A setting's host: an IP address or a host name (RFC 1123), checked by :func:`checked_host`.
Host = Annotated[str, AfterValidator(checked_host)]
