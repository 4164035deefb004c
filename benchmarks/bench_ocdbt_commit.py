"""Why the packed layout saves slower than the plain one: one OCDBT commit against a raw fsync'd write.

One process writes ``--chunks`` chunks of ``--mb`` MiB each (a rank's share of
a 1 GB, 4-rank save, by default), in each of two ways, alternating:

* through TensorStore, as a packed save's rank does: a ``zarr3`` ``uint8``
  array over an OCDBT database on the local disk, every chunk written in one
  atomic transaction (``can_reference_source_data_indefinitely``), then the
  transaction committed: one data file, its B+tree nodes and a manifest;
* raw: the same bytes written to one file with ``os.write``, then ``fsync``.

Prints the median wall time with its range, and the median user and system
CPU time of the process.

    python benchmarks/bench_ocdbt_commit.py --chunks 16 --mb 16 --reps 6
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import table  # noqa: E402

import numpy as np  # noqa: E402
import tensorstore as ts  # noqa: E402

WAYS = ("OCDBT transaction commit", "raw write + fsync")


def _ocdbt(path: str, chunks: list[np.ndarray]) -> None:
    kvstore = {"driver": "ocdbt", "base": {"driver": "file", "path": path},
               "config": {"max_inline_value_bytes": 1024, "manifest_kind": "single"},
               "target_data_file_size": 2 * sum(c.nbytes for c in chunks)}
    n = chunks[0].size
    arr = ts.open({"driver": "zarr3", "kvstore": {**kvstore, "path": "a/"}, "create": True,
                   "metadata": {"shape": [len(chunks), n], "data_type": "uint8",
                                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1, n]}}}}).result()
    txn = ts.Transaction(atomic=True)
    for i, chunk in enumerate(chunks):
        arr.with_transaction(txn)[i].write(chunk, can_reference_source_data_indefinitely=True).result()
    txn.commit_async().result()


def _raw(path: str, chunks: list[np.ndarray]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for chunk in chunks:
            view, at = memoryview(chunk), 0
            while at < len(view):
                at += os.write(fd, view[at:])
        os.fsync(fd)
    finally:
        os.close(fd)


def _timed(fn: Callable[[], None]) -> tuple[float, float, float]:
    os.sync()
    t0, c0 = time.perf_counter(), os.times()
    fn()
    t1, c1 = time.perf_counter(), os.times()
    return t1 - t0, c1.user - c0.user, c1.system - c0.system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--mb", type=float, default=16.0, help="MiB per chunk")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    chunks = [rng.integers(0, 255, int(args.mb * 2**20), dtype=np.uint8) for _ in range(args.chunks)]
    root = tempfile.mkdtemp(dir=args.dir, prefix="bench_ocdbt_commit_")
    samples: dict[str, list[tuple[float, float, float]]] = {w: [] for w in WAYS}
    try:
        for rep in range(args.reps):
            for way in (WAYS if rep % 2 == 0 else WAYS[::-1]):
                path = os.path.join(root, f"{rep}-{WAYS.index(way)}")
                fn = _ocdbt if way == WAYS[0] else _raw
                samples[way].append(_timed(lambda: fn(path, chunks)))
                shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mib = args.chunks * args.mb
    print(f"{args.chunks} chunks of {args.mb:g} MiB ({mib:g} MiB), one process, medians of {args.reps}\n")
    rows = []
    for way, got in samples.items():
        wall, user, system = (sorted(x[i] for x in got) for i in range(3))
        rows.append([way, f"{statistics.median(wall):.3f} s ({wall[0]:.2f}-{wall[-1]:.2f})",
                     f"{statistics.median(user):.2f} s", f"{statistics.median(system):.2f} s ({system[0]:.2f}-{system[-1]:.2f})"])
    print(table(["way", "wall", "user CPU", "system CPU (range)"], rows, "lrrr"))


if __name__ == "__main__":
    main()
