"""edge-queue: an MQTT-native job queue appliance for media work on home and edge boxes."""

from __future__ import annotations


def package_version() -> str:
    """edge-queue's installed version, or ``0+unknown`` when it runs from a source tree.

    ``importlib.metadata`` is imported here, not at the top: the command's entry point imports
    this package before it has set up its handling of Ctrl-C (``cli.launch``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("edge-queue")
    except PackageNotFoundError:
        return "0+unknown"
