"""numpy's matrix products on one thread while a block runs.

The voice encoder's LSTM (:mod:`.voice_encoder`) is 480 small products in a row; OpenBLAS
spreads each over every core, and on a busy 2-core box the threads wait on each other: 480
products of (20, 256) by (256, 1024) took 4.7 s on 2 threads against 0.14 s on one (measured
with a load average of 10). The thread count is set through OpenBLAS's own
``openblas_set_num_threads`` in the copy numpy loaded (what threadpoolctl does), found in
``/proc/self/maps``; anywhere else it is left alone.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

#: (set, get) symbol pairs: numpy's wheels (scipy-openblas, 64-bit integers), a system OpenBLAS.
SYMBOLS = (
    ("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
    ("openblas_set_num_threads64_", "openblas_get_num_threads64_"),
    ("openblas_set_num_threads", "openblas_get_num_threads"),
)


@cache
def _openblas() -> tuple[Any, Any] | None:
    import numpy  # noqa: F401  (loads its BLAS)

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower() and ".so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for set_name, get_name in SYMBOLS:
            if hasattr(lib, set_name) and hasattr(lib, get_name):
                return getattr(lib, set_name), getattr(lib, get_name)
    return None


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """Inside the block, numpy's products run on one thread; the count before is restored."""
    found = _openblas()
    if found is None:
        yield
        return
    set_threads, get_threads = found
    before = int(get_threads())
    set_threads(1)
    try:
        yield
    finally:
        set_threads(before)
