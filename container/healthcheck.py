"""The container's health check: healthy while edge-queue's process answers.

``serve`` and ``up``: the queue page (or, with the page off, the HTTP API) answers on this
machine; any HTTP answer counts (a 401 without a key too), a refused or silent port does not.
``worker``: the process is alive (a node has no listener; its state is on <base>/nodes/<id>).
"""

import json
import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    with open("/proc/1/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    if b"worker" in argv:
        return 0
    ports = []
    # the page first: it answers without a login, and logs nothing (the API logs every call it
    # refuses, a health check's every 30 s too)
    if os.environ.get("EDGE_QUEUE_HTTP__ENABLED", "true").lower() != "false":
        ports.append((os.environ.get("EDGE_QUEUE_HTTP__PORT", "8099"), "/config.json"))
    if os.environ.get("EDGE_QUEUE_API__ENABLED", "true").lower() != "false":
        ports.append((os.environ.get("EDGE_QUEUE_API__PORT", "9000"), "/api/system/status"))
    for port, path in ports:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5):
                return 0
        except urllib.error.HTTPError:
            return 0  # it answered
        except OSError:
            continue
    print(json.dumps({"healthy": False, "tried": ports}))
    return 1 if ports else 0


sys.exit(main())
