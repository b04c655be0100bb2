"""The queue page on a phone (390×844), in a real chromium against the real service: "Show
more" only when more jobs exist (a filter matching exactly one page of 100 once showed it, and
it read nothing), and the downloads of a transcription that wrote no json (docs/operations.md,
"The queue page").
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import Broker
from .helpers.page import Browser, page_service

SHOWN = "document.querySelector('#shown').textContent"
ROWS = "document.querySelectorAll('#jobs .job').length"
MORE = "document.querySelector('#more-jobs')"


@pytest.mark.slow
@pytest.mark.serial
def test_show_more_only_when_more_jobs_exist(
    ws_mosquitto: Broker,
    service_factory,
    browser: Browser,
    tmp_path: Path,
    artifacts: Path,
) -> None:
    root = tmp_path / "files"
    root.mkdir()
    for i in range(100):
        (root / f"rec-{i:03d}.wav").write_bytes(b"x")
    (root / "door-bell.wav").write_bytes(b"x")
    svc, url = page_service(service_factory, ws_mosquitto, root, ws_mosquitto.ws_port)
    # Given exactly 100 noop jobs (the page asks 100 at a time) and one probe, in a paused queue
    w = svc.watcher("#")
    try:
        svc.request("pause", {}, w)
        data = svc.request(
            "submit", {"kind": "noop", "inputs": [str(root / f"rec-{i:03d}.wav") for i in range(100)]}, w
        )
        assert len(data["data"]["jobs"]) == 100, data
        svc.request("submit", {"kind": "probe", "input": str(root / "door-bell.wav")}, w)
        # the list answer says no page follows a full page that holds every match
        noop = svc.request("list", {"kind": "noop", "limit": 100, "count": True}, w)["data"]
        assert (len(noop["jobs"]), noop["total"], noop["next_before"]) == (100, 100, None)
        every = svc.request("list", {"limit": 100}, w)["data"]
        assert every["next_before"] == every["jobs"][-1]["job_id"]
        last = svc.request("list", {"limit": 100, "before": every["next_before"]}, w)["data"]
        assert (len(last["jobs"]), last["next_before"]) == (1, None)
    finally:
        w.close()
    b = browser
    b.do("emulate", width=390, height=844, color_scheme="light")
    b.do("goto", url=url)
    # When all 101 are listed, Show more is there and reads the last one, then is gone
    b.wait(f"{SHOWN} === '100 of 101 jobs' && {ROWS} === 100 && !{MORE}.hidden")
    b.do("click", selector="#more-jobs")
    b.wait(f"{SHOWN} === '101 of 101 jobs' && {ROWS} === 101")
    assert b.eval(f"{MORE}.hidden")
    # When the filter matches exactly 100 jobs: "100 of 100 jobs" and no Show more
    b.do("select", selector="#f-kind", value="noop")
    b.wait(f"{SHOWN} === '100 of 100 jobs' && {ROWS} === 100")
    assert b.eval(f"{MORE}.hidden"), "Show more offered with every job shown"
    assert b.eval(f"{MORE}.getBoundingClientRect().height") == 0
    b.do("screenshot", path=str(artifacts / "exactly-100-phone.png"), full_page=True)
    print(f"screenshot: {artifacts}/exactly-100-phone.png")


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.usefixtures("model_installed")
def test_a_transcription_without_json_has_its_downloads(
    ws_mosquitto: Broker,
    service_factory,
    browser: Browser,
    media: Path,
    artifacts: Path,
) -> None:
    # (chunks of 30 s: segments of whole sentences, longer than a subtitle line)
    svc, url = page_service(
        service_factory, ws_mosquitto, media, ws_mosquitto.ws_port, EDGE_QUEUE_TRANSCRIBE__CHUNK_S="30"
    )
    # Given a transcription that wrote txt and srt, and no json (before: no download at all,
    # the buttons were made from the segments of the json output only)
    w = svc.watcher("#")
    try:
        options = {"formats": ["txt", "srt"]}
        data = svc.request(
            "submit", {"kind": "transcribe", "input": str(media / "speech" / "jfk.flac"), "options": options}, w
        )
        job_id = data["data"]["jobs"][0]["job_id"]
        w.wait_json(f"{svc.base}/events", lambda e: e["type"] == "end" and e["job"]["job_id"] == job_id, 180)
        got = svc.request("get", {"job_id": job_id, "segments": True}, w)["data"]["result"]
    finally:
        w.close()
    outputs = got["outputs"]
    assert sorted(outputs) == ["srt", "txt"], outputs
    # get reads the segments from the srt, to the millisecond
    assert got["segment_list"] and not got["segment_list_truncated"], got
    assert "fellow Americans" in got["segment_list"][0]["text"]
    # ... and the txt's lines, the segments' text: the srt's cues are laid out otherwise (a txt
    # made from them, as the page made it before, is not the job's)
    txt = Path(outputs["txt"]).read_bytes()
    assert "".join(line + "\n" for line in got["line_list"]).encode() == txt
    assert not got["line_list_truncated"]
    assert "".join(s["text"] + "\n" for s in got["segment_list"]).encode() != txt, txt
    b = browser
    b.do("emulate", width=390, height=844, color_scheme="light")
    b.do("goto", url=url)
    b.wait(f"{ROWS} === 1 && document.querySelector('#jobs .job[data-state=succeeded]')")
    # When its detail opens on a phone
    b.do("click", selector="#jobs .job .name")
    b.wait("document.querySelector('#detail').open && document.querySelector('#d-body .downloads')", 30)
    # Then it offers the formats the job wrote, and each is the job's own file, byte for byte
    offered = b.eval("[...document.querySelectorAll('#d-body .downloads a')].map(a => a.dataset.format)")
    assert offered == ["txt", "srt"], offered
    assert b.eval("document.querySelectorAll('#d-body .segments time').length") == len(got["segment_list"])
    b.do("screenshot", path=str(artifacts / "no-json-downloads-phone.png"))
    for fmt in offered:
        saved = artifacts / f"download.{fmt}"
        suggested = b.do("download", selector=f"#d-body .downloads a[data-format={fmt}]", path=str(saved))
        assert suggested == f"jfk.{fmt}"
        assert saved.read_bytes() == Path(outputs[fmt]).read_bytes(), fmt
    print(f"screenshot: {artifacts}/no-json-downloads-phone.png")
