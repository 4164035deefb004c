"""What a save costs the coordinator at scale, phase by phase as DCP runs it: tsckpt beside DCP's own writer.

One process drives ``TensorStoreWriter`` and DCP's ``FileSystemWriter`` with the
same synthetic plans (:mod:`scale_world`): ``--ranks`` ranks saving
``--tensors`` bf16 tensors row-sharded as FSDP2 shards them, as DCP's own
planner hands them to the writer (deduplicated; key paths in each plan; rank
0's also carries tsckpt's placement notes, as tsckpt's planner has the lowest
rank of a mesh describe them). Each phase includes the collective work DCP does
on the coordinator for it:

* ``plan``: ``prepare_global_plan`` on every rank's plan, held all at once as
  DCP holds them, then pickling each rank's returned plan as
  ``scatter_object_list`` does (torch's own ``_object_to_tensor``);
* ``finish``: unpickling every rank's write results (and tsckpt's rank summary)
  as ``gather_object`` does (``_tensor_to_object``), then ``finish``: for
  tsckpt the packed index over the ranks' data files (every ``zarr.json``
  inline) and the root document, for DCP its ``.metadata`` file;
* ``plan, caching on: first save``: the plan phase of a first save with
  ``tsckpt.SavePlanner(enable_plan_caching=True)``, which hands the writer
  every rank's full plan: tsckpt pickles each rank's items once and keeps them
  (with DCP's own planner, which does not say that it caches, a first save
  costs what ``plan`` costs);
* ``plan, cached: ...``: the plan phase of a save repeated with no plan
  changed, made by DCP's planner (tsckpt re-sends the items it pickled on the
  first such save, not timed, from the plans it noted after the first save)
  and by tsckpt's (which sends each rank only this save's orders);
* ``notes``: unpickling rank 0's placement notes among the gathered local
  plans (tsckpt's planner only; the plans themselves cost both the same).

How it fits 10,000 ranks in memory while timing what DCP's coordinator does:

* The global plans given to ``prepare_global_plan`` are real ``SavePlan``,
  ``WriteItem``, ``MetadataIndex`` ... objects, no object shared between two
  items, up to ``--own-items-up-to`` items in all (1000 ranks x 2000 tensors).
  Above that (10,000 ranks), a rank's items share one ``TensorWriteData``
  (equal values), a third of the memory. Global planning only reads them, so
  its time is the same. Only tsckpt's pickling of every rank's items with
  plan caching on (``plan, caching on: first save``, re-sent in ``plan,
  cached: DCP's planner``) sees the sharing: those pickles are smaller and
  quicker than a real rank's (``prepickled_shared_vs_own_bytes`` gives the
  ratio of their sizes), so at that scale tsckpt's figures in these two rows
  are too low.
* Scatter: each rank's returned plan is pickled one rank at a time, its items
  rebuilt first (not timed) as the coordinator holds them after unpickling the
  gathered plans, no object shared between items; then dropped.
* Gather: each rank's results are built from those items and pickled (not
  timed: the rank does that), then unpickled (timed). tsckpt's ``finish``
  reads only the summaries, so the unpickled ``WriteResult`` lists are dropped
  after timing; the ``Metadata`` it receives lists no chunks (it reads only
  which tensors there are). DCP's ``finish`` needs every result and chunk at
  once: with more than ``--dcp-finish-ranks`` ranks it runs on consecutive
  slices of that many ranks, each with the metadata of its ranks' chunks, and
  the times are summed (it is one pass over results and chunks, a dict and a
  pickle; each slice repeats the 2000 tensors' entries, a small overstatement).

Not timed: building the plans, DCP's planner (``create_global_plan``, the same
for both writers), what ranks do. Also reported: the bytes each rank receives,
one rank's parse of the root document, the peak RSS, and the load average
(the figures are only as quiet as the machine).

    PYTHONPATH=. python benchmarks/bench_scale.py                        # 1000 ranks x 2000 tensors
    PYTHONPATH=. python benchmarks/bench_scale.py --ranks 10000          # about 10 GB peak RSS
    PYTHONPATH=. python benchmarks/bench_scale.py --ranks 100 --tensors 200

Checkpoints go to ``--dir`` (a temporary directory under /dev/shm when it
exists, so no disk time is counted) and are deleted at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import pickle
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.distributed_c10d import _object_to_tensor, _tensor_to_object

from scale_world import World, as_sent, dcp_results, sent_plan, slices, tsckpt_results
from tsckpt.commit import protocol as commit
from tsckpt.dcp.contract import GlobalPlans, RankWrites
from tsckpt.dcp.plan_cache import CACHE
from tsckpt.dcp.planner import SavePlanner as TsckptSavePlanner
from tsckpt.dcp.storage import TensorStoreWriter
from tsckpt.errors import MetadataError
from tsckpt.storage.location import parse_location
from tsckpt.storage.store import Store

# tsckpt's planner names its cache by its class
TSCKPT_KEY = "BenchTsckptSavePlanner"
CPU = torch.device("cpu")


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


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def status(what: str, clocks: dict[str, Clock] | None = None, phase: str = "") -> None:
    """Progress, with the phase's seconds so far (a long run that is cut short still tells something)."""
    times = "".join(f", {name} {c.wall[phase]:.2f} s ({c.cpu[phase]:.2f} CPU)" for name, c in (clocks or {}).items())
    print(f"{what}{times}: peak RSS {peak_gb():.1f} GB, load average {os.getloadavg()[0]:.1f}", flush=True)


def scatter(world: World, gathered: list[SavePlan], outs: dict[str, list[SavePlan]], clocks: dict[str, Clock],
            phase: str) -> dict[str, list[int]]:
    """Pickle each rank's plan as ``scatter_object_list`` does, one rank at a time; the bytes each rank receives."""
    sizes: dict[str, list[int]] = {name: [] for name in outs}
    for r in range(world.ranks):
        items = as_sent(gathered[r].items)
        for name, out in outs.items():
            plan = sent_plan(out[r], gathered[r], items)
            sizes[name].append(clocks[name].time(phase, lambda p=plan: int(_object_to_tensor(p, CPU, None)[1])))
    return sizes


def received(msg: tuple[torch.Tensor, torch.Tensor], clock: Clock, phase: str) -> Any:
    """What the coordinator's ``gather_object`` makes of one rank's pickled results (timed)."""
    return clock.time(phase, lambda: _tensor_to_object(msg[0], int(msg[1]), None))


def finish(world: World, gathered: list[SavePlan], writers: dict[str, Any], clocks: dict[str, Clock],
           slice_ranks: int) -> tuple[int, str | None]:
    """Gather every rank's results and run both writers' ``finish``; the bytes of DCP's ``.metadata``, and
    why tsckpt refused to commit (None if it committed)."""
    ts, dcp = writers["tsckpt"], writers["dcp"]
    # The ranks' chunk tables go where the ranks' data goes, so that a load of the committed checkpoint reads them.
    tables = str(ts._target.data_location.spec.get("path"))
    summaries: list[RankWrites] = []
    metadata_bytes = 0
    for part in slices(world.ranks, slice_ranks):
        results, metadata = [], world.metadata([])
        for r in part:
            items = as_sent(gathered[r].items)
            got = received(_object_to_tensor(tsckpt_results(items, r, ts._layout, ts.save_id, tables), CPU, None),
                           clocks["tsckpt"], "finish")
            summaries.append(RankWrites([], got.summary))  # finish reads only the summary
            del got
            results.append(received(_object_to_tensor(dcp_results(items, r), CPU, None), clocks["dcp"], "finish"))
            world.add_chunks(metadata, items)
            del items
        clocks["dcp"].time("finish", lambda m=metadata, res=results: dcp.finish(m, res))
        metadata_bytes += os.path.getsize(os.path.join(dcp.path, ".metadata"))
        del metadata, results
    metadata = world.metadata([])
    try:
        clocks["tsckpt"].time("finish", lambda: ts.finish(metadata, summaries))
    except MetadataError as e:  # a root document no reader accepts: timed up to the refusal
        return metadata_bytes, str(e)
    return metadata_bytes, None


def load_rank(path: str, rank: int, world: int) -> dict[str, Any]:
    """One rank's load planned in a fresh process (:mod:`scale_load`): what it reads, spends and holds."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(here), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, os.path.join(here, "scale_load.py"), path, "--rank", str(rank),
                           "--world", str(world)], env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1000)
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--rows", type=int, default=8191)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--dcp-finish-ranks", type=int, default=1000,
                    help="DCP's finish runs on slices of this many ranks, times summed (it needs all in memory)")
    ap.add_argument("--own-items-up-to", type=int, default=4_000_000,
                    help="up to this many items in all, no two items share an object; above, a rank's share one "
                         "TensorWriteData (about 10 GB less at 10,000 ranks)")
    ap.add_argument("--dir", help="where the checkpoints go (default: a temporary directory, in /dev/shm if it exists)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()

    load = [os.getloadavg()[0]]
    world = World(args.ranks, args.tensors, args.rows, args.cols)
    t = time.perf_counter()
    shared = args.ranks * args.tensors > args.own_items_up_to
    plans = world.gathered(with_notes=True, shared=shared)
    print(f"built {args.ranks} plans x {args.tensors} items in {time.perf_counter() - t:.1f} s (not timed below)",
          flush=True)
    # As tsckpt.save does (dcp.collector.held_off): a full collection over millions of plan objects is not what is measured.
    gc.collect()
    gc.freeze()
    gc.disable()
    status("plans built")
    base = tempfile.mkdtemp(prefix="bench-scale-", dir=args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None))
    clocks = {"tsckpt": Clock(), "dcp": Clock()}
    sizes: dict[str, list[int]] = {}
    # What DCP's planner returns when its cache found no plan changed.
    unusable = [SavePlan([], usable=False)] * args.ranks
    # DCP's own planner puts nothing in storage_data; tsckpt's puts placement notes (on rank 0 here).
    dcp_planned = [SavePlan(p.items, planner_data=p.planner_data) for p in plans]
    # tsckpt's caching planner hands the writer every rank's full plan beside the ones DCP returns.
    handed = GlobalPlans(plans, TSCKPT_KEY)
    first = [dataclasses.replace(p, storage_data=handed) for p in plans]
    marked = [SavePlan([], storage_data=handed, usable=False)] * args.ranks
    # name, what tsckpt's prepare_global_plan gets, what FileSystemWriter's gets, what comes first (not timed)
    steps = [("plan", plans, plans, None),
             ("plan: tsckpt's planner", world.compact(), plans, "placed"),
             ("plan, cached: DCP's planner", unusable, unusable, "recall"),
             ("plan, caching on: first save", first, dcp_planned, "forget"),
             ("plan, cached: tsckpt's planner", marked, unusable, None)]
    try:
        for step, (phase, ts_in, dcp_in, before) in enumerate(steps):
            if before == "recall":
                # The first save with DCP's caching planner: its coordinator noted the planner's full plans,
                # which DCP's cache holds; the second recalled them and pickled each rank's items once.
                CACHE.note(types.SimpleNamespace(global_plan=dcp_planned))
                warm = TensorStoreWriter(os.path.join(base, "warm"), overwrite=True)
                warm.set_up_storage_writer(True, rank=0)
                warm.prepare_global_plan(unusable)
                del warm
            if before == "placed":
                # tsckpt's planner's global planning over its compact plans (DCP's, over full ones, is not timed)
                planner = TsckptSavePlanner()
                planner.set_up_planner({}, is_coordinator=True)
                clocks["tsckpt"].time(phase, lambda p=planner, g=ts_in: p.create_global_plan(g))
                del planner
            if before == "forget":
                CACHE.clear()  # DCP's planner's entry is done with: its memory back
            writers = {"tsckpt": TensorStoreWriter(os.path.join(base, f"tsckpt{step}"), overwrite=True),
                       "dcp": FileSystemWriter(os.path.join(base, f"dcp{step}"))}
            os.makedirs(writers["dcp"].path)  # each rank's prepare_local_plan does this
            outs = {}
            for name, writer in writers.items():
                writer.set_up_storage_writer(True, rank=0, use_collectives=True)
                given = ts_in if name == "tsckpt" else dcp_in
                outs[name] = clocks[name].time(phase, lambda w=writer, g=given: w.prepare_global_plan(g))
            for name, n in scatter(world, plans, outs, clocks, phase).items():
                sizes[f"{name}, {phase}"] = n
            del outs
            status(f"{phase}: timed", clocks, phase)
            if step == 0:
                dcp_md_bytes, refused = finish(world, plans, writers, clocks, args.dcp_finish_ranks)
                status("finish: timed", clocks, "finish")
            del writers
            load.append(os.getloadavg()[0])
        notes = _object_to_tensor(plans[0].storage_data, CPU, None)
        clocks["tsckpt"].time("notes", lambda: _tensor_to_object(notes[0], int(notes[1]), None))
        clocks["dcp"].wall["notes"] = clocks["dcp"].cpu["notes"] = 0.0
        shared_bytes = len(pickle.dumps(SavePlan(plans[0].items, planner_data=plans[0].planner_data)))
        own_bytes = len(pickle.dumps(SavePlan(as_sent(plans[0].items), planner_data=plans[0].planner_data)))
        CACHE.clear()
        del plans, dcp_planned, first, handed

        raw, parse_s, parse_cpu, peak, md = b"", math.nan, math.nan, 0, None
        loads: dict[str, dict[str, Any]] = {}
        if refused is None:
            store = Store.open(parse_location(os.path.join(base, "tsckpt0")))
            raw = store.kvstore.read(commit.ROOT).result().value
            tracemalloc.start()
            t, c = time.perf_counter(), time.process_time()
            md = commit.read_metadata(store.kvstore, store.url)
            parse_s, parse_cpu = time.perf_counter() - t, time.process_time() - c
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            del md
            md = None
            gc.enable()
            for name, into in (("same world size", args.ranks), ("3/4 of the world size", max(1, args.ranks * 3 // 4))):
                loads[name] = load_rank(os.path.join(base, "tsckpt0"), into // 3, into)
                status(f"load into {name}: planned")
            md = commit.read_metadata(store.kvstore, store.url)
    finally:
        CACHE.clear()
        shutil.rmtree(base, ignore_errors=True)
    load.append(os.getloadavg()[0])
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
    for k, v in sizes.items():
        print(f"| {k} | {min(v)} | {int(statistics.median(v))} | {max(v)} |")

    if loads:
        print("\n| one rank's load | chunks | tables read | metadata bytes read beyond the root | root parse s (CPU) "
              "| plan s (CPU) | RSS added MB |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name, f in loads.items():
            print(f"| rank {f['rank']} of {f['world']} ({name}) | {f['keys']} | {f['tables_read']} | "
                  f"{f['metadata_bytes_read']} | "
                  f"{f['root_parse_s']:.2f} ({f['root_parse_cpu_s']:.2f}) | {f['plan_s']:.2f} ({f['plan_cpu_s']:.2f}) | "
                  f"{f['root_parse_rss_mb'] + f['plan_rss_mb']:.0f} |")
    if refused is not None:
        print(f"\ntsckpt refused to commit (its finish is timed up to the refusal): {refused}")
    entries = md.tensors if md is not None else {}
    # one data file per rank, plus the B+tree node file, the manifest and the root zarr.json
    packed_files = args.ranks + 3
    figures = {
        "ranks": args.ranks, "tensors": args.tensors, "rows": args.rows, "cols": args.cols,
        "regions_per_tensor": world.regions,
        "phases": {p: {"tsckpt_s": round(ts.wall[p], 3), "tsckpt_cpu_s": round(ts.cpu[p], 3),
                       "dcp_s": round(dc.wall[p], 3), "dcp_cpu_s": round(dc.cpu[p], 3)} for p in phases},
        "tsckpt_adds_s": round(added, 2), "tsckpt_adds_cpu_s": round(added_cpu, 2),
        "plan_bytes_per_rank": {k: {"min": min(v), "median": int(statistics.median(v)), "max": max(v)}
                                for k, v in sizes.items()},
        "root_document_bytes": len(raw), "dcp_metadata_bytes": dcp_md_bytes,
        "metadata_parse_s": round(parse_s, 3), "metadata_parse_cpu_s": round(parse_cpu, 3),
        "metadata_parse_peak_mb": round(peak / 1e6, 1),
        "plain_files": None if md is None else sum(e.grid.nchunks for e in entries.values()) + len(entries) + 1
        + len({e.path.rsplit('/', 1)[0] for e in entries.values()}),
        "tsckpt_refused": refused,
        "loads": loads,
        "packed_files_bound": packed_files,
        "prepickled_shared_vs_own_bytes": round(shared_bytes / own_bytes, 3),
        "items_share_write_data": shared, "peak_rss_gb": round(peak_gb(), 2), "load_average": [round(x, 1) for x in load],
    }
    print()
    for k in ("root_document_bytes", "dcp_metadata_bytes", "metadata_parse_s", "metadata_parse_cpu_s",
              "metadata_parse_peak_mb", "plain_files", "packed_files_bound", "prepickled_shared_vs_own_bytes",
              "items_share_write_data", "peak_rss_gb", "load_average"):
        print(f"{k:>24}: {figures[k]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
