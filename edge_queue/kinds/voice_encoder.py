"""Voice embeddings without PyTorch: Resemblyzer's voice encoder (the GE2E speaker encoder of
Wan et al., "Generalized End-to-End Loss for Speaker Verification", 2018) run in numpy from the
weights its PyPI package carries (``resemblyzer/pretrained.pt``, Apache-2.0, 17 MB; installed
hash-pinned from requirements/model.txt, read by :mod:`.torch_weights`).

The network, as Resemblyzer 0.1.4's ``voice_encoder.py`` and ``audio.py`` define it: a
40-channel mel power spectrogram of 16 kHz audio (25 ms Hann window, 10 ms hop, librosa's
Slaney mel scale; not a log-mel), a 3-layer LSTM of 256 units over partial windows of 160
frames (1.6 s), a linear layer of 256, ReLU and L2 normalization; an utterance's embedding is
the L2-normalized mean of its partial windows' (``embed_utterance``: 1.3 windows a second,
a last window kept when it holds 75 % of its frames, zero-padded). Agreement with Resemblyzer
itself: docs/topics.md, "Speakers".
"""

from __future__ import annotations

import importlib.util
import math
from functools import cache
from pathlib import Path
from typing import Any

from threadpoolctl import ThreadpoolController

from .torch_weights import load_state_dict

SAMPLE_RATE = 16000
N_FFT = 400  # 25 ms
HOP = 160  # 10 ms
N_MELS = 40
PARTIAL_FRAMES = 160  # 1.6 s
HIDDEN = 256
LAYERS = 3
#: Loudness an utterance is raised to before its mel (Resemblyzer's ``audio_norm_target_dBFS``,
#: increase only): the mel is a power spectrogram, so the embedding depends on the level.
TARGET_DBFS = -30.0
#: The tensors read and their shapes: the file is pinned by hash, and this says what it holds.
SHAPES: dict[str, tuple[int, ...]] = {
    **{
        name: shape
        for k in range(LAYERS)
        for name, shape in (
            (f"lstm.weight_ih_l{k}", (4 * HIDDEN, N_MELS if k == 0 else HIDDEN)),
            (f"lstm.weight_hh_l{k}", (4 * HIDDEN, HIDDEN)),
            (f"lstm.bias_ih_l{k}", (4 * HIDDEN,)),
            (f"lstm.bias_hh_l{k}", (4 * HIDDEN,)),
        )
    },
    "linear.weight": (HIDDEN, HIDDEN),
    "linear.bias": (HIDDEN,),
}


@cache
def _blas() -> ThreadpoolController:
    """The BLAS libraries loaded in this process (numpy's OpenBLAS), found once numpy is: the
    LSTM's 480 small products in a row run on one thread, as spreading each over the cores of a
    busy 2-core box made them 30 times slower (4.7 s against 0.14 s at a load average of 10)."""
    import numpy  # noqa: F401  (loads its BLAS before the libraries are listed)

    return ThreadpoolController()


class NoVoiceModel(RuntimeError):
    """Resemblyzer is not installed (requirements/model.txt)."""


class DamagedVoiceModel(RuntimeError):
    """Resemblyzer is installed but its weights cannot be used: ``pretrained.pt`` is missing
    from the package, is not a file, or cannot be read as the encoder's weights. The message
    names the file and the remedy (:data:`REINSTALL`)."""


#: What mends an installed package whose weights are missing or damaged.
REINSTALL = "install resemblyzer again from requirements/model.txt (--no-deps --force-reinstall)"


def weights_path() -> Path:
    """``pretrained.pt`` of the installed ``resemblyzer`` package, found without importing it
    (its ``__init__`` imports torch). Raises :class:`NoVoiceModel` when no such package is
    installed, :class:`DamagedVoiceModel` when the package has no such file."""
    spec = importlib.util.find_spec("resemblyzer")
    folders = [Path(folder) for folder in (spec.submodule_search_locations or [])] if spec else []
    for folder in folders:
        path = folder / "pretrained.pt"
        if path.is_file():
            return path
    if folders:
        path = folders[0] / "pretrained.pt"
        what = "is not a file" if path.exists() else "is missing"
        raise DamagedVoiceModel(f"{path} {what} (the resemblyzer package is installed): {REINSTALL}")
    raise NoVoiceModel("no voice model: install resemblyzer from requirements/model.txt (--no-deps)")


def load_encoder(path: Path) -> VoiceEncoder:
    """The voice encoder of the weights at ``path``. Raises :class:`DamagedVoiceModel` naming
    ``path`` and the remedy when they cannot be read as the encoder's weights."""
    try:
        return VoiceEncoder(load_state_dict(path))
    except Exception as e:  # a damaged or foreign file: the reader and the shapes raise plain errors
        raise DamagedVoiceModel(f"{path} cannot be loaded ({type(e).__name__}: {e}): {REINSTALL}") from e


@cache
def mel_filters() -> Any:
    """librosa 0.10's ``filters.mel(sr=16000, n_fft=400, n_mels=40)``: Slaney's mel scale
    (linear below 1 kHz, logarithmic above) and area normalization, shape (40, 201)."""
    import numpy as np

    def hz_to_mel(f: Any) -> Any:
        f = np.asarray(f, dtype=np.float64)
        lin = f / (200.0 / 3)
        return np.where(f >= 1000.0, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (math.log(6.4) / 27), lin)

    def mel_to_hz(m: Any) -> Any:
        return np.where(m >= 15.0, 1000.0 * np.exp((math.log(6.4) / 27) * (m - 15.0)), m * 200.0 / 3)

    fft_f = np.fft.rfftfreq(N_FFT, 1.0 / SAMPLE_RATE)
    mel_f = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(SAMPLE_RATE / 2), N_MELS + 2))
    fdiff = np.diff(mel_f)
    ramps = np.subtract.outer(mel_f, fft_f)
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0, np.minimum(lower, upper))
    weights *= (2.0 / (mel_f[2:] - mel_f[:-2]))[:, None]
    return weights.astype(np.float32)


def mel_frames(wav: Any) -> Any:
    """The mel power spectrogram of 16 kHz float32 ``wav``, frames by channels (n, 40), as
    librosa's ``melspectrogram`` makes it (centred frames, zero padding): ``len // 160 + 1``
    frames."""
    import numpy as np

    padded = np.pad(wav.astype(np.float32), N_FFT // 2)
    n = 1 + (padded.shape[0] - N_FFT) // HOP
    idx = np.arange(N_FFT)[None, :] + HOP * np.arange(n)[:, None]
    window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)).astype(np.float32)  # periodic Hann
    spec = np.fft.rfft(padded[idx] * window, axis=1)
    power = (spec.real**2 + spec.imag**2).astype(np.float32)
    return power @ mel_filters().T


def louder(wav: Any, target_dbfs: float = TARGET_DBFS) -> Any:
    """``wav`` raised to ``target_dbfs`` RMS when quieter (never lowered), as Resemblyzer's
    ``normalize_volume(increase_only=True)``; silence is left as it is."""
    import numpy as np

    rms = float(np.sqrt(np.mean(np.square(wav, dtype=np.float64)))) if wav.size else 0.0
    if rms <= 0:
        return wav
    change = target_dbfs - 20 * math.log10(rms)
    return wav if change < 0 else (wav * 10 ** (change / 20)).astype(np.float32)


class VoiceEncoder:
    """The encoder's weights, loaded once per process (:func:`encoder`)."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        for name, shape in SHAPES.items():
            if name not in tensors or tuple(tensors[name].shape) != shape:
                raise ValueError(f"voice model: {name} is not {shape}")
        self.layers = [
            (
                tensors[f"lstm.weight_ih_l{k}"].T.copy(),
                tensors[f"lstm.weight_hh_l{k}"].T.copy(),
                tensors[f"lstm.bias_ih_l{k}"] + tensors[f"lstm.bias_hh_l{k}"],
            )
            for k in range(LAYERS)
        ]
        self.linear = (tensors["linear.weight"].T.copy(), tensors["linear.bias"])

    def embed_mels(self, mels: Any) -> Any:
        """Embeddings (batch, 256) of mel windows (batch, frames, 40): the last layer's final
        hidden state through the linear layer, ReLU, L2-normalized (PyTorch's LSTM gate
        order: input, forget, cell, output)."""
        import numpy as np

        with _blas().limit(limits=1, user_api="blas"):
            return self._embed(mels.astype(np.float32))

    def _embed(self, x: Any) -> Any:
        import numpy as np

        batch, steps = x.shape[0], x.shape[1]
        h = np.zeros((batch, HIDDEN), np.float32)
        for w_ih, w_hh, bias in self.layers:
            gates_in = x @ w_ih + bias  # (batch, steps, 4H) at once: only the recurrence is a loop
            h = np.zeros((batch, HIDDEN), np.float32)
            c = np.zeros((batch, HIDDEN), np.float32)
            out = np.empty((batch, steps, HIDDEN), np.float32)
            for t in range(steps):
                g = gates_in[:, t] + h @ w_hh
                i, f = _sigmoid(g[:, :HIDDEN]), _sigmoid(g[:, HIDDEN : 2 * HIDDEN])
                cell, o = np.tanh(g[:, 2 * HIDDEN : 3 * HIDDEN]), _sigmoid(g[:, 3 * HIDDEN :])
                c = f * c + i * cell
                h = o * np.tanh(c)
                out[:, t] = h
            x = out
        raw = np.maximum(h @ self.linear[0] + self.linear[1], 0)
        return raw / np.maximum(np.linalg.norm(raw, axis=1, keepdims=True), 1e-12)

    def partials(self, wav: Any, rate: float = 1.3, min_coverage: float = 0.75) -> tuple[Any, list[int]]:
        """The embeddings (n, 256) of ``wav``'s partial windows of 1.6 s, ``rate`` windows a
        second, and each window's first sample (:func:`partial_mels`)."""
        windows, starts = partial_mels(wav, rate, min_coverage)
        return self.embed_mels(windows), starts

    def embed_utterance(self, wav: Any) -> Any:
        """The embedding (256,) of an utterance: its partial windows' mean, L2-normalized
        (Resemblyzer's ``embed_utterance`` on the same, already preprocessed, audio)."""
        import numpy as np

        parts, _ = self.partials(wav)
        mean = parts.mean(axis=0)
        return mean / max(float(np.linalg.norm(mean)), 1e-12)


def partial_mels(wav: Any, rate: float = 1.3, min_coverage: float = 0.75) -> tuple[Any, list[int]]:
    """The mel windows (n, 160, 40) of ``wav``'s partial windows of 1.6 s, ``rate`` windows a
    second, and each window's first sample, as Resemblyzer's ``compute_partial_slices`` cuts
    them (at least one window; the audio zero-padded to the last window's end)."""
    import numpy as np

    n_frames = math.ceil((wav.shape[0] + 1) / HOP)
    step = max(1, round(SAMPLE_RATE / rate / HOP))
    starts = list(range(0, max(1, n_frames - PARTIAL_FRAMES + step + 1), step))
    coverage = (wav.shape[0] - starts[-1] * HOP) / (PARTIAL_FRAMES * HOP)
    if coverage < min_coverage and len(starts) > 1:
        starts.pop()
    end = (starts[-1] + PARTIAL_FRAMES) * HOP
    if end >= wav.shape[0]:
        wav = np.pad(wav, (0, end - wav.shape[0]))
    mel = mel_frames(wav)
    windows = np.stack([mel[s : s + PARTIAL_FRAMES] for s in starts])
    return windows, [s * HOP for s in starts]


def _sigmoid(x: Any) -> Any:
    import numpy as np

    return 0.5 * (np.tanh(0.5 * x) + 1.0)


@cache
def encoder() -> VoiceEncoder:
    """The voice encoder of the installed weights, loaded once per process (0.1 s, 5.6 MB of
    float32). Raises :class:`NoVoiceModel` when they are not installed, :class:`DamagedVoiceModel`
    when they are but cannot be used (neither is kept: a later call tries again)."""
    return load_encoder(weights_path())
