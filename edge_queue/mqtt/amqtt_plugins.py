"""amqtt plug-ins shipped with edge-queue, named in ``broker/amqtt.yaml`` (amqtt loads them by
their import path; nothing else imports this module).

:class:`ReservedClientIds` keeps the service's MQTT client id its own: amqtt, like MQTT itself,
lets any client connect with any client id, and a client that takes the service's id takes
over its session (broker/README.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from amqtt.plugins.base import BaseAuthPlugin
from amqtt.session import Session

log = logging.getLogger(__name__)


class ReservedClientIds(BaseAuthPlugin):
    """Refuse a connection whose client id begins with a reserved prefix unless it logs in as
    that prefix's user. Every other connection is left to the other authentication plug-ins
    (``authenticate`` returns ``None``: amqtt then ignores this plug-in's answer).

    Configuration (``plugins: {edge_queue.mqtt.amqtt_plugins.ReservedClientIds: {reserved: {...}}}``):
    ``reserved`` maps a client id prefix to the one broker user name that may use it; the
    default reserves ``edge-queue-`` (the service's ``edge-queue-<instance id>-<secret>``, and its probe,
    check and scan connections) for the user ``edge-queue``.
    """

    @dataclass
    class Config:
        reserved: dict[str, str] = field(default_factory=lambda: {"edge-queue-": "edge-queue"})

    async def authenticate(self, *, session: Session) -> bool | None:
        client_id = session.client_id or ""
        config = self.context.config
        reserved: dict[str, str] = getattr(config, "reserved", None) or {"edge-queue-": "edge-queue"}
        for prefix, user in reserved.items():
            if client_id.startswith(prefix) and session.username != user:
                log.warning(
                    "embedded broker: refused client id %r for user %r: ids beginning with %r are reserved for user %r",
                    client_id[:64],
                    (session.username or "")[:64],
                    prefix,
                    user,
                )
                return False
        return None
