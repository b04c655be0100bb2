"""The queue page (docs/operations.md, "The queue page"): its HTTP server, and the page itself
in a real browser (Debian's chromium driven by playwright-core, tests/browser/) against the
real service on a private mosquitto with a WebSocket listener, and on the embedded amqtt broker.

The browser tests need ``chromium`` (apt-get install chromium), ``node`` and
``tests/browser/node_modules`` (npm ci in tests/browser); ``.ci/run`` installs them. They skip
without them, and fail under ``CI=true``. Screenshots are saved under the test's temporary
folder (``artifacts/``); their paths are printed.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edge_queue.config.http import HttpSettings
from edge_queue.http.page import FILES, PageServer
from edge_queue.http.server import Connections

from .conftest import Broker, ServiceProcess, port_open, wait_until, words
from .helpers.deploy import service_env
from .helpers.page import Browser, page_service
from .helpers.ports import free_port

# -- the HTTP server ------------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[PageServer]:
    settings = HttpSettings(host="127.0.0.1", port=free_port(), websocket_port=9123)
    srv = PageServer(settings, "eqt-base", "9.9.9").start()
    yield srv
    srv.stop()


class Answer:
    """An HTTP answer, read whole: ``status``, ``headers``, ``body``."""

    def __init__(self, status: int, headers: Any, body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body


def fetch(srv: PageServer, path: str, method: str = "GET", headers: dict[str, str] | None = None) -> Answer:
    req = urllib.request.Request(f"http://127.0.0.1:{srv.port}{path}", method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return Answer(r.status, r.headers, r.read())
    except urllib.error.HTTPError as e:
        with e:
            return Answer(e.code, e.headers, e.read())


def test_serves_the_page_files_with_types_and_cache_control(server: PageServer) -> None:
    for path, (_, ctype) in FILES.items():
        r = fetch(server, path)
        assert r.status == 200, path
        assert r.headers["Content-Type"] == ctype
        assert r.headers["Cache-Control"] == "no-cache"
        assert r.headers["X-Content-Type-Options"] == "nosniff"
        assert "script-src 'self'" in r.headers["Content-Security-Policy"]
    body = fetch(server, "/").body.decode()
    assert '<script src="app.js"' in body and "mqtt.min.js" in body
    # a browser that has the file asks with its ETag and gets 304
    etag = fetch(server, "/app.js").headers["ETag"]
    assert fetch(server, "/app.js", headers={"If-None-Match": etag}).status == 304
    assert fetch(server, "/", method="HEAD").body == b""


def test_config_json_tells_the_page_where_the_broker_is(server: PageServer) -> None:
    r = fetch(server, "/config.json?x=1")
    assert r.headers["Content-Type"] == "application/json"
    assert json.loads(r.body) == {
        "base_topic": "eqt-base",
        "websocket_url": None,
        "websocket_port": 9123,
        "websocket_path": None,
        "version": "9.9.9",
    }


@pytest.mark.parametrize(
    "path",
    [
        "/../pyproject.toml",
        "/%2e%2e/%2e%2e/pyproject.toml",
        "/..%2fpage.py",
        "//etc/passwd",
        "/web/",
        "/web/app.js",
        "/static/",
        "/page.py",
        "/index.html/..",
        "/mqtt.min.js/",
    ],
)
def test_nothing_else_is_served(server: PageServer, path: str) -> None:
    r = fetch(server, path)
    assert r.status == 404, path
    assert b"not found" in r.body


def test_only_get_and_head(server: PageServer) -> None:
    for method in ("POST", "PUT", "DELETE", "OPTIONS"):
        r = fetch(server, "/", method=method)
        assert r.status == 405 and r.headers["Allow"] == "GET, HEAD", method


@pytest.mark.slow
def test_slow_connections_cannot_take_every_thread_and_descriptor(server: PageServer) -> None:
    # Given 300 connections that send half a request and then nothing (a slowloris)
    import socket

    from edge_queue.http.page import MAX_CONNECTIONS

    held = []
    for _ in range(300):
        c = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        held.append(c)
    try:
        # Then the server holds at most MAX_CONNECTIONS connections (and their sockets): the
        # others were closed at once
        def closed() -> int:
            n = 0
            for c in held:
                c.settimeout(0.01)
                try:
                    if c.recv(1) == b"":
                        n += 1
                except (TimeoutError, BlockingIOError):
                    pass
                except OSError:
                    n += 1
            return n

        wait_until(
            lambda: server.connections.total <= MAX_CONNECTIONS and closed() >= 300 - MAX_CONNECTIONS,
            5,
            "the extra connections closed",
        )
    finally:
        for c in held:
            c.close()

    # and once they are gone it serves again (until their handler threads have seen them close,
    # this address is over its share of connections, and a new one is closed at once)
    def served() -> bool:
        try:
            return fetch(server, "/").status == 200
        except OSError:  # http.client.RemoteDisconnected is one
            return False

    wait_until(served, 40, "the page served again", interval=0.2)


def test_connections_refused_for_one_address_take_no_place_of_another() -> None:
    # Given a server's count of 64 places, 8 an address, and 64 connections from one host
    conns = Connections(64, 8)
    told = [conns.open(("10.0.0.2", port)) for port in range(64)]
    assert told.count(None) == 8 and told.count("address") == 56
    # Then, while the 56 refused ones still linger, another host gets a place (before: "all")
    assert conns.open(("10.0.0.1", 1)) is None
    # And every count comes back when they close
    for port in range(64):
        conns.close(("10.0.0.2", port))
    conns.close(("10.0.0.1", 1))
    assert (conns.total, conns.refused, dict(conns.by_address)) == (0, 0, {})


@pytest.mark.slow
def test_one_host_trickling_headers_costs_only_its_own_connections(server: PageServer) -> None:
    # Given 64 connections from one host, each sending a header line every 2 s and never
    # ending its request (before: they held every place of the page from everyone)
    import socket

    from edge_queue.http.page import REQUEST_READ_S

    held = []
    for _ in range(64):
        c = socket.socket()
        c.bind(("127.0.0.2", 0))
        c.settimeout(10)
        c.connect(("127.0.0.1", server.port))
        c.sendall(b"GET / HTTP/1.1\r\n")
        held.append(c)
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(2):
            for c in held:
                try:
                    c.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    pass

    threading.Thread(target=trickle, daemon=True).start()
    try:
        # Then another host is served at once
        t0 = time.monotonic()
        assert fetch(server, "/").status == 200
        assert time.monotonic() - t0 < 2
        # and each slow connection is closed once its request took REQUEST_READ_S, trickle or not
        first = held[0]
        first.settimeout(REQUEST_READ_S + 5)
        t0 = time.monotonic()
        try:
            while first.recv(4096):
                pass
        except ConnectionResetError:
            pass
        assert time.monotonic() - t0 < REQUEST_READ_S + 3
    finally:
        stop.set()
        for c in held:
            c.close()


def test_one_http_stack_serves_the_page_and_the_api() -> None:
    # (before: the page ran on the standard library's http.server beside the API's uvicorn)
    import ast

    import edge_queue
    from edge_queue.http.server import HeaderDeadline

    found = []
    for path in Path(edge_queue.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found += [f"{path.name}: {n}" for n in names if n == "http.server" or n.startswith("http.server.")]
    assert found == []
    server = PageServer(HttpSettings(host="127.0.0.1", port=free_port()), "x", "0")
    try:
        assert issubclass(server.uvicorn.server.config.http, HeaderDeadline)
    finally:
        server.stop()


def test_a_taken_port_costs_the_page_not_the_queue(mosquitto: Broker, service_factory, tmp_path: Path) -> None:
    # Given a port that is taken, when the service starts with the page on it
    holder = PageServer(HttpSettings(host="127.0.0.1", port=free_port()), "x", "0").start()
    try:
        env = {"EDGE_QUEUE_HTTP__ENABLED": "true", "EDGE_QUEUE_HTTP__HOST": "127.0.0.1"}
        svc = service_factory(mosquitto, [tmp_path], {**env, "EDGE_QUEUE_HTTP__PORT": str(holder.port)}).start()
        # Then the queue runs, says so in the log, and <base>/info says there is no page
        w = svc.watcher("info")
        info = w.wait_json(f"{svc.base}/info", lambda i: "http_port" in i)
        assert info["http_port"] is None
        assert "queue page: cannot listen on 127.0.0.1" in svc.log()
        # and a service with a free port announces it
        port = free_port()
        svc2 = service_factory(mosquitto, [tmp_path / "2"], {**env, "EDGE_QUEUE_HTTP__PORT": str(port)})
        svc2.data_dir = tmp_path / "data2"
        svc2.env["EDGE_QUEUE_DATA_DIR"] = str(svc2.data_dir)
        svc2.start()
        w2 = svc2.watcher("info")
        assert w2.wait_json(f"{svc2.base}/info", lambda i: "http_port" in i)["http_port"] == port
        assert fetch_port(port, "/config.json")["base_topic"] == svc2.base
        w.close()
        w2.close()
    finally:
        holder.stop()


def fetch_port(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return json.loads(r.read())


# -- a real browser -------------------------------------------------------------------------


#: Collects, in the page, what the row of the job with input name N shows every 50 ms.
SAMPLER = """(() => {
  window.__samples = [];
  setInterval(() => {
    for (const row of document.querySelectorAll('#jobs .job')) {
      window.__samples.push({name: row.querySelector('.name').textContent, state: row.dataset.state,
        fill: row.querySelector('.fill').style.transform, text: row.querySelector('.ptext').textContent,
        top: Math.round(row.getBoundingClientRect().top), height: Math.round(row.getBoundingClientRect().height)});
    }
  }, 50);
  return true;
})()"""


def _pick(b: Browser, root: Path, folder: str, name: str, kind: str, shot: Path | None = None) -> None:
    """Choose ``root/folder/name`` in the file picker and submit it as ``kind``."""
    b.do("click", selector="#add")
    b.wait("document.querySelector('#picker').open && document.querySelector('#crumbs button')")
    b.do("click", selector="#crumbs button")  # "Media roots": the picker opens where it was last
    b.wait(f"document.querySelector('#entries li.dir[data-path={json.dumps(str(root))}]')")
    b.do("click", selector=f"#entries li.dir[data-path={json.dumps(str(root))}]")
    sub = f"{root}/{folder}"
    b.wait(f"document.querySelector('#entries li.dir[data-path={json.dumps(sub)}]')")
    b.do("click", selector=f"#entries li.dir[data-path={json.dumps(sub)}]")
    target = f"{sub}/{name}"
    b.wait(f"document.querySelector('#entries input[data-path={json.dumps(target)}]')")
    b.do("check", selector=f"#entries input[data-path={json.dumps(target)}]")
    b.do("select", selector="#kind", value=kind)
    b.wait("document.querySelector('#pick-count').textContent === '1 selected'")
    if shot is not None:
        b.do("screenshot", path=str(shot))
    b.do("click", selector="#submit")
    b.wait("!document.querySelector('#picker').open")


def row_js(name: str, what: str) -> str:
    """A page expression over the row of the job whose input is called ``name``."""
    rows = "[...document.querySelectorAll('#jobs .job')]"
    find = f"{rows}.find(r => r.querySelector('.name').textContent === {json.dumps(name)})"
    return f"(() => {{ const row = {find}; return row ? ({what}) : null; }})()"


def scenario(b: Browser, svc: ServiceProcess, url: str, media: Path, artifacts: Path, label: str) -> None:
    """Online and counts; jfk.flac through the picker: a moving progress bar, a toast, the
    transcript; a running and a finished job on a screenshot; cancel from the page; offline."""
    b.do("goto", url=url)
    # Then the page shows online, the version and the counts
    b.wait("document.querySelector('#status').dataset.state === 'online'")
    b.wait("document.querySelector('.count[data-state=queued] b').textContent === '0'")
    assert b.eval("document.querySelector('#version').textContent").startswith("v")
    b.wait("!document.querySelector('#add').disabled")
    b.eval(SAMPLER)

    # When jfk.flac is submitted as a transcription through the file picker
    _pick(b, media, "speech", "jfk.flac", "transcribe", artifacts / f"{label}-picker.png")
    # Then its bar moves while it runs, a toast says it is done, and its detail shows the
    # transcript with segment times
    b.wait(row_js("jfk.flac", "row.dataset.state === 'succeeded'"), timeout=180)
    b.wait(
        "[...document.querySelectorAll('.toast[data-state=succeeded]')].some(t => t.textContent.includes('jfk.flac'))"
    )
    samples = b.eval("window.__samples.filter(s => s.name === 'jfk.flac')")
    running = [s for s in samples if s["state"] == "running"]
    fills = [s["fill"] for s in running]
    assert running, samples[-5:]
    texts = {s["text"] for s in running}
    print(f"{label}: jfk.flac while running showed {len(set(fills))} bar widths, texts {sorted(texts)[:8]}")
    widths = {float(f.removeprefix("scaleX(").removesuffix(")")) for f in fills}
    assert len(widths) >= 2 and any(0 < w < 1 for w in widths), (sorted(widths), texts)  # the bar moved
    assert b.eval(row_js("jfk.flac", "row.querySelector('.fill').style.transform")) == "scaleX(1)"
    heights = {s["height"] for s in samples}
    assert len(heights) == 1, f"the row changed height while it updated: {heights}"  # no layout jumps
    b.do("click", selector=".toast[data-state=succeeded][data-job]")
    b.wait("document.querySelector('#detail').open && document.querySelector('#d-body .segments')", timeout=30)
    segments = b.eval("[...document.querySelectorAll('#d-body .segments > *')].map(n => n.textContent)")
    times, texts = segments[0::2], segments[1::2]
    assert "ask not what your country" in " ".join(words(" ".join(texts))), segments
    assert times[0] == "00:00.0" and len(times) >= 2 and all(t.startswith("00:") for t in times), times
    assert b.eval("document.querySelector('#d-body').textContent").count(".srt") >= 1  # output paths
    b.do("screenshot", path=str(artifacts / f"{label}-detail.png"))
    b.do("click", selector="#detail .sheet-head button")

    # When a file that is not media is probed, a toast says it failed, with the error code
    _pick(b, media, "speech", "not-audio.wav", "probe")
    b.wait(row_js("not-audio.wav", "row.dataset.state === 'failed'"), timeout=120)
    b.wait(
        "[...document.querySelectorAll('.toast[data-state=failed]')]"
        ".some(t => t.textContent.includes('not-audio.wav') && t.textContent.includes('unsupported_media'))"
    )

    # When a long recording runs, a screenshot shows it running beside the finished ones
    _pick(b, media, "long", "long-speech.wav", "transcribe")
    b.wait(
        row_js(
            "long-speech.wav",
            "row.dataset.state === 'running' && row.querySelector('.ptext').textContent.includes('transcribing')",
        ),
        timeout=120,
    )
    b.wait(row_js("long-speech.wav", "parseFloat(row.querySelector('.ptext').textContent) >= 10"), timeout=120)
    shot = artifacts / f"{label}-queue.png"
    b.do("screenshot", path=str(shot))
    print(f"screenshot ({label}, a running and a finished job): {shot}")
    # the same on a phone, in dark mode: nothing wider than the screen
    b.do("emulate", width=390, height=844, color_scheme="dark")
    b.do("screenshot", path=str(artifacts / f"{label}-phone-dark.png"))
    assert b.eval("document.documentElement.scrollWidth <= window.innerWidth")
    b.do("emulate", width=1100, height=820, color_scheme="light")
    # and cancel from the page cancels it
    b.do("click", selector="#jobs .job[data-state=running] .act button")  # the only running job
    b.wait(row_js("long-speech.wav", "row.dataset.state === 'cancelled'"), timeout=60)
    b.wait(
        "[...document.querySelectorAll('.toast[data-state=cancelled]')]"
        ".some(t => t.textContent.includes('long-speech.wav'))"
    )
    w = svc.watcher("response/#")
    jobs = svc.request("list", {}, w)["data"]["jobs"]
    assert {j["input"].rsplit("/", 1)[1]: j["state"] for j in jobs} == {
        "long-speech.wav": "cancelled",
        "not-audio.wav": "failed",
        "jfk.flac": "succeeded",
    }
    w.close()
    b.wait("document.querySelector('.count[data-state=cancelled] b').textContent === '1'")
    b.do("screenshot", path=str(artifacts / f"{label}-after-cancel.png"))

    # Pause and resume from the page: the queue's paused flag follows
    b.do("click", selector="#pause")
    b.wait("!document.querySelector('#paused').hidden && document.querySelector('#pause').textContent === 'Resume'")
    b.do("click", selector="#pause")
    b.wait("document.querySelector('#paused').hidden && document.querySelector('#pause').textContent === 'Pause'")

    # The page's own code keeps to its Content Security Policy
    assert "Content Security Policy" not in b.log.read_text(errors="replace")

    # When the service stops, the page shows offline
    assert svc.stop() == 0
    b.wait("document.querySelector('#status').dataset.state === 'offline'", timeout=30)
    assert b.eval("document.querySelector('#pause').disabled")


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.usefixtures("model_installed")
@pytest.mark.parametrize("broker_fixture", ["ws_mosquitto", "amqtt"])
def test_the_page(
    broker_fixture: str, request: pytest.FixtureRequest, service_factory, media: Path, browser: Browser, artifacts: Path
) -> None:
    """The whole scenario, on mosquitto with a WebSocket listener and on the embedded broker."""
    broker = request.getfixturevalue(broker_fixture)
    svc, url = page_service(service_factory, broker, media, broker.ws_port)
    print("chromium", browser.version)
    scenario(browser, svc, url, media, artifacts, "mosquitto" if broker_fixture == "ws_mosquitto" else "amqtt")


@pytest.mark.slow
@pytest.mark.serial
def test_the_page_asks_for_a_broker_login_and_remembers_it_only_if_asked(
    request: pytest.FixtureRequest, service_factory, browser: Browser, tmp_path: Path
) -> None:
    # Given mosquitto as shipped (passwords, the ACL, the WebSocket listener) and the service
    broker = request.getfixturevalue("mosquitto_with_acl")
    port = free_port()
    env = {
        **service_env("edge-queue", "svc-secret"),
        "EDGE_QUEUE_HTTP__ENABLED": "true",
        "EDGE_QUEUE_HTTP__HOST": "127.0.0.1",
        "EDGE_QUEUE_HTTP__PORT": str(port),
        "EDGE_QUEUE_HTTP__WEBSOCKET_PORT": str(broker.ws_port),
    }
    svc = service_factory(broker, [tmp_path], env)
    svc.base = "edge-queue"  # the base topic the shipped ACL names
    svc.start(wait_online=False)
    wait_until(lambda: port_open("127.0.0.1", port) or svc.proc.poll() is not None, 60, "the page")
    url = f"http://127.0.0.1:{port}/"
    b = browser
    login_open = "document.querySelector('#login').open"
    # When the page opens, the broker refuses anonymous clients: the page asks
    b.do("goto", url=url)
    b.wait(login_open)
    # a wrong password is refused, and asked again
    b.do("fill", selector="#user", value="phone")
    b.do("fill", selector="#password", value="wrong")
    b.do("click", selector="#login-ok")
    b.wait(f"{login_open} && document.querySelector('#login-why').textContent.includes('refused')")
    # the right one connects: online, counts; not remembered
    b.do("fill", selector="#password", value="phone-secret")
    b.do("click", selector="#login-ok")
    b.wait("document.querySelector('#status').dataset.state === 'online'", timeout=60)
    b.wait("/^[0-9]+$/.test(document.querySelector('.count[data-state=succeeded] b').textContent)")
    assert b.eval("localStorage.getItem('edge-queue.login')") is None
    b.do("goto", url=url)
    b.wait(login_open)
    # Then, asked to remember, the next visit connects without asking
    b.do("fill", selector="#user", value="phone")
    b.do("fill", selector="#password", value="phone-secret")
    b.do("check", selector="#remember")
    b.do("click", selector="#login-ok")
    b.wait("document.querySelector('#status').dataset.state === 'online'", timeout=60)
    assert json.loads(b.eval("localStorage.getItem('edge-queue.login')"))["username"] == "phone"
    b.do("goto", url=url)
    b.wait("document.querySelector('#status').dataset.state === 'online'", timeout=60)
    assert not b.eval(login_open)
    assert "Content Security Policy" not in b.log.read_text(errors="replace")


def test_home_assistant_device_links_to_the_page() -> None:
    from edge_queue.mqtt.topics import Topics
    from edge_queue.publish import discovery

    config = discovery.device_config(Topics("b"), "abc", "nas", "1", configuration_url="http://nas:8099/")
    assert config["dev"]["cu"] == "http://nas:8099/"  # configuration_url, abbreviated
    assert "cu" not in discovery.device_config(Topics("b"), "abc", "nas", "1")["dev"]


@pytest.mark.slow
@pytest.mark.serial
def test_the_page_shows_worker_nodes_and_where_a_job_runs(
    ws_mosquitto: Broker, service_factory, browser: Browser, tmp_path: Path, artifacts: Path
) -> None:
    """docs/nodes.md: the queue page lists the worker nodes (online, jobs running) and a job's
    row says on which node it runs."""
    from .helpers.nodes import NodeProcess, hub_env

    media = tmp_path / "media"
    media.mkdir()
    port = free_port()
    env = {
        "EDGE_QUEUE_HTTP__ENABLED": "true",
        "EDGE_QUEUE_HTTP__HOST": "127.0.0.1",
        "EDGE_QUEUE_HTTP__PORT": str(port),
        "EDGE_QUEUE_HTTP__WEBSOCKET_PORT": str(ws_mosquitto.ws_port),
        **hub_env(["n1"]),
    }
    svc = service_factory(ws_mosquitto, [media], env).start()
    node = NodeProcess(svc, tmp_path, "n1", [media]).start()
    try:
        browser.do("goto", url=f"http://127.0.0.1:{port}/")
        chip = "document.querySelector('#nodes .node[data-node=n1]')"
        browser.wait(f"{chip} && {chip}.textContent === 'n1 · 0/1 running' && !document.querySelector('#nodes').hidden")
        w = svc.watcher("#")
        try:
            svc.request("submit", {"kind": "noop", "options": {"sleep_s": 5}}, w)
        finally:
            w.close()
        browser.wait(f"{chip}.textContent === 'n1 · 1/1 running'", timeout=30)
        browser.wait("[...document.querySelectorAll('#jobs .job .meta')].some((m) => m.textContent.includes('on n1'))")
        browser.do("screenshot", path=str(artifacts / "nodes.png"))
        node.stop()
        browser.wait(f"{chip}.textContent === 'n1 · offline' && {chip}.classList.contains('off')", timeout=30)
    finally:
        node.stop()
