"""What the service publishes: retained job state and events (``publisher``), status, info and
Home Assistant discovery (``announce``, ``discovery``), finished jobs for Home Assistant (``ha_finished``)."""
