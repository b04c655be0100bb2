"""The voice encoder of `diarize` (edge_queue/kinds/voice_encoder.py): Resemblyzer's weights
read without PyTorch, the exact file pinned, and its embeddings those of Resemblyzer itself;
``edge-queue doctor``'s check of them, installed, missing and damaged."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import uuid
from pathlib import Path
from typing import Any

import pytest

from edge_queue.kinds import voice_encoder
from edge_queue.kinds.torch_weights import MAGIC, PROTOCOL, WeightsError, load_state_dict

from .conftest import need, run_doctor

#: SHA-256 of resemblyzer 0.1.4's pretrained.pt (the wheel is pinned in requirements/model.txt).
WEIGHTS_SHA256 = "39373b86598fa3da9fcddee6142382efe09777e8d37dc9c0561f41f0070f134e"
#: Resemblyzer 0.1.4's own ``VoiceEncoder("cpu").embed_utterance`` of librivox-0930.wav read
#: with soundfile (torch 2.13.0, librosa 0.11.0): its first 8 values, and its largest.
REFERENCE_0930 = [0.018575, 0.0, 0.112564, 0.0, 0.0, 0.026917, 0.0, 0.0]
REFERENCE_0930_MAX = (243, 0.343296)


@pytest.fixture(scope="module")
def weights() -> Path:
    try:
        return voice_encoder.weights_path()
    except voice_encoder.NoVoiceModel as e:
        need(False, str(e))
        raise


def test_the_weights_are_the_pinned_file_with_the_tensors_the_encoder_expects(weights: Path) -> None:
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == WEIGHTS_SHA256
    tensors = load_state_dict(weights)
    assert {name: v.shape for name, v in tensors.items()} == {
        **voice_encoder.SHAPES,
        "similarity_weight": (1,),
        "similarity_bias": (1,),
    }
    assert all(v.dtype.name == "float32" for v in tensors.values())


def test_an_utterance_embeds_as_resemblyzer_embeds_it(weights: Path, speech: Path) -> None:
    import numpy as np

    from edge_queue.kinds.audio import decode_pcm

    wav = np.concatenate(list(decode_pcm(str(speech / "librivox-0930.wav"))))
    got = voice_encoder.encoder().embed_utterance(wav)
    assert got.shape == (256,)
    assert np.allclose(got[:8], REFERENCE_0930, atol=2e-5)
    assert int(np.argmax(got)) == REFERENCE_0930_MAX[0] and abs(got.max() - REFERENCE_0930_MAX[1]) < 2e-5


def test_two_voices_are_further_apart_than_one_voice_with_itself(weights: Path, speech: Path) -> None:
    import numpy as np

    from edge_queue.kinds.audio import decode_pcm

    def embed(name: str) -> np.ndarray:
        return voice_encoder.encoder().embed_utterance(np.concatenate(list(decode_pcm(str(speech / name)))))

    reader_a, reader_b, jfk = embed("librivox-0870.wav"), embed("librivox-0890.wav"), embed("jfk.flac")
    assert reader_a @ reader_b > 0.85 > 0.65 > max(jfk @ reader_a, jfk @ reader_b)


def test_a_file_that_is_no_legacy_checkpoint_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "other.pt"
    other.write_bytes(b"PK\x03\x04 a zip checkpoint")
    with pytest.raises(WeightsError):
        load_state_dict(other)


def test_a_checkpoint_naming_any_other_global_is_refused_without_importing_it(tmp_path: Path) -> None:
    # Given a checkpoint whose object would call os.system when unpickled by pickle itself
    evil = tmp_path / "evil.pt"
    with open(evil, "wb") as f:
        for part in (MAGIC, PROTOCOL, {}):
            pickle.dump(part, f, protocol=2)
        f.write(b"\x80\x02cos\nsystem\nq\x00X\x04\x00\x00\x00truq\x01\x85q\x02Rq\x03.")
    # Then the reader names the global and runs nothing
    with pytest.raises(WeightsError, match="os.system"):
        load_state_dict(evil)


def test_the_mel_filters_are_librosas_slaney_filters() -> None:
    import numpy as np

    filters = voice_encoder.mel_filters()
    assert filters.shape == (40, 201)
    # each filter a triangle of unit area on the Hz axis (Slaney's normalization, 40 Hz bins)
    assert np.allclose(filters.sum(axis=1) * 40.0, 1.0, atol=0.08)
    assert voice_encoder.mel_frames(np.zeros(16000, np.float32)).shape == (101, 40)


def test_the_lstm_runs_its_products_on_one_blas_thread(weights: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy's OpenBLAS spreads each small product over every core; on a busy 2-core box the
    threads wait on each other (480 products: 4.7 s on 2 threads, 0.14 s on one)."""
    import numpy as np
    from threadpoolctl import threadpool_info

    enc = voice_encoder.encoder()
    seen: list[list[int]] = []
    embed = enc._embed  # noqa: SLF001  (the test's own wrap of the step under the limit)

    def counted(x: object) -> object:
        seen.append([lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"])
        return embed(x)

    monkeypatch.setattr(enc, "_embed", counted)
    out = enc.embed_mels(np.zeros((2, 160, 40), np.float32))
    assert out.shape == (2, 256)
    need(bool(seen[0]), "numpy has no BLAS that threadpoolctl knows here")
    assert seen == [[1] * len(seen[0])], seen


def test_doctor_says_whether_the_speaker_model_is_there_and_loads(
    mosquitto: Any, tmp_path: Path, root: Path, weights: Path
) -> None:
    # Given a box whose other checks pass (the shared mosquitto, a fresh data dir, a media root)
    env = {
        **os.environ,
        "EDGE_QUEUE_DATA_DIR": str(tmp_path / "data"),
        "EDGE_QUEUE_MEDIA_ROOTS": json.dumps([str(root)]),
        "EDGE_QUEUE_MQTT__HOST": mosquitto.host,
        "EDGE_QUEUE_MQTT__PORT": str(mosquitto.port),
        "EDGE_QUEUE_MQTT__BASE_TOPIC": "spk" + uuid.uuid4().hex[:8],
        "EDGE_QUEUE_HTTP__ENABLED": "false",
    }

    def doctor(resemblyzer: bytes | None = None, installed: bool = True, **extra: str) -> tuple[int, str]:
        """``doctor``'s exit code and its speaker model line; with ``resemblyzer``, a package of
        that name found before the installed one, its ``pretrained.pt`` those bytes (b"": none,
        b"/": a folder); not ``installed``: no package of that name found at all."""
        run_env = {**env, **extra}
        shadow = tmp_path / f"shadow-{uuid.uuid4().hex[:6]}"
        (shadow / "resemblyzer").mkdir(parents=True)
        if not installed:  # the venv's own package hidden: sitecustomize runs before doctor
            (shadow / "sitecustomize.py").write_text("import sys\n\nsys.modules['resemblyzer'] = None\n")
        elif resemblyzer is not None:
            init = "raise ImportError('never imported: its weights are read')\n"
            (shadow / "resemblyzer" / "__init__.py").write_text(init)
            if resemblyzer == b"/":
                (shadow / "resemblyzer" / "pretrained.pt").mkdir()
            elif resemblyzer:
                (shadow / "resemblyzer" / "pretrained.pt").write_bytes(resemblyzer)
        run_env["PYTHONPATH"] = os.pathsep.join([str(shadow), env.get("PYTHONPATH", "")])
        out = run_doctor(run_env)
        lines = [line for line in out.stdout.splitlines() if "speaker model:" in line]
        assert len(lines) == 1, out.stdout + out.stderr
        return out.returncode, lines[0]

    # When the weights are installed: they load and run
    code, line = doctor()
    assert code == 0 and line.startswith(f"ok    speaker model: {weights} loads and runs"), line

    # When resemblyzer is not installed: a warning that says what fails and how to install it...
    code, line = doctor(installed=False)
    assert code == 0 and line.startswith("warn  speaker model: no voice model: install resemblyzer"), line
    assert "jobs with diarize fail internal_error" in line
    # ...and a failure when a watch folder's rule asks for diarize (every job of it would fail)
    rule = {"path": str(root / "inbox"), "kind": "transcribe", "options": {"diarize": True}}
    code, line = doctor(installed=False, EDGE_QUEUE_WATCH=json.dumps([rule]))
    assert code == 1 and line.startswith("FAIL  speaker model: no voice model"), line
    assert str(root / "inbox") in line

    # When the package is installed without its weights (deleted, or a folder in their place): a
    # failure naming the file and the remedy a plain install would not give ("already satisfied")
    for missing, said in ((b"", "is missing"), (b"/", "is not a file")):
        code, line = doctor(missing)
        assert code == 1 and line.startswith("FAIL  speaker model: "), line
        assert f"resemblyzer{os.sep}pretrained.pt {said}" in line and "--force-reinstall" in line, line

    # When the file is there but damaged (cut short): a failure naming the file and the remedy
    code, line = doctor(weights.read_bytes()[:4096])
    assert code == 1 and line.startswith("FAIL  speaker model: ") and "cannot be loaded" in line, line
    assert "pretrained.pt" in line and "--force-reinstall" in line


def storages_at(data: bytes) -> int:
    """The offset of the first storage of a legacy checkpoint: after its five pickles."""
    import io
    import pickletools

    f = io.BytesIO(data)
    for _ in range(5):
        for _op in pickletools.genops(f):
            pass
    return f.tell()


def test_a_damaged_storage_size_is_refused_before_it_is_read(tmp_path: Path, weights: Path) -> None:
    # Given the weights with their first storage's element count damaged, or the file cut inside it
    data = weights.read_bytes()
    at = storages_at(data)
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes(data[:at] + (94770391368112).to_bytes(8, "little") + data[at + 8 :])
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[: at + 4096])
    # Then the reader says so (no MemoryError from reading terabytes)
    with pytest.raises(WeightsError, match="holds 94770391368112 elements"):
        load_state_dict(damaged)
    with pytest.raises(WeightsError, match="is short"):
        load_state_dict(cut)


def shadow_package(root: Path, weights: bytes | None) -> Path:
    """A ``resemblyzer`` package under ``root`` whose ``pretrained.pt`` is ``weights`` (None: none)."""
    package = root / "resemblyzer"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('never imported: its weights are read')\n")
    if weights is not None:
        (package / "pretrained.pt").write_bytes(weights)
    return package / "pretrained.pt"


@pytest.mark.parametrize("damage", ["cut", "count", "missing"])
def test_a_diarize_job_with_unusable_weights_fails_at_once_naming_the_file_and_the_remedy(
    tmp_path: Path, weights: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    from edge_queue.errors import ErrorCode, JobError
    from edge_queue.kinds.diarize import require_voice_model

    # Given an installed resemblyzer whose weights are cut short, damaged, or gone
    data = weights.read_bytes()
    at = storages_at(data)
    bad = {"cut": data[:4096], "count": data[:at] + b"\xff" * 8 + data[at + 8 :], "missing": None}[damage]
    path = shadow_package(tmp_path, bad)
    monkeypatch.syspath_prepend(str(tmp_path))
    voice_encoder.encoder.cache_clear()
    try:
        # When a diarize job checks the voice model (before anything is decoded)
        with pytest.raises(JobError) as failed:
            require_voice_model()
    finally:
        voice_encoder.encoder.cache_clear()
    # Then it fails internal_error, not retried, naming the file and the remedy
    assert failed.value.code == ErrorCode.INTERNAL_ERROR and failed.value.retryable is False
    assert str(path) in failed.value.message and "--force-reinstall" in failed.value.message, failed.value.message
