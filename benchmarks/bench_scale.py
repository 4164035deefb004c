"""What tsckpt's coordinator and each rank's metadata cost at scale, without the data.

Drives ``TensorStoreWriter`` and the metadata reader with synthetic DCP plans,
as a job of ``--ranks`` ranks saving ``--tensors`` FSDP-sharded (Shard(0))
tensors would give them, against ``memory://`` so no disk time is counted:

* coordinator: ``prepare_global_plan`` (grids, tiling checks, paths) and
  ``finish`` (checksum tables, every ``zarr.json``, the root document), as
  wall time and as this process's CPU time (steadier on a shared machine);
* the root document's size;
* one rank's metadata read: parse + validate time and peak Python memory;
* files a plain checkpoint would hold (one per chunk), and the packed bound.

    python benchmarks/bench_scale.py                       # 1000 ranks x 2000 tensors
    python benchmarks/bench_scale.py --ranks 64 --tensors 200

Plans are built once and reused; building them is not timed.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
import tracemalloc

import numpy as np

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from tsckpt.dcp.storage import TensorStoreWriter
from tsckpt.format import commit
from tsckpt.location import parse_location
from tsckpt.format.spec import Store


def synthetic_plans(ranks: int, tensors: int, rows: int, cols: int) -> tuple[list[SavePlan], int]:
    """One SavePlan per rank: every tensor row-split as torch.chunk (FSDP2) splits it."""
    props = TensorProperties(dtype=torch.bfloat16)
    size = torch.Size([rows, cols])
    per = -(-rows // ranks)
    plans, regions = [], 0
    for r in range(ranks):
        start = min(r * per, rows)
        n = max(0, min(per, rows - start))
        chunk = ChunkStorageMetadata(offsets=torch.Size([start, 0]), sizes=torch.Size([n, cols]))
        regions += n > 0
        items = [WriteItem(index=MetadataIndex(f"model.layers.{t}.weight", torch.Size([start, 0])),
                           type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(chunk=chunk, properties=props, size=size))
                 for t in range(tensors)]
        plans.append(SavePlan(items, planner_data={f"model.layers.{t}.weight": ("model", f"layers.{t}.weight")
                                                   for t in range(tensors)} if r == 0 else {}))
    return plans, regions


def synthetic_results(plans: list[SavePlan], writer: TensorStoreWriter) -> list[list[WriteResult]]:
    """What each rank's write_data would return: per item results and one summary of its chunks and pieces' crc32c."""
    ids = {fqn: i for i, fqn in enumerate(writer._entries)}
    out = []
    for r, plan in enumerate(plans):
        tensor, chunk, crc_tensor, piece = [], [], [], []
        for item in plan.items:
            entry = writer._entries[item.index.fqn]
            c = item.tensor_data.chunk
            found = [entry.grid.flat_index(i) for i, _ in entry.grid.chunks_within(c.offsets, c.sizes)]
            chunk += found
            tensor += [ids[item.index.fqn]] * len(found)
            units = entry.checksum_grid
            pieces = [units.flat_index(i) for i, _ in units.chunks_within(c.offsets, c.sizes)]
            piece += pieces
            crc_tensor += [ids[item.index.fqn]] * len(pieces)
        summary = {"rank": r, "placements": {}, "objects": {}, "tensor": np.asarray(tensor, dtype=np.int32),
                   "chunk": np.asarray(chunk, dtype=np.int64), "crc_tensor": np.asarray(crc_tensor, dtype=np.int32),
                   "piece": np.asarray(piece, dtype=np.int64),
                   "crc": (np.arange(len(piece), dtype=np.uint32) * 2654435761 + r).astype(np.uint32)}
        results = [WriteResult(index=item.index, size_in_bytes=0, storage_data=None) for item in plan.items]
        results[0] = WriteResult(index=results[0].index, size_in_bytes=0, storage_data=summary)
        out.append(results)
    return out


def dcp_metadata(writer: TensorStoreWriter) -> Metadata:
    """The global metadata DCP hands ``finish`` (chunk lists left out: the writer does not use them)."""
    props = TensorProperties(dtype=torch.bfloat16)
    return Metadata(state_dict_metadata={
        fqn: TensorStorageMetadata(properties=props, size=torch.Size(e.shape), chunks=[])
        for fqn, e in writer._entries.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1000)
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--target-file-bytes", type=int, default=256 << 20,
                    help="the packed layout's target_data_file_size (docs/format.md, the packed layout)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()

    t = time.perf_counter()
    plans, regions = synthetic_plans(args.ranks, args.tensors, args.rows, args.cols)
    print(f"built {args.ranks} plans x {args.tensors} items in {time.perf_counter() - t:.1f} s (not timed below)")

    location = f"memory://bench-scale-{args.ranks}x{args.tensors}"
    writer = TensorStoreWriter(location, overwrite=True)
    writer.set_up_storage_writer(True, rank=0)
    gc.collect()
    gc.disable()
    t, c = time.perf_counter(), time.process_time()
    scattered = writer.prepare_global_plan(plans)
    plan_s, plan_cpu = time.perf_counter() - t, time.process_time() - c
    gc.enable()
    results = synthetic_results(plans, writer)
    del plans, scattered
    gc.collect()
    gc.disable()
    metadata = dcp_metadata(writer)
    t, c = time.perf_counter(), time.process_time()
    writer.finish(metadata, results)
    finish_s, finish_cpu = time.perf_counter() - t, time.process_time() - c
    gc.enable()
    del results
    gc.collect()

    store = Store.open(parse_location(location))
    raw = store.kvstore.read(commit.ROOT).result().value
    tracemalloc.start()
    t, c = time.perf_counter(), time.process_time()
    md = commit.read_metadata(store.kvstore, store.url)
    parse_s, parse_cpu = time.perf_counter() - t, time.process_time() - c
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    chunks = sum(e.grid.nchunks for e in md.tensors.values())
    bytes_per_rank = args.tensors * args.rows * args.cols * 2 / args.ranks
    # one data file per batch of each rank, plus the root's manifest, B+tree file and zarr.json
    packed_files = args.ranks * max(1, math.ceil(bytes_per_rank / args.target_file_bytes)) + 3
    figures = {
        "ranks": args.ranks, "tensors": args.tensors, "regions_per_tensor": regions,
        "coordinator_plan_s": round(plan_s, 2), "coordinator_finish_s": round(finish_s, 2),
        "coordinator_total_s": round(plan_s + finish_s, 2),
        "coordinator_plan_cpu_s": round(plan_cpu, 2), "coordinator_finish_cpu_s": round(finish_cpu, 2),
        "coordinator_total_cpu_s": round(plan_cpu + finish_cpu, 2),
        "root_document_bytes": len(raw), "metadata_parse_s": round(parse_s, 3), "metadata_parse_cpu_s": round(parse_cpu, 3),
        "metadata_parse_peak_mb": round(peak / 1e6, 1),
        "plain_files": chunks + len(md.tensors) + 1 + len({e.path.rsplit('/', 1)[0] for e in md.tensors.values()}),
        "packed_files_bound": packed_files,
    }
    for k, v in figures.items():
        print(f"{k:>28}: {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
