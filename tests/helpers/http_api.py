"""The HTTP API of a real service for tests: its keys, the service with the API on, Bazarr's request
and the PCM it sends, the jobs the service lists."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from ..conftest import ServiceProcess, wait_until
from .ports import free_port

KEY = "0123456789abcdef0123456789abcdef"
NOBODY_KEY = "fedcba9876543210fedcba9876543210"


def pcm_of(path: Path) -> bytes:
    """What Bazarr's ffmpeg sends: 16-bit mono PCM at 16 kHz, no header."""
    import av

    out = bytearray()
    resampler = av.AudioResampler(format="s16", layout="mono", rate=16000)
    with av.open(str(path)) as container:
        for frame in container.decode(audio=0):
            for f in resampler.resample(frame):
                out += f.to_ndarray().tobytes()
    for f in resampler.resample(None):
        out += f.to_ndarray().tobytes()
    return bytes(out)


def api_service(
    service_factory: Any, mosquitto: Any, media: Path, *, anonymous: bool = True, **extra: str
) -> tuple[ServiceProcess, str]:
    port = free_port()
    env = {
        "EDGE_QUEUE_API__ENABLED": "true",
        "EDGE_QUEUE_API__HOST": "127.0.0.1",
        "EDGE_QUEUE_API__PORT": str(port),
        **({"EDGE_QUEUE_API__ANONYMOUS_USER": "bazarr"} if anonymous else {}),
        "EDGE_QUEUE_API__KEYS": json.dumps({"alice": KEY, "nobody": NOBODY_KEY}),
        "EDGE_QUEUE_ACCESS__USERS": json.dumps(["bazarr", "alice"]),
        "EDGE_QUEUE_ACCESS__SHARED_ROLE": "admin",
        "EDGE_QUEUE_ACCESS__DEFAULT_ROLE": "none",
        "EDGE_QUEUE_WORKERS": "1",
        **extra,
    }
    svc = service_factory(mosquitto, [media], env).start()
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: answers(url), 30, "the HTTP API to answer")
    return svc, url


def answers(url: str) -> bool:
    try:
        return httpx.get(url + "/api/system/status", timeout=2).status_code in (200, 401)
    except httpx.HTTPError:
        return False


def bazarr_asr(url: str, pcm: bytes, **params: str) -> httpx.Response:
    """POST /asr as Bazarr's whisperai provider sends it: requests' files={'audio_file': bytes},
    params task/language/output/encode, a 5-s connect and 3,600-s read timeout, no key."""
    query = {"task": "transcribe", "language": "en", "output": "srt", "encode": "false", **params}
    return httpx.post(
        url + "/asr",
        params=query,
        files={"audio_file": ("audio_file", pcm)},
        headers={"User-Agent": "Subliminal/2.1.0"},
        timeout=httpx.Timeout(3600, connect=5),
    )


def jobs_listed(svc: ServiceProcess) -> list[dict[str, Any]]:
    with svc.watcher("response/#") as w:
        resp = svc.request("list", {"limit": 100}, w)
    return resp["data"]["jobs"]
