"""The HTTP side: the queue page's server (``page``); the page's own files are in ``edge_queue/web/``."""
