"""Making a rank's chunk files durable: an fsync per file, or writeback started per file and one syncfs.

Why :class:`tsckpt.storage.byte_writes.Files` defers durability to
one ``syncfs`` per rank: ``--ranks`` processes each write ``--files`` files of
about ``--mb`` MiB (as a 1 GB, 4-rank save of the untuned workload does) on 4
threads, in each of three ways, alternating; prints the median of the slowest
process's time and the system CPU time summed over processes.

    python -m benchmarks fsync --ranks 4 --files 116 --mb 2 --reps 6
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import table  # noqa: E402

import numpy as np  # noqa: E402

from tsckpt.storage import localfs  # noqa: E402

WAYS = ("fsync per file", "writeback per file, one syncfs", "one syncfs")


def _rank(root: str, way: str, rank: int, files: int, mb: float, queue: mp.Queue, start: mp.Barrier) -> None:
    data = np.random.default_rng(rank).integers(0, 255, int(mb * 2**20), dtype=np.uint8)
    folder = os.path.join(root, str(rank))
    os.makedirs(folder)
    start.wait()
    t0, c0 = time.perf_counter(), os.times()

    def one(k: int) -> None:
        fd = os.open(os.path.join(folder, str(k)), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            os.write(fd, data)
            if way == WAYS[0]:
                os.fsync(fd)
            elif way == WAYS[1]:
                localfs.start_writeback(fd)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(files)))
    if way != WAYS[0]:
        localfs.syncfs_at(folder)
    queue.put((time.perf_counter() - t0, os.times().system - c0.system))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--files", type=int, default=116)
    ap.add_argument("--mb", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="tsckpt-fsync-", dir=args.dir)
    results: dict[str, list[tuple[float, float]]] = {w: [] for w in WAYS}
    ctx = mp.get_context("spawn")
    try:
        for rep in range(args.reps):
            for way in WAYS[rep % len(WAYS):] + WAYS[:rep % len(WAYS)]:  # who goes first rotates
                where = os.path.join(root, "run")
                shutil.rmtree(where, ignore_errors=True)
                os.makedirs(where)
                os.sync()
                queue, start = ctx.Queue(), ctx.Barrier(args.ranks)
                procs = [ctx.Process(target=_rank, args=(where, way, r, args.files, args.mb, queue, start))
                         for r in range(args.ranks)]
                for p in procs:
                    p.start()
                got = [queue.get() for _ in procs]
                for p in procs:
                    p.join()
                results[way].append((max(g[0] for g in got), sum(g[1] for g in got)))
        total = args.ranks * args.files * args.mb * 2**20 / 1e9
        print(f"{args.ranks} processes x {args.files} files x {args.mb} MiB ({total:.2f} GB), medians of {args.reps}")
        rows = [[w, f"{statistics.median(r[0] for r in results[w]):.3f} s",
                 f"{statistics.median(r[1] for r in results[w]):.2f} s"] for w in WAYS]
        print(table(["durability", "slowest process", "system CPU, all processes"], rows))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
