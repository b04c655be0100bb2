"""A mosquitto of a test's own, with the delivery settings of the shipped broker/mosquitto.conf."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from pathlib import Path

from ..conftest import ROOT, Broker, need, port_open, stop_mosquitto, wait_until
from .ports import free_port


def _shipped_delivery_settings() -> str:
    keep = ("max_queued_messages", "max_inflight_messages", "set_tcp_nodelay", "max_queued_bytes", "max_packet_size")
    lines = (ROOT / "broker" / "mosquitto.conf").read_text().splitlines()
    return "".join(line.strip() + "\n" for line in lines if line.strip().split(" ")[0] in keep)


class PrivateMosquitto(Broker):
    """A mosquitto of our own, configured like broker/mosquitto.conf for delivery (no
    authentication), with persistence in its own folder; it can be stopped and started.
    ``extra`` is appended to its configuration (an ``acl_file`` line, say); ``tcp_nodelay=False``
    leaves out ``set_tcp_nodelay``, as mosquitto's own default configuration does."""

    def __init__(self, folder: Path, *, limit_packets: bool = True, tcp_nodelay: bool = True, extra: str = "") -> None:
        need(shutil.which("mosquitto") is not None, "mosquitto not installed (apt-get install mosquitto)")
        super().__init__("127.0.0.1", free_port(), "mosquitto")
        folder.mkdir(parents=True, exist_ok=True)
        settings = _shipped_delivery_settings()
        if not limit_packets:
            settings = "".join(line + "\n" for line in settings.splitlines() if not line.startswith("max_packet_size"))
        if not tcp_nodelay:
            settings = "".join(line + "\n" for line in settings.splitlines() if not line.startswith("set_tcp_nodelay"))
        self.conf = folder / "mosquitto.conf"
        self.conf.write_text(
            # mosquitto started as root drops to the user "mosquitto", who cannot write (or read)
            # the test's private folder: it keeps the user it was started as instead
            f"user {pwd.getpwuid(os.geteuid()).pw_name}\n"
            f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence true\n"
            f"persistence_location {folder}/\nlog_dest file {folder}/mosquitto.log\n" + settings + extra
        )
        self.log = folder / "mosquitto.log"
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(["mosquitto", "-c", str(self.conf)], stderr=subprocess.DEVNULL)
        wait_until(lambda: port_open(self.host, self.port), 10, "the private mosquitto to listen")

    def stop(self) -> None:
        assert self.proc is not None
        stop_mosquitto(self.proc)
