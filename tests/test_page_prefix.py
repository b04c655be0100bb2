"""The queue page behind a proxy that serves it under a prefix and strips it (Home Assistant's
ingress, docs/operations.md "Behind a reverse proxy or Home Assistant's ingress"), in a real
Chromium."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edge_queue.config.http import HttpSettings
from edge_queue.http.page import PageServer

from .helpers.page import Browser, browser_ready
from .helpers.ports import free_port


@pytest.fixture
def page_server() -> Iterator[PageServer]:
    srv = PageServer(HttpSettings(host="127.0.0.1", port=free_port()), "eqt-prefix", "9.9.9").start()
    yield srv
    srv.stop()


class PrefixProxy:
    """A reverse proxy that serves the page under ``/ingress/<token>`` and strips that prefix,
    as Home Assistant's ingress does: ``/ingress/<token>`` and ``/ingress/<token>/`` both reach
    the page's server as ``/``. GET only, every header of the answer passed on."""

    PREFIX = "/ingress/0123abcd"

    def __init__(self, port: int) -> None:
        import http.server
        import threading
        import urllib.error
        import urllib.request

        prefix = self.PREFIX

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                if not self.path.startswith(prefix):
                    self.send_error(404)
                    return
                rest = self.path[len(prefix) :] or "/"
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}{rest}", timeout=10) as up:
                        status, headers, body = up.status, up.headers.items(), up.read()
                except urllib.error.HTTPError as e:
                    status, headers, body = e.code, e.headers.items(), e.read()
                self.send_response(status)
                for name, value in headers:
                    if name.lower() not in ("connection", "transfer-encoding", "server", "date"):
                        self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_the_page_at_its_prefix_without_the_trailing_slash(page_server: PageServer, tmp_path: Path) -> None:
    # Given the page behind a proxy that strips its prefix, as Home Assistant's ingress does
    browser_ready()
    proxy = PrefixProxy(page_server.port)
    b = Browser(tmp_path / "browser.log")
    try:
        # When the browser opens the prefix without its trailing slash (before: a blank page,
        # its relative scripts 404 from the folder above)
        b.do("goto", url=f"http://127.0.0.1:{proxy.port}{PrefixProxy.PREFIX}")
        # Then it lands on the address with the slash, and the page's scripts run there
        b.wait("typeof page !== 'undefined' && location.pathname.endsWith('/')", timeout=30)
        assert b.eval("location.pathname") == PrefixProxy.PREFIX + "/"
        # And at the slash, or at index.html, nothing moves
        for path in ("/", "/index.html"):
            b.do("goto", url=f"http://127.0.0.1:{proxy.port}{PrefixProxy.PREFIX}{path}")
            b.wait("typeof page !== 'undefined'", timeout=30)
            assert b.eval("location.pathname") == PrefixProxy.PREFIX + path
    finally:
        b.close()
        proxy.close()
