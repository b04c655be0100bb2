"""The Home Assistant Supervisor's API as an add-on sees it, faked (the Supervisor cannot run here)."""

from __future__ import annotations

import json
from typing import Any


class FakeSupervisor:
    """The Supervisor's ``GET /services/mqtt`` as its API documents it (the Supervisor itself
    cannot run here): ``{"result": "ok", "data": {"host", "port", "ssl", "protocol", "username",
    "password"}}`` for the add-on's token, 401 for any other; ``GET /addons/self/info``: its
    ``slug``."""

    def __init__(
        self, broker: Any, token: str, slug: str = "local_edge_queue", login: tuple[str, str] = ("", "")
    ) -> None:
        import http.server

        data = {
            "host": broker.host,
            "port": broker.port,
            "ssl": False,
            "protocol": "3.1.1",
            "username": login[0],
            "password": login[1],
        }

        discovered: list[dict[str, Any]] = []
        self.discovered = discovered

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                ok = self.path == "/discovery" and self.headers.get("Authorization") == f"Bearer {token}"
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
                ok = ok and isinstance(body, dict) and isinstance(body.get("config"), dict)
                if ok:
                    discovered.append(body)
                answer = {"result": "ok", "data": {"uuid": "5e1c0f3e"}} if ok else {"result": "error"}
                reply = json.dumps(answer).encode()
                self.send_response(200 if ok else 401)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def do_GET(self) -> None:  # noqa: N802
                answers = {"/services/mqtt": data, "/addons/self/info": {"slug": slug, "ingress": True}}
                ok = self.path in answers and self.headers.get("Authorization") == f"Bearer {token}"
                body = json.dumps({"result": "ok", "data": answers[self.path]} if ok else {"result": "error"}).encode()
                self.send_response(200 if ok else 401)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        import threading

        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
