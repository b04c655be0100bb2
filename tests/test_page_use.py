"""Using the queue page (docs/operations.md, "The queue page"), in a real chromium against the
real service: finding any job (pages of 100, the count, the filter by state, kind and file
name, count cards that filter), the keyboard and screen readers (axe-core, WCAG 2.x A and AA,
in both themes, on the list, a job's detail and the picker), and a transcript's downloads,
which must be the transcription's own output files, byte for byte.
"""

from __future__ import annotations

import functools
import json
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from pydantic import ValidationError

from edge_queue.config.http import HttpSettings
from edge_queue.http.page import headers

from .conftest import Broker, wait_until
from .helpers.page import Browser, page_service
from .helpers.ports import free_port

SHOWN = "document.querySelector('#shown').textContent"
ROWS = "document.querySelectorAll('#jobs .job').length"


def _axe(b: Browser, where: str) -> list[dict]:
    """axe-core's violations on the page as it is now, in both themes."""
    found = []
    for scheme in ("light", "dark"):
        size = b.eval("[window.innerWidth, window.innerHeight]")
        b.do("emulate", width=size[0], height=size[1], color_scheme=scheme)
        found += [{**v, "where": f"{where} ({scheme})"} for v in b.do("axe")]
    b.do("emulate", width=size[0], height=size[1], color_scheme="light")
    return found


@pytest.mark.slow
@pytest.mark.serial
def test_any_of_501_jobs_is_found_with_pages_a_count_and_filters(
    ws_mosquitto: Broker,
    service_factory,
    browser: Browser,
    tmp_path: Path,
    artifacts: Path,
) -> None:
    root = tmp_path / "files"
    root.mkdir()
    for i in range(500):
        (root / f"rec-{i:03d}.wav").write_bytes(b"x")
    (root / "door-bell.wav").write_bytes(b"x")
    svc, url = page_service(service_factory, ws_mosquitto, root, ws_mosquitto.ws_port)
    # Given 501 jobs, waiting in a paused queue: 500 noop, one of them cancelled, and a probe
    w = svc.watcher("#")
    try:
        svc.request("pause", {}, w)
        data = svc.request(
            "submit", {"kind": "noop", "inputs": [str(root / f"rec-{i:03d}.wav") for i in range(500)]}, w
        )
        assert len(data["data"]["jobs"]) == 500, data
        cancelled = data["data"]["jobs"][123]["job_id"]
        svc.request("cancel", {"job_id": cancelled}, w)
        svc.request("submit", {"kind": "probe", "input": str(root / "door-bell.wav")}, w)
        b = browser
        b.do("goto", url=url)
        # Then the page shows the newest 100 and says how many there are; Show more reads on
        b.wait(f"{SHOWN} === '100 of 501 jobs' && {ROWS} === 100")
        b.do("screenshot", path=str(artifacts / "paging.png"))
        b.do("click", selector="#more-jobs")
        b.wait(f"{SHOWN} === '200 of 501 jobs' && {ROWS} === 200")
        names = b.eval("[...document.querySelectorAll('#jobs .job .name')].map(n => n.textContent)")
        assert len(set(names)) == 200 and names[0] == "door-bell.wav", names[:3]
        # When part of a file name is typed (in any case), any job is found, the oldest too
        b.do("fill", selector="#f-q", value="REC-000")
        b.wait(f"{SHOWN} === '1 of 1 job' && {ROWS} === 1")
        assert b.eval("document.querySelector('#jobs .job .name').textContent") == "rec-000.wav"
        b.do("fill", selector="#f-q", value="rec-12")
        b.wait(f"{SHOWN} === '10 of 10 jobs' && {ROWS} === 10")
        b.do("emulate", width=390, height=844, color_scheme="dark")
        b.do("screenshot", path=str(artifacts / "filter-phone-dark.png"))
        assert b.eval("document.documentElement.scrollWidth <= window.innerWidth")
        b.do("emulate", width=1100, height=820, color_scheme="light")
        # a count card filters by its state, and again clears it
        b.do("fill", selector="#f-q", value="")
        b.do("click", selector=".count[data-state=cancelled]")
        b.wait(f"{SHOWN} === '1 of 1 job' && {ROWS} === 1")
        assert b.eval("document.querySelector('#jobs .job').dataset.id") == cancelled
        assert b.eval("document.querySelector('.count[data-state=cancelled]').getAttribute('aria-pressed')") == "true"
        assert b.eval("document.querySelector('#f-state').value") == "cancelled"
        b.do("screenshot", path=str(artifacts / "filter-state.png"))
        b.do("click", selector=".count[data-state=cancelled]")
        b.wait(f"{SHOWN} === '100 of 501 jobs'")
        # the kind filter, and a new job that fits it appears live and is counted
        b.do("select", selector="#f-kind", value="probe")
        b.wait(f"{SHOWN} === '1 of 1 job' && {ROWS} === 1")
        svc.request("submit", {"kind": "probe", "input": str(root / "rec-042.wav")}, w)
        b.wait(f"{SHOWN} === '2 of 2 jobs' && {ROWS} === 2")
        svc.request("submit", {"kind": "noop", "input": str(root / "door-bell.wav")}, w)
        b.do("select", selector="#f-kind", value="")
        b.wait(f"{SHOWN} === '100 of 503 jobs'")
        assert "Content Security Policy" not in b.log.read_text(errors="replace")
    finally:
        w.close()
    print(f"screenshots: {artifacts}/paging.png, filter-phone-dark.png, filter-state.png")


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.usefixtures("model_installed")
def test_keyboard_screen_readers_and_transcript_downloads(
    ws_mosquitto: Broker,
    service_factory,
    browser: Browser,
    media: Path,
    artifacts: Path,
) -> None:
    svc, url = page_service(service_factory, ws_mosquitto, media, ws_mosquitto.ws_port)
    # Given a finished transcription, a failed probe and a running job
    w = svc.watcher("#")
    try:
        jfk = svc.request("submit", {"kind": "transcribe", "input": str(media / "speech" / "jfk.flac")}, w)
        jfk_id = jfk["data"]["jobs"][0]["job_id"]
        w.wait_json(f"{svc.base}/events", lambda e: e["type"] == "end" and e["job"]["job_id"] == jfk_id, 180)
        svc.request("submit", {"kind": "probe", "input": str(media / "speech" / "not-audio.wav")}, w)
        svc.request("submit", {"kind": "noop", "options": {"sleep_s": 60}}, w)
        outputs = svc.request("get", {"job_id": jfk_id}, w)["data"]["result"]["outputs"]
    finally:
        w.close()
    b = browser
    b.do("goto", url=url)
    b.wait(f"{ROWS} === 3 && document.querySelector('#jobs .job[data-state=running]')")
    b.wait("document.querySelector('#jobs .job[data-state=failed]')", 60)
    violations = _axe(b, "list")

    # When the keyboard opens a job: its name is a button; Enter opens the detail, and it
    # stays open (it once closed in the same key press)
    name = f"#jobs .job[data-id={json.dumps(jfk_id)}] .name"
    b.do("press", selector=name, key="Enter")
    b.wait("document.querySelector('#detail').open && document.querySelector('#d-body .segments')", 30)
    assert b.eval("document.querySelector('#detail').contains(document.activeElement)")
    violations += _axe(b, "detail")
    b.do("screenshot", path=str(artifacts / "detail-downloads.png"))
    # and the transcript's downloads are the transcription's own files, byte for byte
    for fmt in ("txt", "srt", "vtt"):
        saved = artifacts / f"download.{fmt}"
        suggested = b.do("download", selector=f"#d-body .downloads a[data-format={fmt}]", path=str(saved))
        assert suggested == f"jfk.{fmt}"
        assert saved.read_bytes() == Path(outputs[fmt]).read_bytes(), fmt
    b.do("keys", keys=["Escape"])
    b.wait("!document.querySelector('#detail').open")

    # When the picker is used with the keyboard: folders take focus and open with Enter
    b.do("press", selector="#add", key="Enter")
    root = json.dumps(str(media))
    b.wait(
        f"document.querySelector('#picker').open && document.querySelector('#entries li.dir[data-path={root}] button')"
    )
    b.do("press", selector=f"#entries li.dir[data-path={root}] button", key="Enter")
    speech = json.dumps(str(media / "speech"))
    b.wait(f"document.querySelector('#entries li.dir[data-path={speech}] button')")
    b.do("press", selector=f"#entries li.dir[data-path={speech}] button", key="Enter")
    box = f"#entries input[data-path={json.dumps(str(media / 'speech' / 'jfk.flac'))}]"
    b.wait(f"document.querySelector({json.dumps(box)})")
    b.do("press", selector=box, key="Space")
    b.wait("document.querySelector('#pick-count').textContent === '1 selected'")
    violations += _axe(b, "picker")
    b.do("screenshot", path=str(artifacts / "picker.png"))
    b.do("emulate", width=390, height=844, color_scheme="dark")
    b.do("screenshot", path=str(artifacts / "picker-phone-dark.png"))
    b.do("emulate", width=1100, height=820, color_scheme="light")
    b.do("keys", keys=["Escape"])

    # Then axe-core (WCAG 2.0-2.2 A and AA, and its best practices) finds nothing, in either
    # theme, on the list, the detail and the picker
    print(f"axe-core: {len(violations)} violations on list, detail and picker, light and dark")
    assert violations == [], json.dumps(violations, indent=1)[:6000]
    print(f"screenshots: {artifacts}/detail-downloads.png, picker.png, picker-phone-dark.png")


# -- in a Home Assistant dashboard ---------------------------------------------------------


def test_only_the_configured_origins_may_frame_the_page() -> None:
    # by default no page may frame it
    default = headers(HttpSettings())
    assert "frame-ancestors 'none'" in default["Content-Security-Policy"]
    assert default["X-Frame-Options"] == "DENY"
    # http.frame_ancestors names the origins that may, and no X-Frame-Options (it cannot)
    allowed = headers(HttpSettings(frame_ancestors=["http://homeassistant.local:8123", "https://ha.example.org"]))
    assert "frame-ancestors 'self' http://homeassistant.local:8123 https://ha.example.org;" in (
        allowed["Content-Security-Policy"] + ";"
    )
    assert "X-Frame-Options" not in allowed
    # anything but an origin is refused (a path, a wildcard, a second directive)
    for bad in ("http://ha:8123/", "*", "https://*.example.org", "http://ha; script-src *", "ha.local:8123"):
        with pytest.raises(ValidationError):
            HttpSettings(frame_ancestors=[bad])


@pytest.mark.slow
@pytest.mark.serial
def test_a_dashboard_on_an_allowed_origin_shows_the_page_in_a_frame_and_another_cannot(
    ws_mosquitto: Broker,
    service_factory,
    browser: Browser,
    tmp_path: Path,
) -> None:
    roots = tmp_path / "media"
    roots.mkdir()
    # Given two "dashboards" on their own origins, each framing the page
    dash = tmp_path / "dash"
    dash.mkdir()
    allowed_port, other_port = free_port(), free_port()
    servers = []
    for port in (allowed_port, other_port):
        handler = functools.partial(SimpleHTTPRequestHandler, directory=str(dash))
        handler.log_message = lambda *a: None  # type: ignore[attr-defined,method-assign]
        srv = ThreadingHTTPServer(("127.0.0.1", port), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
    try:
        # When edge-queue allows the first one's origin
        svc_env_origin = f'["http://127.0.0.1:{allowed_port}"]'
        svc, url = page_service(
            lambda broker, roots, env: service_factory(
                broker, roots, {**env, "EDGE_QUEUE_HTTP__FRAME_ANCESTORS": svc_env_origin}
            ),
            ws_mosquitto,
            roots,
            ws_mosquitto.ws_port,
        )
        (dash / "index.html").write_text(f'<!doctype html><title>dash</title><iframe src="{url}"></iframe>')
        ready = "document.querySelector('#status') && document.querySelector('#status').dataset.state"
        # Then the page runs in its frame there (online: it reached the broker)
        browser.do("goto", url=f"http://127.0.0.1:{allowed_port}/")
        wait = f"(() => {{ const s = {ready}; return s === 'online'; }})()"

        def framed_state() -> object:
            frames = browser.do("frames", js=f"({wait})")
            return next((f["js"] for f in frames if f["url"] == url), None)

        wait_until(lambda: framed_state() is True, 30, "the page online inside the allowed dashboard")
        # and not in the other one
        browser.do("goto", url=f"http://127.0.0.1:{other_port}/")
        browser.wait("document.querySelector('iframe')")
        frames = browser.do("frames", js="document.querySelector('#status') ? 'page' : 'blocked'")
        assert not any(f["js"] == "page" for f in frames), frames
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()


@pytest.mark.slow
@pytest.mark.serial
def test_the_small_things(
    ws_mosquitto: Broker,
    service_factory,
    browser: Browser,
    tmp_path: Path,
    artifacts: Path,
) -> None:
    """Select all of a 450-file folder, the time left in full, a toast cut at a word, a folder
    icon that needs no font, what unticked formats mean, why a queued job waits, and the
    attempts of a job retried by hand."""
    roots = tmp_path / "media"
    (roots / "many").mkdir(parents=True)
    for i in range(450):
        (roots / "many" / f"clip-{i:03d}.wav").write_bytes(b"x")
    (roots / "not-audio.wav").write_bytes(b"this is not audio\n" * 100)
    svc, url = page_service(
        lambda broker, r, env: service_factory(
            broker, r, {**env, "EDGE_QUEUE_WORKERS": "2", "EDGE_QUEUE_KINDS__NOOP__MAX_CONCURRENCY": "1"}
        ),
        ws_mosquitto,
        roots,
        ws_mosquitto.ws_port,
    )
    b = browser
    w = svc.watcher("#")
    try:
        # a probe that fails, retried by hand, fails again
        probe = svc.request("submit", {"kind": "probe", "input": str(roots / "not-audio.wav")}, w)
        probe_id = probe["data"]["jobs"][0]["job_id"]
        ended = lambda: [e for e in w.job_events(svc.base, probe_id) if e["state"] == "failed"]  # noqa: E731
        wait_until(lambda: len(ended()) == 1, 60, "the probe failed")
        svc.request("retry", {"job_id": probe_id}, w)
        wait_until(lambda: len(ended()) == 2, 60, "the probe failed again")
        # two noop jobs with one noop at a time and two workers: the second waits on the limit
        first = svc.request("submit", {"kind": "noop", "options": {"sleep_s": 60}}, w)["data"]["jobs"][0]["job_id"]
        w.wait_json(f"{svc.base}/events", lambda e: e["job"]["job_id"] == first and e["job"]["state"] == "running")
        second = svc.request("submit", {"kind": "noop", "options": {"sleep_s": 1}}, w)["data"]["jobs"][0]["job_id"]
        b.do("goto", url=url)
        ptext = "document.querySelector('#jobs .job[data-id=\"{}\"] .ptext').textContent"
        b.wait(f"{ptext.format(second)} === 'waiting: 1 noop at a time'")
        svc.request("pause", {}, w)
        b.wait(f"{ptext.format(second)} === 'waiting: the queue is paused'")
        # the time left is shown whole on a desktop, also the longest there is
        b.wait(f"{ptext.format(first)}.includes('left')")
        fits = (
            "(() => {{ const p = document.querySelector('#jobs .job[data-id=\"{}\"] .ptext'); {}"
            "return p.scrollWidth <= p.clientWidth; }})()"
        )
        assert b.eval(fits.format(first, ""))
        assert b.eval(fits.format(first, "p.textContent = '100 % · transcribing · 59 min 59 s left';"))
        svc.request("cancel", {"job_id": first}, w)
    finally:
        w.close()
    # the detail of the probe says it was retried by hand, and shows the earlier run
    b.do("click", selector=f"#jobs .job[data-id={json.dumps(probe_id)}] .name")
    b.wait("document.querySelector('#d-body .history')")
    attempts = b.eval(
        "[...document.querySelectorAll('#d-body dt')].find(d => d.textContent === 'Attempts')"
        ".nextElementSibling.textContent"
    )
    assert attempts.startswith("1 of 3 since it was retried by hand (1 time"), attempts
    assert b.eval("document.querySelectorAll('#d-body .history tr').length") >= 6  # header, 2 runs
    assert "[object" not in b.eval("document.querySelector('#d-body .history').textContent")
    b.do("screenshot", path=str(artifacts / "retried-by-hand.png"))
    b.do("keys", keys=["Escape"])
    # a toast's text is cut at a word
    long_text = "ask not what your country can do for you " * 5
    clipped = b.eval(f"clip({json.dumps(long_text)}, 140)")
    assert clipped.endswith("…") and len(clipped) <= 141 and long_text.startswith(clipped[:-1] + " "), clipped
    # Select all files here takes every file of the folder, not only the 200 shown
    b.do("click", selector="#add")
    b.wait("document.querySelector('#entries li.dir')")
    icon = "document.querySelector('#entries li.dir .icon')"
    # the folder icon is drawn, not a character of a font the system may lack
    assert b.eval(f"{icon}.textContent") == ""
    assert b.eval(f"getComputedStyle({icon}).backgroundColor") not in ("rgba(0, 0, 0, 0)", "transparent")
    b.do("click", selector=f"#entries li.dir[data-path={json.dumps(str(roots))}] button")
    many = json.dumps(str(roots / "many"))
    b.wait(f"document.querySelector('#entries li.dir[data-path={many}] button')")
    b.do("click", selector=f"#entries li.dir[data-path={many}] button")
    b.wait("document.querySelectorAll('#entries input[type=checkbox]').length === 200")
    b.do("click", selector="#pick-all")
    b.wait("document.querySelector('#pick-count').textContent === '450 selected'")
    # unticked formats say what they mean
    b.do("select", selector="#kind", value="transcribe")
    hint = "document.querySelector('#options [data-option=formats] .hint').textContent"
    assert b.eval(hint) == "none ticked: all of them"
    b.do("screenshot", path=str(artifacts / "select-all.png"))
    print(f"screenshots: {artifacts}/retried-by-hand.png, select-all.png")


@pytest.mark.serial
def test_a_probe_shows_what_each_stream_is(
    ws_mosquitto: Broker,
    service_factory,
    browser: Browser,
    media: Path,
    artifacts: Path,
) -> None:
    from .helpers.media_files import make_files

    # Given a probe of an mp3 with cover art (before: the detail listed the cover as a video)
    files = make_files(media)
    svc, url = page_service(service_factory, ws_mosquitto, media, ws_mosquitto.ws_port)
    w = svc.watcher("#")
    try:
        job_id = svc.request("submit", {"kind": "probe", "input": str(files["cover.mp3"])}, w)["data"]["jobs"][0]
        w.wait_json(f"{svc.base}/events", lambda e: e["type"] == "end" and e["job"]["job_id"] == job_id["job_id"])
    finally:
        w.close()
    b = browser
    b.do("goto", url=url)
    b.wait(f"{ROWS} === 1 && document.querySelector('#jobs .job[data-state=succeeded]')")
    # When its detail opens
    b.do("click", selector="#jobs .job .name")
    b.wait("document.querySelector('#detail').open && document.querySelector('#d-body table.streams')", 30)
    # Then the streams say what they are: the audio a kind uses, and the cover
    rows = b.eval(
        "[...document.querySelectorAll('#d-body table.streams:not(.history) tr')].slice(1)"
        ".map(r => r.children[1].textContent)"
    )
    assert rows == ["audio, used", "cover"], rows
    b.do("screenshot", path=str(artifacts / "probe-streams.png"))
    print(f"screenshot: {artifacts}/probe-streams.png")
