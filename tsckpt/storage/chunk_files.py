"""Reading chunk files of a plain checkpoint on a local filesystem straight into numpy buffers.

TensorStore's ``file`` kvstore reads a 32 MiB chunk file from the page cache
at about 0.7 GB/s here (into a cord, then copied into a Python ``bytes``),
where one ``readinto`` runs at 8.8 GB/s (``benchmarks/bench_chunk_reads.py``).
So the verified reads (:mod:`tsckpt.storage.box_reader`) and an incremental
save's base checks read tsckpt's own encoded chunk files with plain file
calls, on a small thread pool (the GIL is released while a file is read).
Everything else still goes through TensorStore.

Failures are reported as TensorStore reports them, as ``ValueError`` with a
status prefix, so callers translate both alike: ``NOT_FOUND`` for a missing
file and ``OUT_OF_RANGE`` for one shorter than a range asked for.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from .layouts import PLAIN
from .store import Store

#: A few threads: enough to keep the page cache or a disk queue busy, few enough for 2-core machines.
_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tsckpt-chunk-read")


def local_directory(store: Store, path: str) -> str | None:
    """The directory holding array ``path``'s chunk files, where ``store`` is a plain checkpoint on a local
    filesystem; None elsewhere (object stores, the packed layout)."""
    if store.location.driver != "file" or store.layout.name != PLAIN:
        return None
    return os.path.join(str(store.location.spec.get("path", ".")), path)


def read_whole(path: str) -> Future[np.ndarray]:
    """Start reading a whole file; its bytes (``uint8``)."""
    return _POOL.submit(_whole, path)


def read_ranges(path: str, ranges: Sequence[tuple[int, int]]) -> Future[np.ndarray]:
    """Start reading the byte ranges ``[start, stop)`` of a file, one after the other into one buffer."""
    return _POOL.submit(_ranges, path, list(ranges))


def _whole(path: str) -> np.ndarray:
    try:
        f = open(path, "rb", buffering=0)
    except FileNotFoundError:
        raise _missing(path) from None
    with f:
        data = np.empty(os.fstat(f.fileno()).st_size, dtype=np.uint8)
        view, got = memoryview(data), 0
        while got < data.size:
            n = f.readinto(view[got:])
            if not n:
                break  # shrank since it was opened: the caller's size check refuses it
            got += n
    return data[:got]


def _ranges(path: str, ranges: list[tuple[int, int]]) -> np.ndarray:
    out = np.empty(sum(b - a for a, b in ranges), dtype=np.uint8)
    view = memoryview(out)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise _missing(path) from None
    try:
        at = 0
        for start, stop in ranges:
            while start < stop:
                n = os.preadv(fd, [view[at:at + stop - start]], start)
                if not n:
                    raise ValueError(f"OUT_OF_RANGE: {path} ends before byte {stop} (it was truncated)")
                at, start = at + n, start + n
    finally:
        os.close(fd)
    return out


def _missing(path: str) -> ValueError:
    return ValueError(f"NOT_FOUND: {path} is missing")
