"""What ``tsckpt.save``'s coordinator does at scale with tsckpt's own planner, phase by phase, and what a rank loads.

The synthetic FSDP world of :mod:`scale_world` (``--ranks`` ranks saving
``--tensors`` bf16 tensors row-sharded with ``Shard(0)``), planned as
tsckpt's planner plans it: no rank lists a DTensor's items; rank 0, the lowest
of the mesh, sends each tensor's record. Timed on the coordinator, as DCP runs
it there:

* ``plan``: the planner's ``create_global_plan`` (DCP's, over the plans) and
  the writer's ``prepare_global_plan`` on every rank's plan;
* ``scatter``: pickling each rank's returned plan as ``scatter_object_list`` does;
* ``gather``: unpickling each rank's write results as ``gather_object`` does
  (each rank's results are built and pickled untimed, one rank at a time: the
  rank does that);
* ``finish``: the writer's ``finish``: merging the ranks' summaries, writing
  the packed index and the root document.

Then one rank's load is planned in a fresh process, into the same world size
and into 3/4 of it (:mod:`scale_load`): bytes read beyond the root, CPU, RSS.
``bench_scale.py`` compares the writer with DCP's own under DCP's planner.

    PYTHONPATH=. python benchmarks/scale_planner.py --ranks 10000 --tensors 2000
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
from torch.distributed.distributed_c10d import _object_to_tensor

from bench_scale import Clock, load_rank, peak_gb, received, status
from scale_world import World, as_sent, direct_results, tsckpt_results
from tsckpt.commit import protocol as commit
from tsckpt.dcp.planner import SavePlanner
from tsckpt.dcp.storage import TensorStoreWriter
from tsckpt.storage.location import parse_location
from tsckpt.storage.store import Store

CPU = torch.device("cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=10000)
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--rows", type=int, default=8191)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--dir", help="where the checkpoint goes (default: a temporary directory, in /dev/shm if it exists)")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--summaries-only", action="store_true",
                    help="build each rank's results from the world's arithmetic (the same pickled bytes), write no "
                         "chunk table and plan no load: for worlds too large to build item by item")
    args = ap.parse_args()

    load = [os.getloadavg()[0]]
    world = World(args.ranks, args.tensors, args.rows, args.cols)
    plans = world.compact()
    gc.collect()
    gc.freeze()
    gc.disable()  # as tsckpt.save does (dcp.collector)
    base = tempfile.mkdtemp(prefix="scale-planner-", dir=args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None))
    clock = Clock()
    path = os.path.join(base, "ck")
    try:
        writer = TensorStoreWriter(path, overwrite=True)
        writer.set_up_storage_writer(True, rank=0, use_collectives=True)
        planner = SavePlanner()
        planner.set_up_planner({}, is_coordinator=True)

        def plan() -> list:
            global_plans, metadata = planner.create_global_plan(plans)
            return writer.prepare_global_plan(global_plans), metadata

        out, metadata = clock.time("plan", plan)
        status("plan: timed", {"tsckpt": clock}, "plan")
        received_bytes = [clock.time("scatter", lambda p=p: int(_object_to_tensor(p, CPU, None)[1])) for p in out]
        status("scatter: timed", {"tsckpt": clock}, "scatter")
        tables = str(writer._target.data_location.spec.get("path"))
        summaries, sent_bytes = [], []
        for r in range(args.ranks):
            if args.summaries_only:
                results = direct_results(world, r, writer._layout, writer.save_id)
            else:
                items = as_sent(world.items(r)) if world.nrows(r) else []
                results = tsckpt_results(items, r, writer._layout, writer.save_id, tables)
            message = _object_to_tensor(results, CPU, None)
            sent_bytes.append(int(message[1]))
            summaries.append(received(message, clock, "gather"))
        status("gather: timed", {"tsckpt": clock}, "gather")
        clock.time("finish", lambda: writer.finish(metadata, summaries))
        status("finish: timed", {"tsckpt": clock}, "finish")
        del summaries, out
        gc.enable()
        raw = Store.open(parse_location(path)).kvstore.read(commit.ROOT).result().value
        loads = {}
        for name, into in () if args.summaries_only else (("same world size", args.ranks),
                                                           ("3/4 of the world size", max(1, args.ranks * 3 // 4))):
            loads[name] = load_rank(path, into // 3, into)
            status(f"load into {name}: planned")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    load.append(os.getloadavg()[0])
    phases = ["plan", "scatter", "gather", "finish"]
    print(f"\n{args.ranks} ranks x {args.tensors} tensors of [{args.rows}, {args.cols}] bf16, tsckpt's planner; "
          f"coordinator seconds\n")
    print("| phase | wall s | CPU s |")
    print("|---|---:|---:|")
    for p in phases:
        print(f"| {p} | {clock.wall[p]:.2f} | {clock.cpu[p]:.2f} |")
    print(f"| all | {sum(clock.wall[p] for p in phases):.2f} | {sum(clock.cpu[p] for p in phases):.2f} |")
    print("\n| bytes per rank | min | median | max |")
    print("|---|---:|---:|---:|")
    for name, v in (("received in its plan", received_bytes), ("sent in its write results", sent_bytes)):
        print(f"| {name} | {min(v)} | {int(statistics.median(v))} | {max(v)} |")
    print("\n| one rank's load | chunks | tables read | metadata bytes read beyond the root | plan s (CPU) "
          "| RSS added MB |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, f in loads.items():
        print(f"| rank {f['rank']} of {f['world']} ({name}) | {f['keys']} | {f['tables_read']} | "
              f"{f['metadata_bytes_read']} | {f['plan_s']:.2f} ({f['plan_cpu_s']:.2f}) | "
              f"{f['root_parse_rss_mb'] + f['plan_rss_mb']:.0f} |")
    figures = {"ranks": args.ranks, "tensors": args.tensors, "rows": args.rows, "cols": args.cols,
               "phases": {p: {"s": round(clock.wall[p], 3), "cpu_s": round(clock.cpu[p], 3)} for p in phases},
               "received_bytes": {"min": min(received_bytes), "max": max(received_bytes)},
               "sent_bytes": {"min": min(sent_bytes), "max": max(sent_bytes)},
               "root_document_bytes": len(raw), "loads": loads, "peak_rss_gb": round(peak_gb(), 2),
               "load_average": [round(x, 1) for x in load]}
    print(f"\nroot document: {len(raw)} bytes; peak RSS {peak_gb():.1f} GB; load average {figures['load_average']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    t = time.perf_counter()
    main()
    print(f"({time.perf_counter() - t:.0f} s in all)")
