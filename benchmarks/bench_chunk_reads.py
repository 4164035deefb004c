"""Reading one chunk file from the page cache: TensorStore's file kvstore against plain file calls.

Why verified reads of a plain checkpoint on a local disk read tsckpt's chunk
files themselves (``tsckpt/storage/chunk_files.py``): one outer chunk of
``--mb`` MiB, written by ``tsckpt.save``, read back ``--reps`` times each way
in one process, the file in the page cache. Prints the best time of each.

    python benchmarks/bench_chunk_reads.py --mb 32 --reps 7
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import table  # noqa: E402

import tensorstore as ts  # noqa: E402
import torch  # noqa: E402

import tsckpt  # noqa: E402
from tsckpt.storage import chunk_files  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=32)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="tsckpt-chunk-reads-")
    try:
        tsckpt.save({"w": torch.randn(args.mb * 2**20 // (1280 * 2), 1280).bfloat16()}, root + "/ck", layout="plain")
        key = next(k for k in os.listdir(root + "/ck/w") if k.startswith("c"))
        path = os.path.join(root, "ck", "w", key)
        kv = ts.KvStore.open({"driver": "file", "path": root + "/ck/w/"}).result()
        ways = {"TensorStore file kvstore": lambda: kv.read(key).result().value,
                "file calls (chunk_files.read_whole)": lambda: chunk_files.read_whole(path).result()}
        rows = []
        for name, read in ways.items():
            best = float("inf")
            for _ in range(args.reps):
                t0 = time.perf_counter()
                read()
                best = min(best, time.perf_counter() - t0)
            rows.append([name, f"{best * 1e3:.1f} ms", f"{os.path.getsize(path) / best / 1e9:.1f} GB/s"])
        print(f"one {os.path.getsize(path) / 2**20:.0f} MiB chunk file, page cache warm, best of {args.reps}")
        print(table(["read", "time", "speed"], rows))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
