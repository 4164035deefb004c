"""Encoding one outer chunk: into a fresh buffer per chunk, or streamed in units through one reused buffer.

Why a plain checkpoint's chunk files are encoded in parts into reused buffers
(``tsckpt/format/shard_encoding.py``): ``--chunks`` outer chunks of a
``[12565, 1280]`` bf16 embedding shard (32 MB, inner chunks ``[1795, 40]``:
80-byte rows, as the untuned workload's 4-rank save cuts them), encoded in one
process. "fresh" keeps every encoded copy, as writes through TensorStore do
until they are committed, so each lands in new memory; "streamed" passes 2 MiB
units to a no-op write. Prints the first repetition per chunk (memory this
process never touched: on a VM, pages the host has to supply) and the median
(memory freed by the repetition before).

    python -m benchmarks encode --chunks 8 --reps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import table  # noqa: E402

import numpy as np  # noqa: E402

from tsckpt.format import shard_encoding  # noqa: E402
from tsckpt.format.shards import ShardFormat  # noqa: E402
from tsckpt.storage import byte_writes  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    data = np.random.default_rng(0).integers(-2**15, 2**15, (12565, 1280), dtype=np.int16)
    fmt = ShardFormat(data.shape, (1795, 40), 2)

    def fresh() -> None:
        kept = [shard_encoding.encode(fmt, data) for _ in range(args.chunks)]
        del kept

    def streamed() -> None:
        with byte_writes.scratch() as get:
            for _ in range(args.chunks):
                shard_encoding.encode_to(fmt, data, lambda part: None, get)

    rows = []
    for name, run in (("fresh buffer per chunk, all kept", fresh), ("streamed in units, one buffer", streamed)):
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) / args.chunks)
        median = statistics.median(times)
        rows.append([name, f"{times[0] * 1e3:.1f} ms", f"{median * 1e3:.1f} ms", f"{fmt.nbytes / median / 1e9:.1f} GB/s"])
    print(f"{args.chunks} chunks of {fmt.nbytes / 1e6:.1f} MB, inner chunks {list(fmt.inner)}, {args.reps} repetitions")
    print(table(["encoding", "first, per chunk", "median, per chunk", "median speed"], rows))


if __name__ == "__main__":
    main()
