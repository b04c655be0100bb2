"""Tensors read from a PyTorch checkpoint without PyTorch: the legacy serialization format
that ``torch.save`` wrote before 1.6 (and with ``_use_new_zipfile_serialization=False``), as
Resemblyzer's ``pretrained.pt`` is written.

The format (torch/serialization.py, ``_legacy_save``): five pickles in a row, then the raw
storages. The pickles are a magic number, the protocol version (1001), the system's sizes,
the object itself (tensors as ``torch._utils._rebuild_tensor_v2`` calls over storages named
by persistent ids ``("storage", type, key, location, numel)``), and the list of storage keys
in the order the storages follow; each storage is an 8-byte little-endian element count and
the elements, little-endian. Only the few globals a state dict needs are resolved
(:data:`ALLOWED`): anything else in the file is refused, never imported.
"""

from __future__ import annotations

import os
import pickle
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

MAGIC = 0x1950A86A20F9469CFC6C
PROTOCOL = 1001
#: The storage types read, by their name in the pickle: numpy dtype and bytes per element.
STORAGES = {"FloatStorage": ("<f4", 4), "DoubleStorage": ("<f8", 8), "LongStorage": ("<i8", 8)}


class WeightsError(ValueError):
    """The file is not a legacy PyTorch checkpoint this reader can take."""


@dataclass(frozen=True, slots=True)
class _Storage:
    key: str
    dtype: str
    size: int


@dataclass(frozen=True, slots=True)
class _TensorRef:
    storage: _Storage
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _StorageType:
    name: str


def _rebuild_tensor_v2(storage: _Storage, offset: int, shape: Any, stride: Any, *_: Any) -> _TensorRef:
    return _TensorRef(storage, int(offset), tuple(shape), tuple(stride))


ALLOWED: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    **{("torch", name): _StorageType(name) for name in STORAGES},
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, f: IO[bytes]) -> None:
        super().__init__(f, encoding="utf-8")
        self.storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED[(module, name)]
        except KeyError:
            raise WeightsError(f"unexpected global {module}.{name} in the checkpoint") from None

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise WeightsError(f"unexpected persistent id {pid!r:.80}")
        kind, key, size = pid[1], str(pid[2]), int(pid[4])
        if not isinstance(kind, _StorageType):
            raise WeightsError(f"unexpected storage type {kind!r:.80}")
        if len(pid) > 5 and pid[5] is not None:
            raise WeightsError("storage views are not supported")
        storage = self.storages.setdefault(key, _Storage(key, STORAGES[kind.name][0], size))
        return storage


def load_state_dict(path: Path, entry: str = "model_state") -> dict[str, Any]:
    """The tensors of ``path``'s ``entry`` (a state dict) as numpy arrays, by name.

    Raises :class:`WeightsError` when the file is not a legacy PyTorch checkpoint (a magic
    number or protocol that differs, a global other than :data:`ALLOWED`, a storage short or of
    another size than its tensors say, checked before it is read) or
    has no such entry."""
    import numpy as np

    with open(path, "rb") as f:
        try:
            if pickle.load(f) != MAGIC or pickle.load(f) != PROTOCOL:
                raise WeightsError(f"{path} is not a legacy PyTorch checkpoint")
            pickle.load(f)  # the writer's type sizes: little-endian is checked by the dtypes
            reader = _Unpickler(f)
            top = reader.load()
            keys = pickle.load(f)
        except (pickle.UnpicklingError, EOFError) as e:
            raise WeightsError(f"{path}: {e}") from e
        data: dict[str, Any] = {}
        for key in keys:
            storage = reader.storages.get(str(key))
            if storage is None:
                raise WeightsError(f"{path}: storage {str(key)[:40]!r} is not one the tensors name")
            head = f.read(8)
            count = int(np.frombuffer(head, "<i8")[0]) if len(head) == 8 else -1
            if count != storage.size:  # checked before reading: a damaged count could ask for terabytes
                raise WeightsError(f"{path}: storage {key} holds {count} elements, not {storage.size}")
            want = count * np.dtype(storage.dtype).itemsize
            if want > os.fstat(f.fileno()).st_size - f.tell():
                raise WeightsError(f"{path}: storage {key} is short")
            raw = f.read(want)
            data[storage.key] = np.frombuffer(raw, storage.dtype)
    if not isinstance(top, dict) or not isinstance(top.get(entry), dict):
        raise WeightsError(f"{path} has no {entry!r}")
    out = {}
    for name, ref in top[entry].items():
        if isinstance(ref, _TensorRef):
            flat = data[ref.storage.key]
            itemsize = flat.dtype.itemsize
            strides = tuple(s * itemsize for s in ref.stride)
            view = np.lib.stride_tricks.as_strided(flat[ref.offset :], ref.shape, strides)
            out[name] = np.array(view, dtype=np.float32)
    return out
