"""Kept chunks in a real store, and the rules that decide which a new attempt may take
(docs/topics.md, "Long jobs resume"): no model, no broker, no process."""

from __future__ import annotations

import os
import shutil
import sqlite3
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from edge_queue.config.settings import Settings
from edge_queue.kinds.transcribe import (
    chunk_length_s,
    chunks_at_once,
    eta_s,
    input_signature,
    model_threads,
    resolve_model,
    resumable,
    same_cut,
)
from edge_queue.kinds.whisper import MISSED_GAP_S, MISSED_MARGIN_S, cues, missed_stretch
from edge_queue.rules.states import JobState
from edge_queue.store import JobSpec, Store


def _job(store: Store, name: str = "x", now: float = 1000.0) -> str:
    _, (created,) = store.submit([JobSpec("transcribe", f"/{name}.wav", {})], now)
    return str(created.job["job_id"])


def test_kept_chunks_survive_a_reopen_and_go_when_the_job_ends(tmp_path: Path) -> None:
    # Given a running job with two kept chunks
    store = Store(tmp_path / "q.db")
    job_id = _job(store)
    job = store.claim(1001.0, ["transcribe"], "run1")
    assert job is not None
    store.keep_chunk(job_id, 1, 0, {"segments": [{"text": "a"}]})
    store.keep_chunk(job_id, 1, 1, {"segments": [{"text": "b"}]})
    store.keep_chunk(job_id, 1, 1, {"segments": [{"text": "b2"}]})  # the same index again replaces it
    store.close()
    # When the store is opened again (a restart), they are there, in order
    store = Store(tmp_path / "q.db")
    kept = store.kept_chunks(job_id)
    assert [(c["index"], c["attempt"], c["data"]["segments"][0]["text"]) for c in kept] == [(0, 1, "a"), (1, 1, "b2")]
    # And when the job succeeds, they are deleted in the same transaction
    store.succeed_many([(job_id, 1, {"ok": True})], 1002.0)
    assert store.kept_chunks(job_id) == []
    with sqlite3.connect(tmp_path / "q.db") as conn:
        assert conn.execute("SELECT count(*) FROM job_chunks").fetchone()[0] == 0
    store.close()


def test_a_failed_or_cancelled_job_drops_its_chunks_and_purge_deletes_any_left(tmp_path: Path) -> None:
    store = Store(tmp_path / "q.db")
    failed, cancelled = _job(store, "a"), _job(store, "b")
    for job_id in (failed, cancelled):
        store.claim(1001.0, ["transcribe"], "run1")
        store.keep_chunk(job_id, 1, 0, {"segments": []})
    store.transition(
        failed, JobState.FAILED, 1002.0, error={"code": "internal_error", "message": "x", "retryable": False}
    )
    store.transition(cancelled, JobState.CANCELLING, 1002.0)
    assert store.kept_chunks(cancelled) != []  # still running its attempt
    store.transition(cancelled, JobState.CANCELLED, 1003.0)
    assert store.kept_chunks(failed) == [] and store.kept_chunks(cancelled) == []
    # a row left behind (written by hand here) goes with the job on delete
    with sqlite3.connect(tmp_path / "q.db") as conn:
        conn.execute("INSERT INTO job_chunks VALUES (?, 0, 1, '{}')", [failed])
    store.close()
    store = Store(tmp_path / "q.db")
    assert store.delete([failed])[0] == [failed]
    with sqlite3.connect(tmp_path / "q.db") as conn:
        assert conn.execute("SELECT count(*) FROM job_chunks").fetchone()[0] == 0
    store.close()


def test_a_job_that_never_kept_a_chunk_costs_no_statement_when_it_ends(tmp_path: Path) -> None:
    store = Store(tmp_path / "q.db")
    job_id = _job(store)
    store.claim(1001.0, ["transcribe"], "run1")
    seen: list[str] = []
    store.conn.set_trace_callback(seen.append)
    store.succeed_many([(job_id, 1, {})], 1002.0)
    store.conn.set_trace_callback(None)
    assert not any("job_chunks" in s for s in seen), seen
    store.close()


def _chunk(signature: str, offset: float, duration: float) -> dict[str, Any]:
    return {
        "signature": signature,
        "offset_s": offset,
        "duration_s": duration,
        "segments": [{"id": 0, "start": offset, "end": offset + 1.5, "text": " Hello."}],
        "language": "en",
        "language_probability": 1.0,
    }


def test_a_new_attempt_takes_the_kept_chunks_in_order_while_they_match() -> None:
    kept = [_chunk("s1", 0, 30), _chunk("s1", 30, 29.5), _chunk("other", 59.5, 30), _chunk("s1", 89.5, 30)]
    assert resumable(kept, "s1") == kept[:2]  # stops at the first that does not match
    assert resumable(kept, "s2") == []
    assert resumable([{"signature": "s1"}], "s1") == []  # a chunk missing fields is not taken
    assert same_cut(kept[1], 30.0, 29.5) and not same_cut(kept[1], 30.0, 29.4)


def test_the_signature_changes_with_the_input_and_the_settings_that_shape_the_transcript(tmp_path: Path) -> None:
    f = tmp_path / "a.wav"
    f.write_bytes(b"x" * 100)
    cfg = Settings(data_dir=tmp_path).transcribe
    one = input_signature(str(f), cfg, "/m", True)
    assert input_signature(str(f), cfg, "/m", True) == one
    assert input_signature(str(f), cfg, "/other-model", True) != one
    assert input_signature(str(f), cfg, "/m", False) != one  # VAD off
    assert input_signature(str(f), cfg.model_copy(update={"chunk_s": 60.0}), "/m", True) != one
    assert input_signature(str(f), cfg.model_copy(update={"batch_size": 1}), "/m", True) != one
    # batched either way, in chunks of the same length: the same transcript
    fixed = cfg.model_copy(update={"chunk_s": 120.0})
    assert input_signature(str(f), fixed.model_copy(update={"batch_size": 8}), "/m", True) == input_signature(
        str(f), fixed, "/m", True
    )
    # without chunk_s, the batch sets the chunk's length (chunk_length_s): cut elsewhere
    assert input_signature(str(f), cfg.model_copy(update={"batch_size": 8}), "/m", True) != one
    f.write_bytes(b"y" * 100)  # same size, new modification time
    os.utime(f, ns=(1, 1))
    assert input_signature(str(f), cfg, "/m", True) != one


def test_an_input_replaced_with_the_same_size_and_time_does_not_resume(tmp_path: Path) -> None:
    # Given a recording and the signature of its kept chunks (small: hashed whole; large: sampled)
    cfg = Settings(data_dir=tmp_path).transcribe
    for size in (100_000, 12 * 2**20):
        f = tmp_path / f"call-{size}.wav"
        f.write_bytes(os.urandom(size))
        st = f.stat()
        one = input_signature(str(f), cfg, "/m", True)
        # When another recording of the same size replaces it, its modification time kept (cp -p)
        f.write_bytes(os.urandom(size))
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns
        # Then the signature tells them apart
        assert input_signature(str(f), cfg, "/m", True) != one, size


@pytest.mark.usefixtures("model_installed")
def test_the_same_model_in_another_install_folder_gives_the_same_signature(tmp_path: Path) -> None:
    # Given the bundled model, and the same model installed elsewhere (another box's path)
    bundled = Path(resolve_model("tiny.en", tmp_path / "models"))
    elsewhere = tmp_path / "opt" / "other-install" / "model"
    shutil.copytree(bundled, elsewhere)
    f = tmp_path / "a.wav"
    f.write_bytes(b"x" * 100)
    cfg = Settings(data_dir=tmp_path).transcribe
    # Then kept chunks match across the two
    assert input_signature(str(f), cfg, str(bundled), True) == input_signature(str(f), cfg, str(elsewhere), True)
    # ... but not with other weights of the same size and configuration (a fine-tuned copy)
    weights = elsewhere / "model.bin"
    raw = bytearray(weights.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 8 * 2**20] = os.urandom(8 * 2**20)
    weights.write_bytes(bytes(raw))
    assert input_signature(str(f), cfg, str(bundled), True) != input_signature(str(f), cfg, str(elsewhere), True)


def _w(word: str, start: float, end: float) -> SimpleNamespace:
    return SimpleNamespace(word=word, start=start, end=end, probability=0.9)


def test_a_batched_window_is_cut_into_cues_at_sentences_and_pauses() -> None:
    words = [
        _w(" And", 0.0, 0.3),
        _w(" Mr.", 0.3, 0.6),  # an abbreviation: no cut
        _w(" John", 0.6, 1.0),
        _w(" spoke.", 1.0, 1.5),  # a sentence's end: cut
        _w(' "Yes."', 1.6, 2.0),  # ends in a quote: still a sentence's end
        _w(" then", 2.0, 2.4),
        _w(" later", 4.0, 4.5),  # a pause of 1.6 s: cut
    ]
    model = {"avg_logprob": -0.25, "no_speech_prob": 0.01, "compression_ratio": 1.2}  # the window's
    seg = SimpleNamespace(words=words, text="".join(w.word for w in words), start=0.0, end=4.5, tokens=[1], **model)
    got = cues(seg, 100.0, words=True)
    assert [c["text"] for c in got] == [" And Mr. John spoke.", ' "Yes."', " then", " later"]
    assert [(c["start"], c["end"]) for c in got] == [(100.0, 101.5), (101.5, 102.0), (102.0, 102.4), (102.4, 104.5)]
    assert got[0]["words"][1] == {"start": 100.3, "end": 100.6, "word": " Mr.", "probability": 0.9}
    assert all(type(c["start"]) is float for c in got)
    # each cue has the window's confidence (faster-whisper gives it per window)
    assert all({k: c[k] for k in model} == model and c["tokens"] == [] for c in got), got
    # a window without word times stays one segment; an empty one gives none
    plain = SimpleNamespace(words=None, text=" hello", start=1.0, end=2.0, tokens=[7], **model)
    assert cues(plain, 0.0, words=False) == [{"start": 1.0, "end": 2.0, "text": " hello", **model, "tokens": [7]}]
    empty = SimpleNamespace(words=None, text=" ", start=1.0, end=2.0, tokens=[], **model)
    assert cues(empty, 0.0, words=False) == []


def test_speech_is_looked_for_where_batched_windows_left_a_stretch_without_words() -> None:
    # A chunk of 100 s: words heard up to 40.0 s, the next window's first word at 62.5 s
    assert missed_stretch(40.0, 62.5, 100.0) == (40.0 + MISSED_MARGIN_S, 62.5 - MISSED_MARGIN_S)
    # Before the first word, the stretch starts at the chunk's start
    assert missed_stretch(0.0, 12.0, 100.0) == (0.0, 12.0 - MISSED_MARGIN_S)
    # After the last word, it runs to the chunk's end
    assert missed_stretch(90.0, 100.0, 100.0) == (90.0 + MISSED_MARGIN_S, 100.0)
    # Words closer than MISSED_GAP_S leave nothing to look at (an ordinary pause)
    assert missed_stretch(40.0, 40.0 + MISSED_GAP_S - 0.01, 100.0) is None
    assert missed_stretch(99.0, 100.0, 100.0) is None


def test_a_job_with_a_wide_beam_decodes_fewer_chunks_at_once() -> None:
    # Given transcribe.chunks_at_once 2 and beam_size 5: a job with the default beam keeps both
    # chunks; one asking for beam 6 to 20 (750 MiB with 2 at once, measured at 20) decodes one
    assert chunks_at_once(2, 5, 5) == 2 and chunks_at_once(2, 1, 5) == 2
    assert chunks_at_once(2, 6, 5) == chunks_at_once(2, 20, 5) == chunks_at_once(1, 1, 5) == 1
    # And with 4 at once the budget is 20 beams: beam 10 decodes 2, beam 7 decodes 2
    assert chunks_at_once(4, 5, 5) == 4 and chunks_at_once(4, 10, 5) == 2 and chunks_at_once(4, 7, 5) == 2


def test_the_eta_comes_from_the_pace_of_the_chunks_this_attempt_decoded() -> None:
    # Given no chunk decoded yet by this attempt (a batch's segments come out together): no ETA
    assert eta_s(None, 600.0, 10.0) is None
    # Given 120 s decoded in 10 s, ending at 120 s of 600, 2 s ago: 40 s left, less the 2 s
    assert eta_s((10.0, 120.0, 120.0, 100.0), 600.0, 102.0) == pytest.approx(38.0)
    # Given a resumed attempt that took 300 s from kept chunks and decoded 120 s more in 6 s:
    # its own pace, not one counting the kept part as free
    assert eta_s((6.0, 120.0, 420.0, 50.0), 600.0, 50.0) == pytest.approx(9.0)
    # And it never goes below 0, nor past the end of the audio
    assert eta_s((10.0, 120.0, 120.0, 100.0), 600.0, 500.0) == 0.0
    assert eta_s((10.0, 120.0, 700.0, 100.0), 600.0, 100.0) == 0.0
    assert eta_s((10.0, 0.0, 120.0, 100.0), 600.0, 100.0) is None


def test_a_chunk_holds_about_one_batch_unless_chunk_s_is_set() -> None:
    cfg = Settings(data_dir="/tmp/x").transcribe
    assert chunk_length_s(cfg, vad=True) == 120.0  # the default 4 windows of 30 s
    assert chunk_length_s(cfg.model_copy(update={"batch_size": 6}), vad=True) == 180.0
    assert chunk_length_s(cfg.model_copy(update={"batch_size": 8}), vad=True) == 240.0
    assert chunk_length_s(cfg.model_copy(update={"batch_size": 2}), vad=True) == 120.0
    assert chunk_length_s(cfg.model_copy(update={"batch_size": 1}), vad=True) == 120.0
    assert chunk_length_s(cfg, vad=False) == 120.0  # no VAD: one window after another
    assert chunk_length_s(cfg.model_copy(update={"chunk_s": 45.0}), vad=True) == 45.0


def test_the_models_threads_share_the_cores_among_the_transcriptions_that_may_run_at_once() -> None:
    base = Settings(data_dir="/tmp/x")  # workers 2, transcribe max_concurrency 1
    assert model_threads(base, cores=2) == 2
    assert model_threads(base, cores=8) == 8
    two = Settings(data_dir="/tmp/x", kinds={"transcribe": {"max_concurrency": 2}})
    assert model_threads(two, cores=2) == 1
    assert model_threads(two, cores=8) == 4
    many = Settings(data_dir="/tmp/x", workers=4, kinds={"transcribe": {"max_concurrency": 8}})
    assert model_threads(many, cores=2) == 1  # never 0
    assert model_threads(Settings(data_dir="/tmp/x", transcribe={"cpu_threads": 3}), cores=8) == 3


@pytest.mark.parametrize(
    "bad",
    [
        {"segments": [{"start": 0.0, "end": 1.0, "text": " a"}, 7]},  # not a segment
        {"segments": [{"id": 0, "text": "x"}]},  # no times
        {"segments": [{"start": "1", "end": 2.0, "text": "x"}]},  # a time that is not a number
        {"segments": [{"start": True, "end": 2.0, "text": "x"}]},
        {"segments": [{"start": 0.0, "end": 1.0, "text": None}]},
        {"segments": [{"start": 0.0, "end": 1.0, "text": "x", "words": "w"}]},
        {"language_probability": "high"},
        {"language": 5},
        {"offset_s": None},
    ],
)
def test_a_kept_chunk_a_later_attempt_could_not_read_is_decoded_again(bad: dict[str, Any]) -> None:
    # Given kept chunks of which the second was sent by a node with the right signature and
    # fields a later attempt cannot read (before: the attempts failed with internal_error,
    # TypeError or KeyError, until the job failed)
    kept = [_chunk("s1", 0, 30), {**_chunk("s1", 30, 30), **bad}, _chunk("s1", 60, 30)]
    # Then the new attempt takes the chunks before it and decodes from there
    assert resumable(kept, "s1") == kept[:1]


def test_a_chunk_index_or_size_out_of_bounds_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    from edge_queue.store.chunks import MAX_CHUNK_BYTES, MAX_CHUNK_INDEX

    store = Store(tmp_path / "q.db")
    job = {"job_id": _job(store)}
    # before: an index of 10**40 raised OverflowError from SQLite, which ended the hub
    for index in (10**40, -1, MAX_CHUNK_INDEX + 1):
        with pytest.raises(ValueError):
            store.keep_chunk(job["job_id"], 1, index, {"x": 1})
    with pytest.raises(ValueError):
        store.keep_chunk(job["job_id"], 1, 0, {"x": "y" * (MAX_CHUNK_BYTES + 1)})
    assert store.kept_chunks(job["job_id"]) == []
    store.keep_chunk(job["job_id"], 1, MAX_CHUNK_INDEX, {"x": 1})
    assert [c["index"] for c in store.kept_chunks(job["job_id"])] == [MAX_CHUNK_INDEX]


def test_a_job_keeps_at_most_its_total_of_chunk_bytes_and_a_replaced_chunk_counts_once(tmp_path: Path) -> None:
    # Given a job whose node sends chunks of nearly 4 MiB at every index (before: every one was
    # kept, up to 100,001 of them: 400 GiB on the hub's disk)
    from edge_queue.store.chunks import MAX_CHUNK_BYTES, MAX_JOB_CHUNK_BYTES

    store = Store(tmp_path / "q.db")
    job_id = _job(store)
    big = {"x": "y" * (MAX_CHUNK_BYTES - 100)}
    fits = MAX_JOB_CHUNK_BYTES // MAX_CHUNK_BYTES  # 16
    for index in range(fits):
        store.keep_chunk(job_id, 1, index, big)
    # Then the next one is refused and nothing of it is written
    with pytest.raises(ValueError, match="kept chunks would hold"):
        store.keep_chunk(job_id, 1, fits, big)
    assert len(store.kept_chunks(job_id)) == fits
    # and one sent again at a kept index replaces it, counted once
    store.keep_chunk(job_id, 1, 0, {**big, "again": True})
    assert store.kept_chunks(job_id)[0]["data"]["again"] is True
    # and another job is not held back by this one's chunks
    other = _job(store, "y")
    store.keep_chunk(other, 1, 0, big)
    with sqlite3.connect(tmp_path / "q.db") as conn:
        (total,) = conn.execute("SELECT sum(length(data)) FROM job_chunks WHERE job_id = ?", [job_id]).fetchone()
    assert total <= MAX_JOB_CHUNK_BYTES
    store.close()
