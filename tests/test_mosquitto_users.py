"""compose's mosquitto container turns ``MQTT_USERS`` into its password file on every start
(container/mosquitto/entrypoint.sh; docs/install.md, Compose).

The real script runs with the real ``mosquitto_passwd`` and ``openssl``, then execs a real
mosquitto on a free port with that password file; the logins are tried with a real client.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from .conftest import need, port_open, wait_until
from .helpers.ports import free_port

SCRIPT = Path(__file__).resolve().parents[1] / "container" / "mosquitto" / "entrypoint.sh"


class Entrypoint:
    """The entrypoint on a password file and a mosquitto configuration of this test's own."""

    def __init__(self, tmp: Path) -> None:
        need(all(shutil.which(t) for t in ("mosquitto", "mosquitto_passwd", "openssl")), "mosquitto, openssl needed")
        self.passwd = tmp / "edge-queue.passwd"
        self.port = free_port()
        self.conf = tmp / "mosquitto.conf"
        self.conf.write_text(
            f"listener {self.port} 127.0.0.1\nallow_anonymous false\npassword_file {self.passwd}\n"
            f"persistence false\nlog_dest stderr\n" + ("user root\n" if os.geteuid() == 0 else "")
            # as root, mosquitto drops to user mosquitto, who cannot read a test's private folder
        )
        self.tmp = tmp
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, users: str) -> tuple[subprocess.Popen[str], str]:
        """Run the script with ``MQTT_USERS=users`` in ``tmp`` (files there that a glob could
        match); the broker it execs, or its exit, and what it said before the broker started."""
        env = {
            **os.environ,
            "MQTT_USERS": users,
            "MQTT_PASSWORD_FILE": str(self.passwd),
            "MOSQUITTO_CONF": str(self.conf),
        }
        proc = subprocess.Popen(
            ["sh", str(SCRIPT)], env=env, cwd=self.tmp, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        self.procs.append(proc)
        wait_until(lambda: proc.poll() is not None or port_open("127.0.0.1", self.port), 30, "the broker or an exit")
        if proc.poll() is not None:
            return proc, proc.stderr.read() if proc.stderr else ""
        return proc, ""

    def stop(self, proc: subprocess.Popen[str]) -> str:
        """Stop the broker; everything the script and the broker wrote to standard error."""
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        return err

    def login(self, user: str, password: str) -> bool:
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311)
        client.username_pw_set(user, password)
        try:
            client.connect("127.0.0.1", self.port, 5)
        except OSError:
            return False
        result: list[bool] = []
        client.on_connect = lambda c, u, f, rc, p: result.append(not rc.is_failure)
        client.loop_start()
        try:
            wait_until(lambda: result or not client.is_connected() and result, 10, "CONNACK")
        finally:
            client.loop_stop()
            client.disconnect()
        return bool(result and result[0])

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            if proc.stderr:
                proc.stderr.close()


@pytest.fixture
def entry(tmp_path: Path) -> Iterator[Entrypoint]:
    e = Entrypoint(tmp_path)
    yield e
    e.close()


def users_in(passwd: Path) -> list[str]:
    return [line.split(":", 1)[0] for line in passwd.read_text().splitlines() if line]


def test_a_user_whose_name_a_pattern_would_match_is_added(entry: Entrypoint) -> None:
    # Given alice stored; when MQTT_USERS adds 'a.ice' (before: skipped, grep's '.' matched 'l')
    proc, _ = entry.start("edge-queue:pw-eq-1 alice:pw-alice-1")
    entry.stop(proc)
    proc, _ = entry.start("edge-queue:pw-eq-1 alice:pw-alice-1 a.ice:pw-aice-1")
    try:
        # Then a.ice is a user of its own and logs in
        assert users_in(entry.passwd) == ["edge-queue", "alice", "a.ice"]
        assert entry.login("a.ice", "pw-aice-1") and entry.login("alice", "pw-alice-1")
    finally:
        entry.stop(proc)


def test_a_password_of_a_star_is_not_expanded(entry: Entrypoint) -> None:
    # Given a file 'bob:guess' in the folder the script starts in, and bob's password '*'
    # (before: the shell expanded 'bob:*' to that file's name, and bob's password was 'guess')
    (entry.tmp / "bob:guess").write_text("")
    proc, err = entry.start("edge-queue:pw-eq-1 bob:*")
    try:
        assert proc.poll() is None, err
        assert users_in(entry.passwd) == ["edge-queue", "bob"]
        assert entry.login("bob", "*") and not entry.login("bob", "guess")
    finally:
        entry.stop(proc)


def test_a_changed_password_replaces_the_stored_one_with_a_line(entry: Entrypoint) -> None:
    proc, _ = entry.start("edge-queue:pw-eq-1 carol:old-pw-9")
    entry.stop(proc)
    # When .env gives carol a new password (before: silently ignored, the old one still held)
    proc, _ = entry.start("edge-queue:pw-eq-1 carol:new-pw-7")
    try:
        assert entry.login("carol", "new-pw-7") and not entry.login("carol", "old-pw-9")
    finally:
        err = entry.stop(proc)
    lines = [line for line in err.splitlines() if line.startswith("MQTT_USERS:")]
    assert lines == [
        "MQTT_USERS: the password of 'carol' differs from the one stored: the broker now takes the one in MQTT_USERS"
    ], err
    # And an unchanged password says nothing and keeps its stored entry
    stored = entry.passwd.read_text()
    proc, _ = entry.start("edge-queue:pw-eq-1 carol:new-pw-7")
    err = entry.stop(proc)
    assert "MQTT_USERS" not in err and entry.passwd.read_text() == stored, err


def test_the_example_passwords_are_refused(entry: Entrypoint) -> None:
    # Given compose.env.example's passwords copied as they are (before: the broker started,
    # 1883 and 9001 on the LAN without TLS, with passwords anyone can read in the repository)
    example = (SCRIPT.parents[1] / "compose.env.example").read_text()
    users = next(line.split("=", 1)[1] for line in example.splitlines() if line.startswith("MQTT_USERS="))
    proc, err = entry.start(f"edge-queue:pw-eq-1 {users}")
    assert proc.returncode == 2, err
    assert "MQTT_USERS: 'phone' still has the example password 'change-me-phone'" in err, err
    assert not port_open("127.0.0.1", entry.port)
