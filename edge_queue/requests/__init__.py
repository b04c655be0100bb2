"""Requests: from a message taken off the inbox to its answer (``dispatch``), the commands (``commands``,
``browse``) and the ports they use instead of the service (``ports``)."""
