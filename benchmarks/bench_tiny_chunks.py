"""Irregular splits: what a grid of tiny chunks costs in each layout.

Nested uneven sharding (``[Shard(0), Shard(0)]`` of a ``[50257, 4096]`` bf16
embedding on an 8 x 8 mesh, ``torch.chunk`` sizes at both levels) has shard
boundaries whose gcd is 1 row, so the chunk grid is ``(1, 4096)``: 50,257
chunks of 8 KiB. This plans that tensor exactly as a save would
(:func:`tsckpt.format.plan.plan_tensor` on the 64 ranks' regions), then writes
and reads it from one process in each layout through tsckpt's own array specs
(:class:`tsckpt.storage.store.Store`), alternating which layout goes first, and
reports medians, files and chunks.

    python benchmarks/bench_tiny_chunks.py                  # the case above, 3 repetitions
    python benchmarks/bench_tiny_chunks.py --rows 8192 --reps 1
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import table  # noqa: E402  (puts this checkout's tsckpt first on the path)

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from tsckpt.format import zarr_json  # noqa: E402
from tsckpt.storage.batch import RankBatch  # noqa: E402
from tsckpt.format.metadata import ArrayOptions  # noqa: E402
from tsckpt.format.plan import plan_tensor  # noqa: E402
from tsckpt.storage.store import Store  # noqa: E402
from tsckpt.storage.kvio import encode_json  # noqa: E402


def torch_chunk(n: int, k: int) -> list[tuple[int, int]]:
    """(offset, size) of ``torch.chunk(n, k)``'s pieces, empty ones included."""
    step, out, at = math.ceil(n / k), [], 0
    for _ in range(k):
        size = max(0, min(step, n - at))
        out.append((at, size))
        at += size
    return out


def nested_regions(rows: int, cols: int, mesh: tuple[int, int]) -> np.ndarray:
    boxes = [((o1 + o2, 0), (s2, cols)) for o1, s1 in torch_chunk(rows, mesh[0])
             for o2, s2 in torch_chunk(s1, mesh[1]) if s2]
    return np.array(boxes, dtype=np.int64)


def files(path: str) -> int:
    return sum(len(fs) for _, _, fs in os.walk(path))


def one(layout: str, root: str, entry, data: np.ndarray, regions: np.ndarray) -> dict[str, float]:
    path = os.path.join(root, layout)
    store = Store.open(path, layout=layout)
    meta = zarr_json.tensor_metadata(entry, ArrayOptions())
    t = time.perf_counter()
    # Every rank's region written as its rank would, each into its own database when packed.
    for rank, (lo, size) in enumerate(regions):
        arr = store.create(entry.path, meta, rank).result()
        batch = RankBatch(store.layout, lambda: None, path)
        sl = tuple(slice(o, o + s) for o, s in zip(lo, size))
        batch.bind(arr)[sl].write(data[sl]).result()
        batch.commit()
    nodes, flush = store.layout.nodes(store, len(regions))
    nodes.write(f"{entry.path}/zarr.json", encode_json(meta)).result()
    if flush is not None:
        flush()
    save_s = time.perf_counter() - t
    reader = dataclasses.replace(Store.open(path, layout=layout), array_options=ArrayOptions())
    t = time.perf_counter()
    back = reader.open_tensor(entry).result().read().result()
    load_s = time.perf_counter() - t
    assert back.tobytes() == data.tobytes()
    n = files(path)
    shutil.rmtree(path)
    return {"save_s": save_s, "load_s": load_s, "files": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=50257)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    regions = nested_regions(args.rows, args.cols, (8, 8))
    entry = plan_tensor("embed", ("embed",), (args.rows, args.cols), "bfloat16", regions)
    data = np.random.default_rng(0).integers(0, 1 << 16, (args.rows, args.cols), dtype=np.uint16).view(
        ml_dtypes.bfloat16)
    print(f"[{args.rows}, {args.cols}] bf16 ({data.nbytes / 1e6:.0f} MB), nested uneven Shard(0), Shard(0) on "
          f"8 x 8: {len(regions)} regions, chunk {list(entry.chunk_shape)}, {entry.grid.nchunks:,} chunks of "
          f"{math.prod(entry.chunk_shape) * 2:,} bytes")
    root = tempfile.mkdtemp(prefix="tsckpt-tiny-", dir=args.dir)
    samples: dict[str, list[dict[str, float]]] = {"plain": [], "packed": []}
    try:
        for rep in range(args.reps):
            order = ["plain", "packed"] if rep % 2 == 0 else ["packed", "plain"]
            for layout in order:
                samples[layout].append(one(layout, root, entry, data, regions))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(table(["layout", "files", "save s (median)", "load s (median)"],
                [[layout, f"{runs[0]['files']:,}", f"{statistics.median(r['save_s'] for r in runs):.2f}",
                  f"{statistics.median(r['load_s'] for r in runs):.2f}"] for layout, runs in samples.items()]))


if __name__ == "__main__":
    main()
