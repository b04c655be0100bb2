"""A WebSocket handshake written byte for byte, for the Origin rules' tests
(tests/test_embedded_broker.py, tests/test_page_relay.py): header lines no client library
sends (two ``Origin`` lines, a proxy's headers), from a chosen source address."""

from __future__ import annotations


def raw_handshake(port: int, *header_lines: str, path: str = "/", source: str = "127.0.0.1") -> int:
    """A WebSocket handshake with ``header_lines`` as written (two ``Origin`` lines, a proxy's
    headers) from ``source``: the answer's status code (the connection is then closed)."""
    import base64
    import os
    import socket

    with socket.socket() as s:
        s.settimeout(10)
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
        head = [
            f"GET {path} HTTP/1.1",
            f"Host: 127.0.0.1:{port}",
            "Upgrade: websocket",
            "Connection: Upgrade",
            f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}",
            "Sec-WebSocket-Version: 13",
            "Sec-WebSocket-Protocol: mqtt",
            *header_lines,
        ]
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        answer = b""
        while b"\r\n" not in answer:
            chunk = s.recv(4096)
            if not chunk:
                break
            answer += chunk
        return int(answer.split(b" ", 2)[1])
