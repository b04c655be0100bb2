"""The worker pool: the supervisor, the worker processes, and what runs inside one (``worker``)."""
