"""Each finished job notified once, whatever stops and starts in whatever order (issue "Home
Assistant: each job notified once"), in a real Home Assistant Core: the repository's blueprint
and the two automations of docs/home-assistant.md, loaded as written, each counting its
notifications, through orders of stops and starts of Home Assistant, edge-queue and the broker
(docs/home-assistant.md, "Jobs that end while Home Assistant is down").

Every notification goes to Home Assistant's ``persistent_notification`` (the phone of
``notify.mobile_app_my_phone`` is a notify group of it), which it keeps until it stops (or the
next test loads its configuration): they are collected before each stop of Home Assistant and at
the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import Broker, ServiceProcess, port_open, wait_until
from .helpers.figures import figures
from .helpers.ha_docs import BLUEPRINT, DOC_BASE, DOC_EVENT, blocks, notifications
from .homeassistant_support import (
    HOME_ASSISTANT_MARKS,
    entities,
    instance_id,
    reload_yaml,
    restart_home_assistant,
    service,
    wait_state,
)

pytestmark = HOME_ASSISTANT_MARKS


class Rig:
    """Home Assistant with the three automations, an edge-queue, and the tally of notifications:
    (automation, job input or ``missed``) -> count."""

    def __init__(self, h: Any, inst: dict[str, Any], broker: Broker, svc: ServiceProcess, media: Path) -> None:
        self.h, self.inst, self.broker, self.svc, self.media = h, inst, broker, svc, media
        self.tally: Counter[tuple[str, str]] = Counter()
        self.seen = 0  # notifications of this run of Home Assistant already counted
        self.n = 0
        self.w = svc.watcher("response/#", "jobs/+")
        self.ha_up = True
        self.e: dict[str, str] = {}  # entity ids by key, once discovered
        self.eq_up = True  # running, not frozen

    def count(self) -> None:
        """Add the notifications of this run of Home Assistant not counted yet."""
        sent = notifications(self.h, self.inst)
        for n in sent[self.seen :]:
            title, message = n.get("title") or "", n.get("message") or ""
            if "jobs ended while Home Assistant or the broker was away" in title:
                who = "ui" if title.endswith("was away") and "edge-queue: jobs" in title else "blueprint"
                self.tally[(who, "missed")] += 1
            elif title.startswith("Transcription "):
                self.tally[("ui", Path(message).name)] += 1
            elif message.endswith(": done"):
                self.tally[("events", Path(message.removesuffix(": done")).name)] += 1
            else:
                self.tally[("blueprint", Path(message).name)] += 1
        self.seen = len(sent)

    def quiet(self, what: str) -> None:
        """Home Assistant and edge-queue up and settled: what is owed has arrived."""
        e = self.e
        wait_state(self.h, self.inst, e["job_finished"], lambda s, a: s != "unavailable", what, 90)
        wait_state(self.h, self.inst, e["queued"], lambda s, a: s == "0", what, 90)
        time.sleep(3)  # a stale or late notification comes within a second of the states' return
        self.count()

    def job(self) -> str:
        """A noop job that succeeds; returns its input's name."""
        self.n += 1
        name = f"clip-{self.n:03d}.wav"
        (self.media / name).write_bytes(b"")
        body = {"kind": "noop", "input": str(self.media / name)}
        job_id = self.svc.request("submit", body, self.w)["data"]["jobs"][0]["job_id"]
        self.w.wait_json(f"{self.svc.base}/jobs/{job_id}", lambda m: m["state"] == "succeeded")
        if self.ha_up:  # it reaches the phone before whatever comes next

            def notified() -> bool:
                self.count()
                return self.tally[("blueprint", name)] >= 1 and self.tally[("ui", name)] >= 1

            wait_until(notified, 30, f"{name} notified", interval=0.1)
        return name

    def ha_stop(self) -> None:
        self.count()
        self.h.stop(self.inst)
        self.seen, self.ha_up = 0, False

    def ha_start(self) -> None:
        restart_home_assistant(self.h, self.inst)
        self.seen, self.ha_up = 0, True

    def eq_stop(self) -> None:
        self.w.close()
        assert self.svc.stop() == 0
        self.eq_up = False

    def eq_start(self) -> None:
        self.svc.start()
        self.w = self.svc.watcher("response/#", "jobs/+")
        self.eq_up = True

    def broker_restart(self) -> None:
        self.w.close()
        self.h.broker_stop(self.broker.port)
        wait_until(lambda: not port_open("127.0.0.1", self.broker.port), 20, "the broker to be gone")
        self.h.broker_start(self.broker.port)
        wait_until(lambda: port_open("127.0.0.1", self.broker.port), 20, "the broker back")
        wait_until(lambda: self._watch(), 30, "a watcher again")

    def _watch(self) -> bool:
        try:
            self.w = self.svc.watcher("response/#", "jobs/+")
        except (OSError, AssertionError):
            return False
        return True

    def freeze(self) -> None:
        assert self.svc.proc is not None
        os.kill(self.svc.proc.pid, signal.SIGSTOP)
        self.eq_up = False

    def thaw(self) -> None:
        assert self.svc.proc is not None
        os.kill(self.svc.proc.pid, signal.SIGCONT)
        self.eq_up = True


@pytest.fixture
def rig(ha: tuple[Any, dict[str, Any], Broker], tmp_path: Path) -> Iterator[Rig]:
    h, inst, broker = ha
    media = tmp_path / "media"
    media.mkdir()
    svc = service(broker, tmp_path, [media], "data", "eqn-" + tmp_path.name[-8:])
    svc.start()
    config = Path(inst["config"])
    r = Rig(h, inst, broker, svc, media)
    try:
        e = entities(h, inst, instance_id(svc), ["job_finished", "queued", "last_result"])
        r.e = e
        doc = blocks()

        def ours(text: str) -> str:
            # as the page tells its reader: their base topic, entity id, and the kind they want
            text = text.replace(DOC_BASE, svc.base + "/").replace(DOC_EVENT, e["job_finished"])
            return text.replace("kind == 'transcribe'", "kind == 'noop'")

        (config / "blueprints" / "automation" / "edge-queue").mkdir(parents=True, exist_ok=True)
        shutil.copy(BLUEPRINT, config / "blueprints" / "automation" / "edge-queue" / BLUEPRINT.name)
        ui = doc["ui_automation"].splitlines()
        (config / "automations.yaml").write_text(
            ours("\n".join(["- id: edge_queue_ui", *("  " + x for x in ui)]) + "\n" + doc["automations"])
            + "- id: edge_queue_blueprint\n"
            "  alias: edge-queue to my phone\n"
            "  use_blueprint:\n"
            f"    path: edge-queue/{BLUEPRINT.name}\n"
            "    input:\n"
            f"      job_finished: {e['job_finished']}\n"
            "      notify_action: notify.mobile_app_my_phone\n"
        )
        for name in ("scripts.yaml", "edge_queue_mqtt.yaml"):
            (config / name).write_text("{}\n")
        reload_yaml(h, inst)
        for eid in (
            "automation.edge_queue_to_my_phone",
            "automation.edge_queue_send_me_the_transcript",
            "automation.edge_queue_tell_my_phone_when_a_job_ends",
        ):
            wait_state(h, inst, eid, lambda s, a: s == "on", f"{eid} loaded")
        r.quiet("set up")
        yield r
    finally:
        r.w.close()
        if svc.proc is not None and svc.proc.poll() is None:
            os.kill(svc.proc.pid, signal.SIGCONT)
            svc.stop()
        if not port_open("127.0.0.1", broker.port):
            h.broker_start(broker.port)
        if not r.ha_up:
            r.ha_start()


#: Orders of stops and starts: (name, steps); a step is a Rig method, or "job" (one job ends,
#: counted: it must be notified once by the blueprint and the event-entity automation, and by
#: the MQTT-trigger automation when Home Assistant ran while it ended).
ORDERS: list[tuple[str, list[str]]] = [
    ("HA stop, edge-queue stop, HA start, edge-queue start, HA restart",
     ["ha_stop", "job", "eq_stop", "ha_start", "eq_start", "job", "ha_stop", "ha_start"]),
    ("graceful broker restart with HA up", ["job", "broker_restart", "job", "broker_restart"]),
    ("broker restart while edge-queue is frozen and HA down",
     ["ha_stop", "job", "freeze", "broker_restart", "ha_start", "thaw", "job", "ha_stop", "ha_start"]),
    ("edge-queue stop, HA restart, edge-queue start", ["job", "eq_stop", "ha_stop", "ha_start", "eq_start", "job"]),
    ("HA stop, broker restart, HA start", ["ha_stop", "job", "broker_restart", "ha_start", "job"]),
    ("HA stop, edge-queue restart twice, HA start", ["ha_stop", "job", "eq_stop", "eq_start", "job", "eq_stop",
                                                      "eq_start", "ha_start", "ha_stop", "ha_start"]),
    ("edge-queue stop, broker restart, edge-queue start", ["eq_stop", "broker_restart", "eq_start", "job"]),
    ("HA restart, edge-queue restart, broker restart", ["ha_stop", "ha_start", "eq_stop", "eq_start",
                                                         "broker_restart", "job", "ha_stop", "ha_start"]),
]  # fmt: skip


def run_order(r: Rig, steps: list[str]) -> tuple[list[str], list[str]]:
    """Run ``steps``; returns the jobs that ended and those of them that ended while Home
    Assistant ran."""
    jobs, seen_live = [], []
    settled = False  # the last step was a start after which Home Assistant and edge-queue were quiet
    for step in steps:
        settled = False
        if step == "job":
            name = r.job()
            jobs.append(name)
            if r.ha_up:
                seen_live.append(name)
        else:
            getattr(r, step)()
            if step in ("ha_start", "eq_start", "broker_restart", "thaw") and r.ha_up and r.eq_up:
                r.quiet(step)
                settled = True
    if r.ha_up and r.eq_up and not settled:
        r.quiet("the end")
    return jobs, seen_live


@pytest.mark.parametrize("name,steps", ORDERS, ids=[o[0] for o in ORDERS])
def test_each_finished_job_is_notified_once_whatever_restarts_in_whatever_order(
    rig: Rig, name: str, steps: list[str]
) -> None:
    # Given the blueprint and the page's two automations, notifying one phone
    # When jobs end between stops and starts of Home Assistant, edge-queue and the broker
    jobs, live = run_order(rig, steps)
    # Then the blueprint and the event-entity automation notify each job once (before: old
    # jobs again after some orders, one event fired twice across a broker restart)
    table = {who: {job: rig.tally[(who, job)] for job in jobs} for who in ("blueprint", "ui", "events")}
    figures(order=name, steps=steps, notifications=table)
    assert table["blueprint"] == dict.fromkeys(jobs, 1), (name, table, rig.svc.log()[-4000:])
    assert table["ui"] == dict.fromkeys(jobs, 1), (name, table)
    # and the MQTT-trigger automation, which sees only what happens while Home Assistant runs,
    # notifies no job twice
    assert all(table["events"][job] <= 1 for job in jobs), (name, table)
    assert not rig.tally[("blueprint", "missed")] and not rig.tally[("ui", "missed")], rig.tally


def test_a_burst_while_home_assistant_is_down_is_one_summary_and_the_newest(rig: Rig) -> None:
    # Given Home Assistant down while 12 jobs end
    rig.ha_stop()
    names = [rig.job() for _ in range(12)]
    # When it is back
    rig.ha_start()
    rig.quiet("back")
    # Then each automation notifies one summary and the newest job, and "Job finished" and
    # "Last result" show the same, newest job (before: the first 100 of 120, one by one, and
    # never the newest 20)
    assert rig.tally[("blueprint", "missed")] == 1 and rig.tally[("ui", "missed")] == 1, rig.tally
    assert rig.tally[("blueprint", names[-1])] == 1 and rig.tally[("ui", names[-1])] == 1, rig.tally
    assert sum(rig.tally[("blueprint", n)] for n in names[:-1]) == 0, rig.tally
    finished = rig.h.state(rig.inst, rig.e["job_finished"])["attributes"]
    last = rig.h.state(rig.inst, rig.e["last_result"])["attributes"]
    assert finished["job_id"] == last["job_id"] and Path(finished["input"]).name == names[-1], (finished, last)
    summaries = [n for n in notifications(rig.h, rig.inst) if "jobs ended" in (n.get("title") or "")]
    # one from the blueprint, one from the page's automation: the summary counts every missed job
    assert len(summaries) == 2 and all(
        n["message"].startswith("12 jobs ended while Home Assistant or the broker was away: 12 succeeded")
        for n in summaries
    ), summaries
    figures(summary=summaries)


def test_a_burst_of_jobs_ending_together_is_notified_by_every_automation(rig: Rig) -> None:
    # Given 31 jobs that end within moments of each other, Home Assistant up
    # (before: the MQTT-trigger automation's mode: queued kept 10 waiting and dropped the rest)
    body = {"kind": "noop", "inputs": [str(rig.media / f"b{i:02d}.wav") for i in range(31)]}
    for i in range(31):
        (rig.media / f"b{i:02d}.wav").write_bytes(b"")
    answer = rig.svc.request("submit", body, rig.w)
    ids = [j["job_id"] for j in answer["data"]["jobs"]]
    for job_id in ids:
        rig.w.wait_json(f"{rig.svc.base}/jobs/{job_id}", lambda m: m["state"] == "succeeded")
    wait_until(
        lambda: (rig.count() or True) and sum(rig.tally[("events", f"b{i:02d}.wav")] for i in range(31)) >= 31,
        120,
        "every notification of the MQTT-trigger automation",
        interval=0.1,
    )
    rig.quiet("the burst")
    for who in ("blueprint", "ui", "events"):
        got = {f"b{i:02d}.wav": rig.tally[(who, f"b{i:02d}.wav")] for i in range(31)}
        assert got == dict.fromkeys(got, 1), (who, got)
