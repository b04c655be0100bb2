"""Watch folders: the file-system half (``watcher``, ``files``) and the service's half (``folders``)."""
