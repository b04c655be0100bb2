"""bench/ref/long_child.py, the process P3's long-file rows run each side in, on a real clip:
edge-queue's ``transcribe`` kind with the child's stand-in for the worker's job context
(edge_queue/kinds/base.py, ``JobContext``), and faster-whisper's batched pipeline with timestamp
tokens, the reference. A context that drifts from the kind's needs fails here, not in a bench run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHILD = ROOT / "bench" / "ref" / "long_child.py"


@pytest.mark.parametrize(
    "variant, extra",
    [("eq", []), ("eq", ["chunks_at_once=2", "cpu_threads=1"]), ("fw-batched", ["batch_size=8", "timestamps=1"])],
)
@pytest.mark.slow
def test_long_child_transcribes(speech: Path, model_installed: None, variant: str, extra: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, str(CHILD), variant, str(speech / "jfk.flac"), *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert "ask not what your country can do for you" in res["text"].lower().replace(",", "")
    assert res["segments"] and all(s["end"] > s["start"] for s in res["segments"])
    assert res["cpu_s"] > 0 and res["peak_rss_mib"] > 50
