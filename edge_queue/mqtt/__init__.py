"""MQTT: the service's connection (``bridge``, ``outbox``, ``paho_client``, ``takeover``, ``probe``), the wire
(``topics``, ``payloads``), the request client, the installation check, the retained scan, and the
embedded amqtt broker with its plug-ins."""
