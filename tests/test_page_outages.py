"""The queue page through outages (docs/operations.md, "The queue page"): after a broker
outage every read the page makes is asked again until edge-queue answers it, and while
edge-queue is offline its actions are disabled, or, sent just before it went away, shown
waiting and never reported as failed when they later take effect. A real chromium, a real
mosquitto with a WebSocket listener, the real service; edge-queue is held with SIGSTOP where
the test needs it to answer late (it then resumes, reconnects, and answers from its session).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import Broker, ServiceProcess, Watcher, port_open, wait_until
from .helpers.brokers import PrivateMosquitto
from .helpers.page import Browser, page_service
from .helpers.ports import free_port

STATUS = "document.querySelector('#status').dataset.state"
BANNER = "document.querySelector('#broker')"
#: the banner is shown, whole, inside a phone's screen, and is not wider than it
BANNER_READABLE = f"""(() => {{ const b = {BANNER}, r = b.getBoundingClientRect();
  return !b.hidden && r.height > 0 && r.top >= 0 && r.bottom <= innerHeight && r.right <= innerWidth
    && b.scrollWidth <= b.clientWidth && parseFloat(getComputedStyle(b).fontSize) >= 13
    && document.documentElement.scrollWidth <= innerWidth; }})()"""


@pytest.fixture
def forgetful_mosquitto(tmp_path: Path) -> Iterator[Broker]:
    """A private mosquitto with a WebSocket listener that keeps nothing across a restart (no
    persistence: mosquitto's own default, and the embedded amqtt broker's way): no retained
    status, no session of edge-queue."""
    ws = free_port()
    broker = PrivateMosquitto(tmp_path / "forgetful", extra=f"listener {ws}\nprotocol websockets\npersistence false\n")
    broker.ws_port = ws
    wait_until(lambda: port_open("127.0.0.1", ws), 10, "the WebSocket listener")
    yield broker
    if broker.proc is not None and broker.proc.poll() is None:
        broker.stop()


@pytest.fixture
def held() -> Iterator[list[ServiceProcess]]:
    """Services this test holds with SIGSTOP: let go again at the end, whatever happens."""
    stopped: list[ServiceProcess] = []
    yield stopped
    for svc in stopped:
        if svc.proc is not None and svc.proc.poll() is None:
            os.kill(svc.proc.pid, signal.SIGCONT)


def _hold(svc: ServiceProcess, held: list[ServiceProcess]) -> None:
    held.append(svc)
    os.kill(svc.proc.pid, signal.SIGSTOP)


def _let_go(svc: ServiceProcess, held: list[ServiceProcess]) -> None:
    os.kill(svc.proc.pid, signal.SIGCONT)
    held.remove(svc)


def _noop_done(svc: ServiceProcess, **options: object) -> str:
    w = svc.watcher("#")
    try:
        job_id = svc.request("submit", {"kind": "noop", "options": options}, w)["data"]["jobs"][0]["job_id"]
        w.wait_json(f"{svc.base}/events", lambda e: e["type"] == "end" and e["job"]["job_id"] == job_id)
    finally:
        w.close()
    return job_id


@pytest.mark.slow
@pytest.mark.serial
def test_a_page_opened_during_a_broker_outage_reads_the_jobs_once_edge_queue_answers(
    forgetful_mosquitto: Broker,
    service_factory,
    browser: Browser,
    tmp_path: Path,
    artifacts: Path,
    held: list,
) -> None:
    media = tmp_path / "media"
    media.mkdir()
    svc, url = page_service(service_factory, forgetful_mosquitto, media, forgetful_mosquitto.ws_port)
    # Given a finished job
    _noop_done(svc)
    # When the page is opened while the broker is down, and edge-queue is held so that it
    # comes back after the page (its HTTP server too: the page is loaded first)
    forgetful_mosquitto.stop()
    browser.do("emulate", width=390, height=844, color_scheme="light")
    browser.do("goto", url=url)
    browser.wait(f"{STATUS} === 'connecting'")
    # Then the page says why in words under the header, readable on a phone (before: only a
    # grey "connecting" pill, the reason in tooltips that a phone never shows)
    browser.wait(BANNER_READABLE, timeout=15)
    banner = browser.eval(f"{BANNER}.textContent")
    assert banner.startswith("Not connected to the broker: cannot reach"), banner
    assert f":{forgetful_mosquitto.ws_port}/" in banner and "are off until it is back" in banner, banner
    assert browser.eval("document.querySelector('#add').disabled && document.querySelector('#pause').disabled")
    browser.do("screenshot", path=str(artifacts / "outage-connecting.png"))
    _hold(svc, held)
    forgetful_mosquitto.start()
    requests = Watcher(forgetful_mosquitto.host, forgetful_mosquitto.port, [f"{svc.base}/request/list"])
    try:
        # the page connects and asks for the jobs: the broker, new, has no status of edge-queue
        # and no session to keep the request for it; no answer comes while edge-queue is held,
        # for longer than the 20 s the page once waited: it asks again (three asks take over 20 s)
        browser.wait(f"{STATUS} === 'connecting' && page.connected", timeout=30)
        assert browser.eval(f"{BANNER}.hidden")  # connected: the broker is back
        wait_until(lambda: len(requests.on(f"{svc.base}/request/list")) >= 3, 60, "the page asking for the list again")
        asked = [json.loads(p) for p in requests.on(f"{svc.base}/request/list")]
        assert len({a["transaction"] for a in asked}) == len(asked)
        assert browser.eval("document.querySelector('#notice').hidden"), browser.eval(
            "document.querySelector('#notice').textContent"
        )
        assert browser.eval("document.querySelector('#add').disabled")  # nothing read yet
        assert not browser.eval("document.querySelector('#loading').hidden")  # and it says so
    finally:
        requests.close()
    # Then once edge-queue runs again, the page shows the job, the count, and Add files
    _let_go(svc, held)
    browser.wait("document.querySelectorAll('#jobs .job').length === 1", timeout=60)
    browser.wait("!document.querySelector('#add').disabled")
    assert browser.eval("document.querySelector('#shown').textContent") == "1 of 1 job"
    assert browser.eval("document.querySelector('#notice').hidden")
    assert browser.eval("document.querySelector('#loading').hidden")
    assert browser.eval(f"{BANNER}.hidden")
    browser.do("screenshot", path=str(artifacts / "outage-after.png"))
    # When the broker goes away under the open page, the banner comes back with the reason,
    # in the dark theme too, and the buttons are off
    forgetful_mosquitto.stop()
    browser.do("emulate", width=390, height=844, color_scheme="dark")
    browser.wait(f"{BANNER_READABLE} && document.querySelector('#add').disabled", timeout=30)
    assert browser.eval(f"{BANNER}.textContent").startswith("Not connected to the broker: "), browser.eval(
        f"{BANNER}.textContent"
    )
    assert browser.do("axe") == []
    browser.do("screenshot", path=str(artifacts / "outage-lost-phone-dark.png"))
    # and it goes once the broker is back
    forgetful_mosquitto.start()
    browser.wait(f"page.connected && {BANNER}.hidden", timeout=30)
    print(f"screenshots: {artifacts}/outage-connecting.png, outage-after.png, outage-lost-phone-dark.png")


@pytest.mark.slow
@pytest.mark.serial
def test_offline_means_offline_and_an_action_sent_before_is_never_called_failed(
    ws_mosquitto: Broker,
    service_factory,
    browser: Browser,
    tmp_path: Path,
    artifacts: Path,
    held: list,
) -> None:
    media = tmp_path / "media"
    media.mkdir()
    svc, url = page_service(service_factory, ws_mosquitto, media, ws_mosquitto.ws_port)
    # Given a cancelled job on the page
    w = svc.watcher("#")
    try:
        job_id = svc.request("submit", {"kind": "noop", "options": {"sleep_s": 60}}, w)["data"]["jobs"][0]["job_id"]
        w.wait_json(f"{svc.base}/events", lambda e: e["job"]["job_id"] == job_id and e["job"]["state"] == "running")
        svc.request("cancel", {"job_id": job_id}, w)
        w.wait_json(f"{svc.base}/events", lambda e: e["type"] == "end" and e["job"]["job_id"] == job_id)
    finally:
        w.close()
    browser.do("goto", url=url)
    button = f"document.querySelector('#jobs .job[data-id={json.dumps(job_id)}] .act button')"
    browser.wait(f"{button} && {button}.textContent === 'Retry' && !{button}.disabled")
    browser.wait("!document.querySelector('#add').disabled && !document.querySelector('#pause').disabled")

    # When edge-queue does not answer (held) and Retry is pressed
    _hold(svc, held)
    browser.do("click", selector=f"#jobs .job[data-id={json.dumps(job_id)}] .act button")
    # Then the row shows the retry waiting, a toast says it waits for edge-queue
    browser.wait(f"{button}.textContent === 'Retrying…' && {button}.disabled")
    browser.wait(
        "[...document.querySelectorAll('.toast[data-state=info]')]"
        ".some(t => t.textContent.includes('waiting for edge-queue'))",
        timeout=30,
    )
    clicked = time.monotonic()
    browser.do("screenshot", path=str(artifacts / "retry-waiting.png"))
    # and no failure comes, also past the 20 s the page once waited before saying "Could not
    # retry" (a failure, if any, would show by then: the page has no later deadline)
    browser.wait("window.__since = window.__since || performance.now(), performance.now() - window.__since > 17000", 40)
    assert time.monotonic() - clicked > 17
    assert not browser.eval("document.querySelector('.toast[data-state=failed]')")
    # When edge-queue runs again, the retry takes effect and the row follows; still no failure
    _let_go(svc, held)
    browser.wait(f"document.querySelector('#jobs .job[data-id={json.dumps(job_id)}]').dataset.state === 'running'", 60)
    browser.wait(f"{button}.textContent === 'Cancel' && !{button}.disabled")
    assert not browser.eval("document.querySelector('.toast[data-state=failed]')")

    # When Pause is pressed while edge-queue does not answer, the button says it is on its way
    # (before: only greyed out, its label unchanged), and it takes effect once edge-queue runs
    _hold(svc, held)
    browser.do("click", selector="#pause")
    pause = "document.querySelector('#pause')"
    browser.wait(f"{pause}.textContent === 'Pausing…' && {pause}.disabled")
    _let_go(svc, held)
    browser.wait(f"{pause}.textContent === 'Resume' && !document.querySelector('#paused').hidden")

    # When edge-queue stops, everything that would send a request is disabled, and the page
    # says why
    assert svc.stop() == 0
    browser.wait(f"{STATUS} === 'offline'", timeout=30)
    browser.wait("!document.querySelector('#offline').hidden")
    assert "edge-queue is offline" in browser.eval("document.querySelector('#offline').textContent")
    assert browser.eval(f"{BANNER}.hidden")  # the broker is there: only edge-queue is away
    assert browser.eval("document.querySelector('#add').disabled && document.querySelector('#pause').disabled")
    assert browser.eval(f"document.querySelector('#jobs .job[data-id={json.dumps(job_id)}]').dataset.state") in {
        "running",
        "queued",
        "retrying",
    }
    assert browser.eval(f"{button}.disabled")
    row = f"document.querySelector('#jobs .job[data-id={json.dumps(job_id)}]')"
    if browser.eval(f"{row}.dataset.state") == "queued":  # put back by the stop
        assert browser.eval(f"{row}.querySelector('.ptext').textContent") == "waiting: edge-queue is offline"
    browser.do("click", selector=f"#jobs .job[data-id={json.dumps(job_id)}] .name")
    browser.wait("document.querySelector('#detail').open")
    assert browser.eval("document.querySelector('#d-cancel').disabled")
    browser.do("screenshot", path=str(artifacts / "offline.png"))
    browser.do("emulate", width=390, height=844, color_scheme="dark")
    browser.do("press", selector="#detail .sheet-head button", key="Enter")
    browser.do("screenshot", path=str(artifacts / "offline-phone-dark.png"))
    assert not browser.eval("document.querySelector('.toast[data-state=failed]')")
    print(f"screenshots: {artifacts}/retry-waiting.png, offline.png, offline-phone-dark.png")
