"""Long jobs resume where they stopped (docs/topics.md, "Long jobs resume"), and batched
transcription keeps its bounds, through the real service: real speech, real SQLite files, real
processes and signals."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from .conftest import descendants, need, wait_until, wer
from .helpers.store_rows import kept_chunks

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("model_installed")]

#: 5 minutes of speech in chunks of at most 30 s, each cut at a pause: 11 chunks
#: (a graceful stop ends the running job's worker at once: no grace to finish in)
ENV = {"EDGE_QUEUE_TRANSCRIBE__CHUNK_S": "30", "EDGE_QUEUE_WORKERS": "1", "EDGE_QUEUE_CANCEL_GRACE_S": "0"}


def _segments(result: dict[str, Any]) -> list[tuple[float, float, str]]:
    doc = json.loads(Path(result["outputs"]["json"]).read_text())
    return [(s["start"], s["end"], s["text"]) for s in doc["segments"]]


@pytest.fixture
def uninterrupted(mosquitto, service_factory, long_recording) -> dict[str, Any]:
    """The 5-minute recording transcribed by a service that nothing interrupts."""
    path, _ = long_recording(300)
    svc = service_factory(mosquitto, [path.parent], ENV).start()
    watcher = svc.watcher("response/#", "jobs/+")
    job_id = svc.request("submit", {"input": str(path)}, watcher)["data"]["jobs"][0]["job_id"]
    done = watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] in ("succeeded", "failed"), 600)
    assert done["state"] == "succeeded", done
    svc.stop()
    return done


def _interrupted(svc: Any, path: Path, stop: str) -> tuple[str, dict[str, Any], int]:
    watcher = svc.watcher("response/#", "jobs/+")
    job_id = svc.request("submit", {"input": str(path)}, watcher)["data"]["jobs"][0]["job_id"]
    topic = f"{svc.base}/jobs/{job_id}"
    # 60 %: six of the ten chunks committed to the store (read from the file, as it stands)
    wait_until(lambda: kept_chunks(svc.db, job_id) >= 6, 600, "six kept chunks")
    if stop == "kill":
        svc.kill()
    else:
        assert svc.stop() == 0
    kept = kept_chunks(svc.db, job_id)
    return job_id, watcher.json_on(topic)[-1], kept


@pytest.mark.parametrize("stop", ["kill", "graceful"])
def test_a_transcription_stopped_at_60_percent_resumes_from_its_kept_chunks(
    mosquitto, service_factory, long_recording, uninterrupted: dict[str, Any], stop: str
) -> None:
    # Given a 10-chunk transcription stopped at 60 % (kill -9 of the service, or SIGTERM)
    path, reference = long_recording(300)
    svc = service_factory(mosquitto, [path.parent], ENV).start()
    job_id, last, kept = _interrupted(svc, path, stop)
    assert 6 <= kept <= 10, (kept, last)
    # When the service starts again
    watcher = svc.watcher("response/#", "jobs/+")
    svc.start()
    topic = f"{svc.base}/jobs/{job_id}"
    done = watcher.wait_json(topic, lambda m: m["state"] in ("succeeded", "failed"), 600)
    # Then the next attempt decoded only the chunks that were not kept
    assert done["state"] == "succeeded", done
    result = done["result"]
    assert result["chunks"] == uninterrupted["result"]["chunks"] >= 10
    assert result["chunks_resumed"] == kept, (result, kept)
    assert f"resumed after {kept} kept chunk(s)" in svc.log()
    # And the transcript and its segment times are those of the uninterrupted run
    assert result["text"] == uninterrupted["result"]["text"]
    assert _segments(result) == _segments(uninterrupted["result"])
    assert wer(reference, result["text"]) < 0.05
    # And progress went on from where the kept chunks ended (never back to 0 while transcribing)
    after = [m for m in watcher.json_on(topic) if m["seq"] > last["seq"]]
    running = [m for m in after if m["state"] == "running" and m["stage"] == "transcribing"]
    assert running and min(m["progress"] for m in running) >= 10 * kept - 10, [m["progress"] for m in running]
    # And the kept chunks are gone once the job has ended
    assert kept_chunks(svc.db, job_id) == 0


def test_an_input_replaced_between_attempts_is_decoded_from_the_start(
    mosquitto, service_factory, long_recording, tmp_path: Path
) -> None:
    # Given a transcription killed at 60 %, with chunks kept
    src, _ = long_recording(300)
    media = tmp_path / "media"
    media.mkdir()
    path = media / "talk.wav"
    path.write_bytes(src.read_bytes())
    svc = service_factory(mosquitto, [media], ENV).start()
    job_id, _, kept = _interrupted(svc, path, "kill")
    assert kept >= 5
    # When the file is replaced by another recording before the service comes back
    other, other_reference = long_recording(100)
    path.write_bytes(other.read_bytes())
    watcher = svc.watcher("response/#", "jobs/+")
    svc.start()
    done = watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] in ("succeeded", "failed"), 600)
    # Then it is transcribed from the start, and the transcript is the new file's
    assert done["state"] == "succeeded", done
    assert done["result"]["chunks_resumed"] == 0 and done["result"]["chunks"] == 4
    assert wer(other_reference, done["result"]["text"]) < 0.05


def test_cancel_during_a_batched_chunk_ends_within_the_grace_period(mosquitto, service_factory, long_recording) -> None:
    # Given a transcription with one chunk of 5 minutes decoded in batches of 8 windows
    path, _ = long_recording(300)
    env = {"EDGE_QUEUE_TRANSCRIBE__CHUNK_S": "600", "EDGE_QUEUE_TRANSCRIBE__BATCH_SIZE": "8"}
    svc = service_factory(mosquitto, [path.parent], {**env, "EDGE_QUEUE_CANCEL_GRACE_S": "5"}).start()
    watcher = svc.watcher("response/#", "jobs/+")
    job_id = svc.request("submit", {"input": str(path)}, watcher)["data"]["jobs"][0]["job_id"]
    topic = f"{svc.base}/jobs/{job_id}"
    watcher.wait_json(topic, lambda m: m["stage"] == "transcribing", 120)
    time.sleep(1.0)  # into the first batch
    # When it is cancelled
    t0 = time.monotonic()
    assert svc.request("cancel", {"job_id": job_id}, watcher)["status"] == "ok"
    done = watcher.wait_json(topic, lambda m: m["state"] in ("cancelled", "succeeded", "failed"), 60)
    # Then it ends cancelled within the grace period (and a few seconds for the messages, under load)
    assert done["state"] == "cancelled", done
    assert time.monotonic() - t0 < 5 + 8


def test_a_worker_transcribing_20_minutes_stays_under_its_memory_bound(
    mosquitto, service_factory, long_recording
) -> None:
    # Given a 20-minute recording and the default settings (chunks of 120 s, batches of 4)
    path, _ = long_recording(1200)
    svc = service_factory(mosquitto, [path.parent], {"EDGE_QUEUE_WORKERS": "1"}).start()
    watcher = svc.watcher("response/#", "jobs/+")
    job_id = svc.request("submit", {"input": str(path)}, watcher)["data"]["jobs"][0]["job_id"]
    done = watcher.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] in ("succeeded", "failed"), 900)
    assert done["state"] == "succeeded", done
    # Then the worker's peak resident memory (VmHWM, from /proc) stays under the 500 MiB
    # target of docs/benchmarks.md, P3L (measured 375-385 MiB on 10 minutes, 389 on 1 hour)
    peaks = []
    for pid in descendants(svc.proc.pid):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"forkserver" in cmd and "VmHWM" in status:
            peaks.append(int(status.split("VmHWM:")[1].split()[0]) / 1024)
    assert peaks, "no worker process found"
    assert max(peaks) <= 500, peaks


@contextmanager
def unwritable(folder: Path) -> Iterator[None]:
    """``folder`` made immutable (``chattr +i``): no file can be made in it, by root either
    (the tests run as root, whom permission bits do not stop); its files stay readable."""
    made = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True)
    need(made.returncode == 0, f"chattr +i is refused here ({made.stderr.strip()})")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_beside_outputs_into_a_folder_that_cannot_be_written(
    mosquitto, service_factory, long_recording, tmp_path: Path
) -> None:
    # Given a 2-minute recording in a folder of its own, 15-s chunks, its outputs beside it
    source, _ = long_recording(120)
    folder = tmp_path / "media"
    folder.mkdir()
    path = folder / "talk.wav"
    shutil.copy(source, path)
    env = {**ENV, "EDGE_QUEUE_TRANSCRIBE__CHUNK_S": "15"}
    svc = service_factory(mosquitto, [folder], env).start()
    watcher = svc.watcher("response/#", "jobs/+")
    body = {"input": str(path), "options": {"output": "beside", "formats": ["srt", "json"]}}

    def ended(job_id: str) -> dict[str, Any]:
        topic = f"{svc.base}/jobs/{job_id}"
        return watcher.wait_json(topic, lambda m: m["state"] in ("succeeded", "failed"), 300)

    # When the folder cannot be written as the job starts: it fails before decoding anything
    with unwritable(folder):
        first = svc.request("submit", body, watcher)["data"]["jobs"][0]["job_id"]
        failed = ended(first)
    assert failed["state"] == "failed" and failed["error"]["code"] == "output_not_writable", failed
    stages = {m.get("stage") for m in watcher.json_on(f"{svc.base}/jobs/{first}")}
    assert not stages & {"loading_model", "transcribing"}, stages
    assert kept_chunks(svc.db, first) == 0

    # When the folder becomes unwritable while the job decodes (after its first kept chunk)
    second = svc.request("submit", body, watcher)["data"]["jobs"][0]["job_id"]
    wait_until(lambda: kept_chunks(svc.db, second) >= 1, 300, "a kept chunk")
    with unwritable(folder):
        failed = ended(second)
    assert failed["state"] == "failed" and failed["error"]["code"] == "output_not_writable", failed
    kept = kept_chunks(svc.db, second)
    assert kept >= 6, kept  # the decoded transcript stays with the failed job
    # Then a retry, once the folder is writable, writes the outputs without decoding again
    assert svc.request("retry", {"job_id": second}, watcher)["status"] == "ok"
    done = watcher.wait_json(f"{svc.base}/jobs/{second}", lambda m: m["state"] == "succeeded", 300)
    assert done["result"]["chunks_resumed"] == done["result"]["chunks"] == kept, done["result"]
    assert Path(done["result"]["outputs"]["srt"]) == folder / "talk.en.srt"
    assert kept_chunks(svc.db, second) == 0  # gone with the success
