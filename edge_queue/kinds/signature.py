"""What a transcription's kept chunks are matched on (docs/topics.md, "Long jobs resume"):
the input's content, sampled, and the model's identity, not where it is installed.

A kept chunk is taken by a later attempt, possibly on another box, only when its signature
matches. An input replaced by another recording of the same size and modification time (a
copy made with ``cp -p``, ``rsync -t``) must not match; the same model installed in another
folder (another install path, another worker node) must.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

#: Blocks of the input hashed for its signature, and their size: 64 x 64 KiB = 4 MiB read per
#: attempt whatever the file's size (measured on a 1-hour 16-kHz WAV of 115 MB: docs/topics.md).
SAMPLE_BLOCKS = 64
SAMPLE_BYTES = 64 * 2**10
#: The files of a CTranslate2 Whisper model folder that say what it decodes (the weights,
#: ``model.bin``, are sampled like an input).
MODEL_FILES = ("config.json", "preprocessor_config.json", "tokenizer.json", "vocabulary.txt", "vocabulary.json")
_MODEL_IDS: dict[tuple[str, int, int], str] = {}


def sampled_digest(source: str | Path | int) -> str:
    """SHA-256 (hex) of the file's size and :data:`SAMPLE_BLOCKS` blocks of
    :data:`SAMPLE_BYTES` at evenly spaced offsets from its start to its end (the whole file
    when it is smaller than that). ``source``: a path, or a descriptor of an open file (read
    with ``pread``, its offset untouched: a job's input, opened once by the worker). Raises
    ``OSError`` when it cannot be read."""
    if isinstance(source, int):
        return _digest_fd(source)
    fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _digest_fd(fd)
    finally:
        os.close(fd)


def _digest_fd(fd: int) -> str:
    digest = hashlib.sha256()
    size = os.fstat(fd).st_size
    digest.update(size.to_bytes(8, "big"))
    if size <= SAMPLE_BLOCKS * SAMPLE_BYTES:
        offset = 0
        while block := os.pread(fd, 1 << 20, offset):
            digest.update(block)
            offset += len(block)
        return digest.hexdigest()
    step = (size - SAMPLE_BYTES) / (SAMPLE_BLOCKS - 1)
    for i in range(SAMPLE_BLOCKS):
        digest.update(os.pread(fd, SAMPLE_BYTES, round(i * step)))
    return digest.hexdigest()


def model_identity(ref: str) -> str:
    """What a model decodes, independent of where it is installed: for a model folder, the
    SHA-256 of its :data:`MODEL_FILES` (names and contents) and of ``model.bin`` sampled
    (:func:`sampled_digest`); for a model name (``small``, fetched by faster-whisper), the name.
    Kept per folder while ``model.bin`` keeps its size and modification time."""
    folder = Path(ref)
    weights = folder / "model.bin"
    try:
        st = weights.stat()
    except OSError:
        return f"name:{ref}" if not folder.is_dir() else f"folder:{folder.name}"
    key = (str(folder), st.st_size, st.st_mtime_ns)
    if key not in _MODEL_IDS:
        digest = hashlib.sha256()
        for name in MODEL_FILES:
            if (folder / name).is_file():
                digest.update(name.encode() + b"\0" + (folder / name).read_bytes() + b"\0")
        digest.update(sampled_digest(weights).encode())
        _MODEL_IDS[key] = "sha256:" + digest.hexdigest()
    return _MODEL_IDS[key]
