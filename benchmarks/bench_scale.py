"""What a save costs the coordinator at scale, phase by phase as DCP runs it: tsckpt beside DCP's own writer.

One process drives ``TensorStoreWriter`` and DCP's ``FileSystemWriter`` with the
same synthetic plans: ``--ranks`` ranks saving ``--tensors`` bf16 tensors
row-sharded as FSDP2 shards them (DCP's own planner, whose plans carry each
rank's key paths; rank 0's also carries tsckpt's placement notes, as tsckpt's
planner has the lowest rank of a mesh describe it). Each phase includes the
collective work DCP does on the coordinator for it:

* ``plan``: ``prepare_global_plan``, then pickling each rank's returned plan
  as ``scatter_object_list`` does (torch's own ``_object_to_tensor``);
* ``finish``: unpickling every rank's write results (and tsckpt's rank
  summary) as ``gather_object`` does (``_tensor_to_object``), then ``finish``:
  for tsckpt the checksum tables, every ``zarr.json`` and the root document,
  for DCP its ``.metadata`` file;
* ``plan, caching on: first save``: the plan phase of a first save with DCP's
  plan caching on (DCP's cache filled as ``DefaultSavePlanner(enable_plan_caching=True)``
  fills it), where tsckpt pickles each rank's items once and keeps them;
* ``plan, cached: ...``: the plan phase of the save repeated with no plan
  changed, made by DCP's planner (tsckpt re-sends the items it pickled) and by
  tsckpt's (which sends each rank only this save's orders);
* ``notes``: unpickling rank 0's placement notes among the gathered local
  plans (tsckpt's planner only; the plans themselves cost both the same).

Not timed: building the plans, DCP's planner (``create_global_plan``, the same
for both writers), what ranks do. Also reported: the bytes each rank receives,
and one rank's parse of the root document.

    PYTHONPATH=. python benchmarks/bench_scale.py                        # 1000 ranks x 2000 tensors
    PYTHONPATH=. python benchmarks/bench_scale.py --ranks 100 --tensors 200

Checkpoints go to ``--dir`` (a temporary directory under /dev/shm when it
exists, so no disk time is counted) and are deleted at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.distributed_c10d import _object_to_tensor, _tensor_to_object

from tsckpt.dcp.contract import PlannerNotes, RankSummary, RankWrites
from tsckpt.dcp.storage import TensorStoreWriter
from tsckpt.commit import protocol as commit
from tsckpt.storage.store import Store
from tsckpt.storage.location import parse_location

# DCP keys its plan cache by planner class name
DCP_KEY, TSCKPT_KEY = "BenchDefaultSavePlanner", "BenchTsckptSavePlanner"
CPU = torch.device("cpu")


def synthetic_plans(ranks: int, tensors: int, rows: int, cols: int) -> tuple[list[SavePlan], int]:
    """One SavePlan per rank as a planner hands the writer: every tensor row-split as torch.chunk splits it."""
    props = TensorProperties(dtype=torch.bfloat16)
    size = torch.Size([rows, cols])
    fqns = [f"model.layers.{t}.weight" for t in range(tensors)]
    mappings = {fqn: ("model", fqn[len("model."):]) for fqn in fqns}  # DCP's flatten mappings, on every rank
    mesh = {"shape": [ranks], "dim_names": ["dp_shard"], "device_type": "cuda", "ranks": list(range(ranks))}
    record = {"kind": "dtensor", "mesh": mesh, "placements": [{"type": "shard", "dim": 0}]}
    per = -(-rows // ranks)
    plans, regions = [], 0
    for r in range(ranks):
        start = min(r * per, rows)
        n = max(0, min(per, rows - start))
        chunk = ChunkStorageMetadata(offsets=torch.Size([start, 0]), sizes=torch.Size([n, cols]))
        regions += n > 0
        items = [WriteItem(index=MetadataIndex(fqn, torch.Size([start, 0])), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(chunk=chunk, properties=props, size=size)) for fqn in fqns]
        notes = PlannerNotes({fqn: record for fqn in fqns}) if r == 0 else None
        plans.append(SavePlan(items, storage_data=notes, planner_data=mappings))
    return plans, regions


def dcp_metadata(plans: list[SavePlan]) -> Metadata:
    """The global metadata DCP's planner hands ``finish``: every tensor with its chunks."""
    md: dict[str, TensorStorageMetadata] = {}
    for plan in plans:
        for item in plan.items:
            td = item.tensor_data
            found = md.get(item.index.fqn)
            if found is None:
                found = md[item.index.fqn] = TensorStorageMetadata(td.properties, td.size, [])
            found.chunks.append(td.chunk)
    return Metadata(state_dict_metadata=md, planner_data=plans[0].planner_data)


def tsckpt_results(plans: list[SavePlan], writer: TensorStoreWriter) -> list[RankWrites]:
    """What each rank's ``write_data`` returns: a result per item and one columnar summary."""
    layout = writer._layout
    assert layout is not None
    names = list(layout.entries)
    numbers = {fqn: i for i, fqn in enumerate(names)}
    found_for: dict[tuple[Any, ...], list[int]] = {}
    out = []
    for r, plan in enumerate(plans):
        tensor, chunk, crc_tensor, piece = [], [], [], []
        for item in plan.items:
            entry = layout.entries[item.index.fqn]
            c = item.tensor_data.chunk
            key = (entry.shape, entry.chunk_shape, tuple(c.offsets), tuple(c.sizes))
            found = found_for.get(key)
            if found is None:  # every tensor has the same grid here: computed once per rank
                found = found_for[key] = [entry.grid.flat_index(i)
                                          for i, _ in entry.grid.chunks_within(c.offsets, c.sizes)]
            chunk += found
            tensor += [numbers[item.index.fqn]] * len(found)
            units = entry.checksum_grid
            pieces = [units.flat_index(i) for i, _ in units.chunks_within(c.offsets, c.sizes)]
            piece += pieces
            crc_tensor += [numbers[item.index.fqn]] * len(pieces)
        crc = (np.arange(len(piece), dtype=np.uint32) * np.uint32(2654435761) + np.uint32(r)).astype(np.uint32)
        digest = np.zeros((len(chunk), 16), np.uint8)
        summary = RankSummary(r, writer.save_id, np.asarray(tensor, np.int32), np.asarray(chunk, np.int64), crc,
                              digest, crc_tensor=np.asarray(crc_tensor, np.int32), piece=np.asarray(piece, np.int64))
        sizes = [math.prod(item.tensor_data.chunk.sizes) * 2 for item in plan.items]
        out.append(RankWrites([WriteResult(index=item.index, size_in_bytes=s, storage_data=None)
                               for item, s in zip(plan.items, sizes)], summary))
    return out


def dcp_results(plans: list[SavePlan]) -> list[list[WriteResult]]:
    """What each rank's ``FileSystemWriter.write_data`` returns: a result per item, with where its bytes went."""
    out = []
    for r, plan in enumerate(plans):
        offset, results = 0, []
        for item in plan.items:
            length = math.prod(item.tensor_data.chunk.sizes) * 2
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=_StorageInfo(f"__{r}_0.distcp", offset, length)))
            offset += length
        out.append(results)
    return out


class Clock:
    """Wall and CPU seconds of timed blocks, summed per phase."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def time(self, phase: str, fn: Callable[[], Any]) -> Any:
        t, c = time.perf_counter(), time.process_time()
        try:
            return fn()
        finally:
            self.wall[phase] = self.wall.get(phase, 0.0) + time.perf_counter() - t
            self.cpu[phase] = self.cpu.get(phase, 0.0) + time.process_time() - c


def scatter(plans: list[SavePlan]) -> list[int]:
    """Pickle each rank's plan as ``scatter_object_list`` does; the bytes each rank receives."""
    return [int(_object_to_tensor(p, CPU, None)[1]) for p in plans]


def gather(results: list[Any], clock: Clock, phase: str) -> list[Any]:
    """Each rank pickles its results (not timed); the coordinator unpickles them all (timed)."""
    sent = [_object_to_tensor(r, CPU, None) for r in results]
    return clock.time(phase, lambda: [_tensor_to_object(t, int(n), None) for t, n in sent])


def save(writer: Any, global_plans: list[SavePlan], metadata: Metadata, make_results: Callable[[], list[Any]] | None,
         clock: Clock, phase: str) -> list[int]:
    """One save's coordinator phases (``finish`` only with ``make_results``); returns the bytes of each rank's plan."""
    out = clock.time(phase, lambda: writer.prepare_global_plan(global_plans))
    sizes = clock.time(phase, lambda o=out: scatter(o))
    if make_results is not None:
        results = gather(make_results(), clock, "finish")
        clock.time("finish", lambda: writer.finish(metadata, results))
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1000)
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--rows", type=int, default=8191)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--dir", help="where the checkpoints go (default: a temporary directory, in /dev/shm if it exists)")
    ap.add_argument("--target-file-bytes", type=int, default=256 << 20,
                    help="the packed layout's target_data_file_size (docs/format.md, the packed layout)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()

    t = time.perf_counter()
    plans, regions = synthetic_plans(args.ranks, args.tensors, args.rows, args.cols)
    metadata = dcp_metadata(plans)
    print(f"built {args.ranks} plans x {args.tensors} items in {time.perf_counter() - t:.1f} s (not timed below)",
          flush=True)
    # As tsckpt.save does (gc_paused): a full collection over millions of plan objects is not what is measured.
    gc.collect()
    gc.freeze()
    gc.disable()
    base = tempfile.mkdtemp(prefix="bench-scale-", dir=args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None))
    clocks = {"tsckpt": Clock(), "dcp": Clock()}
    received: dict[str, list[int]] = {}
    # What DCP's planner returns when its cache found no plan changed (tsckpt's planner marks them).
    unusable = [SavePlan([], usable=False)] * args.ranks
    marked = [SavePlan([], storage_data=PlannerNotes(cache_key=TSCKPT_KEY), usable=False)] * args.ranks
    # DCP's own planner puts nothing in storage_data; tsckpt's puts placement notes (on rank 0 here).
    dcp_planned = [SavePlan(p.items, planner_data=p.planner_data) for p in plans]
    # name, what tsckpt's prepare_global_plan gets, what FileSystemWriter's gets, DCP's plan cache to fill first
    # (as DefaultSavePlanner(enable_plan_caching=True) fills it: the plans it returns are the ones it keeps).
    steps = [("plan", plans, plans, None),
             ("plan, caching on: first save", dcp_planned, dcp_planned, (DCP_KEY, dcp_planned)),
             ("plan, cached: DCP's planner", unusable, unusable, None),
             ("plan, cached: tsckpt's planner", marked, unusable, (TSCKPT_KEY, plans))]
    try:
        for step, (phase, ts_in, dcp_in, cache) in enumerate(steps):
            if cache is not None:
                SavePlanner._cached_global_plan[cache[0]] = cache[1]
            if cache is not None and cache[0] == TSCKPT_KEY:  # the first save with tsckpt's planner, not timed
                warm = TensorStoreWriter(os.path.join(base, "warm"), overwrite=True)
                warm.set_up_storage_writer(True, rank=0)
                warm.prepare_global_plan(plans)
            for name, writer in (("tsckpt", TensorStoreWriter(os.path.join(base, f"tsckpt{step}"), overwrite=True)),
                                 ("dcp", FileSystemWriter(os.path.join(base, f"dcp{step}")))):
                if name == "dcp":
                    os.makedirs(writer.path)  # each rank's prepare_local_plan does this
                writer.set_up_storage_writer(True, rank=0, use_collectives=True)
                make = (lambda w=writer, p=plans: tsckpt_results(p, w)) if name == "tsckpt" else \
                    (lambda p=plans: dcp_results(p))
                received[f"{name}, {phase}"] = save(writer, ts_in if name == "tsckpt" else dcp_in, metadata,
                                                    make if step == 0 else None, clocks[name], phase)
            print(f"{phase}: timed", flush=True)
        notes = _object_to_tensor(plans[0].storage_data, CPU, None)
        clocks["tsckpt"].time("notes", lambda: _tensor_to_object(notes[0], int(notes[1]), None))
        clocks["dcp"].wall["notes"] = clocks["dcp"].cpu["notes"] = 0.0
        del plans, metadata

        store = Store.open(parse_location(os.path.join(base, "tsckpt0")))
        raw = store.kvstore.read(commit.ROOT).result().value
        tracemalloc.start()
        t, c = time.perf_counter(), time.process_time()
        md = commit.read_metadata(store.kvstore, store.url)
        parse_s, parse_cpu = time.perf_counter() - t, time.process_time() - c
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        dcp_md_bytes = os.path.getsize(os.path.join(base, "dcp0", ".metadata"))
    finally:
        for key in (DCP_KEY, TSCKPT_KEY):
            SavePlanner._cached_global_plan.pop(key, None)
        shutil.rmtree(base, ignore_errors=True)

    phases = [step[0] for step in steps] + ["finish", "notes"]
    ts, dc = clocks["tsckpt"], clocks["dcp"]
    print(f"\n{args.ranks} ranks x {args.tensors} tensors of [{args.rows}, {args.cols}] bf16; coordinator seconds, "
          f"wall (CPU)\n")
    print("| phase | tsckpt | DCP (FileSystemWriter) | tsckpt adds |")
    print("|---|---:|---:|---:|")
    for p in phases:
        print(f"| {p} | {ts.wall[p]:.2f} ({ts.cpu[p]:.2f}) | {dc.wall[p]:.2f} ({dc.cpu[p]:.2f}) | "
              f"{ts.wall[p] - dc.wall[p]:+.2f} ({ts.cpu[p] - dc.cpu[p]:+.2f}) |")
    first = ["plan", "finish", "notes"]
    added = sum(ts.wall[p] - dc.wall[p] for p in first)
    added_cpu = sum(ts.cpu[p] - dc.cpu[p] for p in first)
    print(f"\ntsckpt adds {added:.2f} s wall ({added_cpu:.2f} s CPU) to a save (plan, finish, notes)")
    print("\n| bytes a rank receives in its plan | min | median | max |")
    print("|---|---:|---:|---:|")
    for k, v in received.items():
        print(f"| {k} | {min(v)} | {int(statistics.median(v))} | {max(v)} |")

    chunks = sum(e.grid.nchunks for e in md.tensors.values())
    bytes_per_rank = args.tensors * args.rows * args.cols * 2 / args.ranks
    # one data file per batch of each rank, plus the root's manifest, B+tree file and zarr.json
    packed_files = args.ranks * max(1, math.ceil(bytes_per_rank / args.target_file_bytes)) + 3
    figures = {
        "ranks": args.ranks, "tensors": args.tensors, "rows": args.rows, "cols": args.cols,
        "regions_per_tensor": regions,
        "phases": {p: {"tsckpt_s": round(ts.wall[p], 3), "tsckpt_cpu_s": round(ts.cpu[p], 3),
                       "dcp_s": round(dc.wall[p], 3), "dcp_cpu_s": round(dc.cpu[p], 3)} for p in phases},
        "tsckpt_adds_s": round(added, 2), "tsckpt_adds_cpu_s": round(added_cpu, 2),
        "plan_bytes_per_rank": {k: {"min": min(v), "median": int(statistics.median(v)), "max": max(v)}
                                for k, v in received.items()},
        "root_document_bytes": len(raw), "dcp_metadata_bytes": dcp_md_bytes,
        "metadata_parse_s": round(parse_s, 3), "metadata_parse_cpu_s": round(parse_cpu, 3),
        "metadata_parse_peak_mb": round(peak / 1e6, 1),
        "plain_files": chunks + len(md.tensors) + 1 + len({e.path.rsplit('/', 1)[0] for e in md.tensors.values()}),
        "packed_files_bound": packed_files,
    }
    print()
    for k in ("root_document_bytes", "dcp_metadata_bytes", "metadata_parse_s", "metadata_parse_cpu_s",
              "metadata_parse_peak_mb", "plain_files", "packed_files_bound"):
        print(f"{k:>24}: {figures[k]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
