"""The bundled Whisper models stored as int8, as CTranslate2 makes them when it loads them.

Both bundled models are stored in float16 (``model.bin``). With ``compute_type = "int8"`` (the
default) CTranslate2 reads the whole file, then quantizes each linear layer's weights to int8
(one scale per row; the convolutions and the rest stay float). Loading base that way held its
145 MB file beside the int8 weights: its load peaked 257 MiB above the worker's memory before
it, for 138 MiB kept, and took 0.8-1.4 CPU-s. The same weights stored as int8 load with a peak
of 104 MiB above, in 0.2-0.8 CPU-s, and decode the same: the same detected probabilities and
the same transcripts (tests/test_languages.py).

The copy is made once per data directory, in a process of its own (its reading and quantizing
would stay in a worker's peak memory), into ``<data_dir>/models/``: written aside, then renamed
into place. When it cannot be made (another CTranslate2 whose model format or converter
differs), the float16 folder is used, as before.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: CTranslate2's ``model.bin`` version this reads and writes, and its data types by id.
BINARY_VERSION = 6
DTYPES = ("float32", "int8", "int16", "int32", "float16", "bfloat16")
#: The files of a model folder copied beside the new ``model.bin``.
MODEL_FILES = ("config.json", "tokenizer.json", "vocabulary.txt", "vocabulary.json", "preprocessor_config.json")


def stored_int8(folder: str, models_dir: Path) -> str:
    """The int8 copy of the float16 model ``folder`` under ``models_dir`` (made first when it
    is not yet: see the module's docstring); ``folder`` itself when it cannot be made."""
    weights = Path(folder) / "model.bin"
    try:
        st = weights.stat()
    except OSError:
        return folder
    key = hashlib.sha256(f"{Path(folder).resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:12]
    dest = models_dir / f"{Path(folder).name}-int8-{key}"
    if (dest / "model.bin").is_file():
        return str(dest)
    models_dir.mkdir(parents=True, exist_ok=True)
    with open(models_dir / ".int8.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be making it: wait for it
        if not (dest / "model.bin").is_file():
            aside = dest.with_name(dest.name + ".making")
            shutil.rmtree(aside, ignore_errors=True)
            done = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    f"from {__name__} import quantize, Path; quantize(Path({folder!r}), Path({str(aside)!r}))",
                ],
                capture_output=True,
                text=True,
                timeout=600,
            )
            if done.returncode != 0:
                shutil.rmtree(aside, ignore_errors=True)
                log.warning(
                    "the int8 copy of %s could not be made; loading it as it is: %s", folder, done.stderr[-500:]
                )
                return folder
            os.replace(aside, dest)
    return str(dest)


def read_model(path: Path) -> tuple[str, int, dict[str, Any]]:
    """A CTranslate2 ``model.bin``: its spec's name, its revision and its variables (name ->
    numpy array; an alias -> the array it names). Raises ``ValueError`` for another version."""
    import numpy as np

    data, at = path.read_bytes(), 0

    def take(fmt: str) -> int:
        nonlocal at
        (value,) = struct.unpack_from(fmt, data, at)
        at += struct.calcsize(fmt)
        return int(value)

    def text() -> str:
        nonlocal at
        size = take("H")
        at += size
        return data[at - size : at - 1].decode()

    if (version := take("I")) != BINARY_VERSION:
        raise ValueError(f"model.bin version {version}, not {BINARY_VERSION}")
    spec, revision = text(), take("I")
    variables: dict[str, Any] = {}
    for _ in range(take("I")):
        name, rank = text(), take("B")
        shape = [take("I") for _ in range(rank)]
        dtype, size = DTYPES[take("B")], take("I")
        if dtype == "bfloat16":
            raise ValueError(f"{name}: bfloat16")
        variables[name] = np.frombuffer(data, dtype=dtype, count=size // np.dtype(dtype).itemsize, offset=at)
        variables[name] = variables[name].reshape(shape)
        at += size
    for _ in range(take("I")):
        alias = text()
        variables[alias] = variables[text()]
    return spec, revision, variables


def quantize(folder: Path, out: Path) -> None:
    """Write ``folder``'s Whisper model into ``out`` with its linear layers' weights in int8,
    as CTranslate2 quantizes them at load: the rank-2 weights its spec gives a scale (one per
    row: 127 over the row's largest magnitude). ``ModelSpec.optimize("int8")`` would also
    quantize the convolutions, which CTranslate2 does not at load."""
    import numpy as np
    from ctranslate2.specs import model_spec
    from ctranslate2.specs.whisper_spec import WhisperSpec

    name, revision, variables = read_model(folder / "model.bin")
    if name != "WhisperSpec":
        raise ValueError(f"not a Whisper model: {name}")

    def layers(side: str) -> int:
        found = {k.split("/")[1] for k in variables if k.startswith(f"{side}/layer_")}
        return sum(1 for layer in found if layer.removeprefix("layer_").isdigit())

    heads = {side: int(variables[f"{side}/num_heads"]) for side in ("encoder", "decoder")}
    spec = WhisperSpec(layers("encoder"), heads["encoder"], layers("decoder"), heads["decoder"])
    if spec.revision != revision:
        raise ValueError(f"WhisperSpec revision {spec.revision}, the model's {revision}")
    for key, value in variables.items():
        scope, _, attr = key.rpartition("/")
        layer = model_spec.index_spec(spec, scope)
        if not hasattr(layer, attr):
            raise ValueError(f"{key}: not in WhisperSpec")
        if value.ndim == 2 and hasattr(layer, f"{attr}_scale"):
            weights, scale = int8_rows(value)
            setattr(layer, attr, weights)
            setattr(layer, f"{attr}_scale", scale)
        else:
            setattr(layer, attr, value[()] if value.ndim == 0 else np.array(value))
    spec.register_vocabulary((folder / "vocabulary.txt").read_text(encoding="utf-8").splitlines())
    spec.validate()
    spec.optimize(None)  # equal variables (the decoder's embeddings and projection) stored once
    out.mkdir(parents=True)
    spec.save(str(out))
    (out / "vocabulary.json").unlink()  # the folder's own vocabulary.txt instead
    for file in MODEL_FILES:
        if (folder / file).is_file():
            shutil.copyfile(folder / file, out / file)


def int8_rows(value: Any) -> tuple[Any, Any]:
    """A float matrix as int8 rows and their float32 scales, as CTranslate2 quantizes it."""
    import numpy as np

    rows = value.astype(np.float32)
    amax = np.amax(np.absolute(rows), axis=1)
    amax[amax == 0] = 127.0
    amax = np.maximum(amax, np.float32(127) / np.finfo(np.float32).max)
    scale = (127.0 / amax).astype(np.float32)
    return np.rint(rows * np.expand_dims(scale, 1)).astype(np.int8), scale
