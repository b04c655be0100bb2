"""Compatibility import for amqtt configurations that name ``edge_queue.amqtt_plugins.ReservedClientIds``
(broker/amqtt.yaml before the plug-in moved to :mod:`edge_queue.mqtt.amqtt_plugins`): amqtt loads
plug-ins by import path, so an ``amqtt.yaml`` copied from an earlier release keeps its reserved
client ids."""

from edge_queue.mqtt.amqtt_plugins import ReservedClientIds

__all__ = ["ReservedClientIds"]
