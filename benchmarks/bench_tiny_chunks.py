"""Irregular splits: what a grid of tiny chunks costs in each layout.

Nested uneven sharding (``[Shard(0), Shard(0)]`` of a ``[50257, 4096]`` bf16
embedding on an 8 x 8 mesh, ``torch.chunk`` sizes at both levels) has shard
boundaries whose gcd is 1 row, so the chunk grid is ``(1, 4096)``: 50,257
chunks of 8 KiB. One process holds the 64 ranks' regions as the local shards
of one ShardedTensor and saves it with ``tsckpt.save`` (the save plans exactly
that grid from the regions), then loads it whole into one tensor with
``tsckpt.load``, in each layout, alternating which layout goes first, with the
page cache warm. Reports medians, files and chunks.

    python -m benchmarks tiny-chunks                  # the case above, 3 repetitions
    python -m benchmarks tiny-chunks --rows 2049 --reps 1     # 2049 chunks: the same grid, smaller
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import run_ranks, table  # noqa: E402  (puts this checkout's tsckpt first on the path)

LAYOUTS = ("plain", "packed")


def torch_chunk(n: int, k: int) -> list[tuple[int, int]]:
    """(offset, size) of ``torch.chunk(n, k)``'s pieces, empty ones included."""
    step, out, at = math.ceil(n / k), [], 0
    for _ in range(k):
        size = max(0, min(step, n - at))
        out.append((at, size))
        at += size
    return out


def nested_rows(rows: int, mesh: tuple[int, int]) -> list[tuple[int, int]]:
    """(first row, rows) of every non-empty region of a nested uneven ``Shard(0), Shard(0)``."""
    return [(o1 + o2, s2) for o1, s1 in torch_chunk(rows, mesh[0]) for o2, s2 in torch_chunk(s1, mesh[1]) if s2]


def files(path: str) -> int:
    return sum(len(fs) for _, _, fs in os.walk(path))


def measure(rank: int, world: int, args: argparse.Namespace, root: str) -> dict[str, Any]:
    """On one gloo rank: every repetition's save and load in each layout."""
    import torch
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    import tsckpt

    g = torch.Generator().manual_seed(0)
    full = torch.randint(-2**15, 2**15, (args.rows, args.cols), generator=g, dtype=torch.int16).view(torch.bfloat16)
    regions = nested_rows(args.rows, (8, 8))
    shards = [Shard(full[first:first + n], ShardMetadata([first, 0], [n, args.cols], f"rank:{rank}/cpu"))
              for first, n in regions]
    state = {"embed": init_from_local_shards(shards, args.rows, args.cols)}
    samples: dict[str, list[dict[str, float]]] = {layout: [] for layout in LAYOUTS}
    grid: dict[str, Any] = {}
    for rep in range(args.reps):
        for layout in (LAYOUTS if rep % 2 == 0 else LAYOUTS[::-1]):
            path = os.path.join(root, layout)
            t = time.perf_counter()
            tsckpt.save(state, path, layout=layout)
            save_s = time.perf_counter() - t
            back = {"embed": torch.empty(args.rows, args.cols, dtype=torch.bfloat16)}
            t = time.perf_counter()
            tsckpt.load(back, path)
            load_s = time.perf_counter() - t
            assert torch.equal(back["embed"].view(torch.int16), full.view(torch.int16))
            with tsckpt.open(path) as ck:
                entry = ck.metadata.tensors["embed"]
                grid = {"regions": len(regions), "chunk": list(entry.chunk_shape), "chunks": entry.grid.nchunks}
            samples[layout].append({"save_s": save_s, "load_s": load_s, "files": files(path)})
            shutil.rmtree(path)
    return {"samples": samples, "grid": grid, "nbytes": full.numel() * 2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=50257)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="tsckpt-tiny-", dir=args.dir)
    try:
        result = run_ranks(1, measure, args, root)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    grid, samples = result["grid"], result["samples"]
    print(f"[{args.rows}, {args.cols}] bf16 ({result['nbytes'] / 1e6:.0f} MB), nested uneven Shard(0), Shard(0) on "
          f"8 x 8: {grid['regions']} regions, chunk {grid['chunk']}, {grid['chunks']:,} chunks of "
          f"{math.prod(grid['chunk']) * 2:,} bytes")
    print(table(["layout", "files", "save s (median)", "load s (median)"],
                [[layout, f"{runs[0]['files']:,}", f"{statistics.median(r['save_s'] for r in runs):.2f}",
                  f"{statistics.median(r['load_s'] for r in runs):.2f}"] for layout, runs in samples.items()]))


if __name__ == "__main__":
    main()
