"""tsckpt vs DCP's FileSystemWriter/Reader, on tuned and untuned state dicts, by every call path, in one run.

For each workload (``--workloads``; see ``workloads.py``) of ``--size-gb`` per
dtype, row-sharded over ``--world`` gloo CPU ranks, every contender
(``contenders.py``: DCP's default writer and reader, tsckpt through
``dcp.save``/``dcp.load`` with DCP's default planners, ``tsckpt.save`` /
``tsckpt.load``, each tsckpt path once per ``--layouts`` entry, raw disk; with
``--unsynced``, the default, also ``tsckpt.save`` with ``sync_files=False`` and
torch-checkpointing, which do not fsync, the one compared with the other)

* saves, then loads back into the same topology (checksums compared);
* loads column-sharded into the same rank count and into ``--reshard-world`` ranks
  (not torch-checkpointing: it reshards only on CUDA ranks);
* on the tuned workload also: ``async_save``, and opening and slicing without a process group.

Then (``fetched.py``) the bytes each rank fetches from the local disk vs the
bytes it needs, on each load of ``--reshards`` (what ranks fetch from S3 is
the ``s3`` scenario's); and (``--many-ranks``)
runs with more ranks than cores on a few hundred small tensors.

Every repetition rotates which contender goes first; every figure keeps its
samples in ``results.json`` and the tables report medians. Writes
``results.md`` and ``results.json`` to ``--out``, and the figures of
``plots.py`` (speed-ups, bytes per rank) to ``--plots`` (default: ``--out``).

    python -m benchmarks local --size-gb 0.25 --update-docs
    python -m benchmarks local --quick                      # smoke run: tiny sizes, 1 repetition
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import contenders as cont  # noqa: E402
import dcp_ranks  # noqa: E402
import dcp_report  # noqa: E402
import harness  # noqa: E402
import fetched  # noqa: E402
import workloads as wl  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SLICE_ROWS = 128
PHASES = ("timed", "first", "extras", "fetched", "many")


def single_process(cfg: dict[str, Any], ours: str) -> dict[str, dict[str, list[float]]]:
    """Open and slice-read the embedding of the last checkpoints in this process, no process group."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    import tsckpt

    warnings.simplefilter("ignore")
    w = wl.from_dict(cfg["workload"])
    name, shape = next((n, s) for n, s in w.params().items() if len(s) == 2)
    dtype = wl.DTYPES[cfg["dtype"]]
    rows = slice(shape[0] // 2, shape[0] // 2 + SLICE_ROWS)

    def dcp_slice(path: str) -> Any:
        # DCP has no partial read of a tensor: load it whole, then slice.
        whole = {"model": {name: torch.empty(shape, dtype=dtype)}}
        dcp.load(whole, storage_reader=FileSystemReader(path), no_dist=True)
        return whole["model"][name][rows].clone()

    def ts_slice(path: str) -> Any:
        return tsckpt.open(path)[f"model.{name}"][rows]

    ops = {ours: {"open": tsckpt.open, "slice": ts_slice},
           dcp_report.DCP: {"open": lambda p: FileSystemReader(p).read_metadata(), "slice": dcp_slice}}
    last = cfg["reps"] - 1
    out: dict[str, dict[str, list[float]]] = {}
    for rep in range(cfg["reps"]):
        for who in dcp_ranks.rotated(list(ops), rep):
            path = dcp_ranks.checkpoint_path(cfg["root"], who, last)
            for what, fn in ops[who].items():
                harness.evict(path)
                t0 = time.perf_counter()
                fn(path)
                out.setdefault(who, {}).setdefault(what, []).append(time.perf_counter() - t0)
    mine = ts_slice(dcp_ranks.checkpoint_path(cfg["root"], ours, last))
    if not torch.equal(mine, dcp_slice(dcp_ranks.checkpoint_path(cfg["root"], dcp_report.DCP, last))):
        raise AssertionError("tsckpt and DCP slices differ")
    return out


def _merge(into: dict[str, dict[str, list[float]]], more: dict[str, dict[str, list[float]]]) -> None:
    for name, figures in more.items():
        into.setdefault(name, {}).update(figures)


def run_workload(args: argparse.Namespace, name: str, dtype: str, root: str, layouts: list[str]) -> dict[str, Any]:
    """Save, same-topology load, and both column reshards of one workload; returns samples and counts."""
    itemsize = wl.DTYPES[dtype].itemsize
    w = wl.WORKLOADS[name].for_size(args.size_gb * 1e9, itemsize)
    extras = "extras" in args.phases and name == "tuned"
    cfg = {"workload": wl.to_dict(w), "dtype": dtype, "reps": args.reps, "root": root, "layouts": layouts,
           "dcp_threads": args.dcp_threads, "settle": args.settle, "raw": True, "extras": extras,
           "variants": args.variants, "paths": args.paths, "unsynced": args.unsynced, "peers": args.peers}
    print(f"[{name} {dtype}] {w.describe()}: {wl.total_bytes(w, itemsize) / 1e9:.3f} GB, "
          f"{args.world} ranks, {args.reps} reps", flush=True)
    saved = harness.run_ranks(args.world, dcp_ranks.save_phase, cfg)[0]
    samples = saved["times"]
    for figure, world in (("reshard_same", args.world), ("reshard_fewer", args.reshard_world)):
        print(f"[{name} {dtype}] column-sharded load into {world} ranks", flush=True)
        more = harness.run_ranks(world, dcp_ranks.reshard_phase,
                                 cfg | {"checksums": saved["checksums"], "figure": figure})[0]
        _merge(samples, more["times"])
    if "first" in args.phases:
        _first_saves(args, name, dtype, cfg, samples)
    if extras:
        _merge(samples, single_process(cfg, f"tsckpt/{layouts[0]}"))
    return {"workload": name, "dtype": dtype, "shapes": wl.to_dict(w), "describe": w.describe(),
            "bytes": wl.total_bytes(w, itemsize), "world": args.world, "reshard_world": args.reshard_world,
            "samples": samples, "memory": saved["memory"], "files": saved["files"],
            "local_bytes": saved["local_bytes"], "evict": saved["evict"]}


def _first_saves(args: argparse.Namespace, name: str, dtype: str, cfg: dict[str, Any],
                 samples: dict[str, dict[str, list[float]]]) -> None:
    """Each contender's first save and load of a job: fresh ranks per contender and repetition, in rotating order."""
    names = [c.name for c in cont.contenders(cfg, raw=True)]
    print(f"[{name} {dtype}] first save of a job, {len(names)} contenders x {args.reps} fresh process groups",
          flush=True)
    for rep in range(args.reps):
        for who in dcp_ranks.rotated(names, rep):
            got = harness.run_ranks(args.world, dcp_ranks.first_phase, cfg | {"contender": who, "rep": rep})[0]
            for figures in got["times"].values():
                for figure, xs in figures.items():
                    samples.setdefault(who, {}).setdefault(figure, []).extend(xs)


def run_many(args: argparse.Namespace, ranks: int, root: str, layouts: list[str]) -> dict[str, Any]:
    """Save and same-topology load of many small tensors from ``ranks`` ranks (more ranks than cores)."""
    dtype = args.dtypes[0]
    itemsize = wl.DTYPES[dtype].itemsize
    w = wl.Small.for_size(args.many_gb * 1e9, itemsize)
    cfg = {"workload": wl.to_dict(w), "dtype": dtype, "reps": args.many_reps, "root": root, "layouts": layouts,
           "dcp_threads": args.dcp_threads[:1], "settle": args.settle, "raw": False, "extras": False,
           "paths": args.paths, "unsynced": args.unsynced, "peers": args.peers}
    print(f"[many] {ranks} ranks, {w.describe()}, {args.many_reps} reps", flush=True)
    saved = harness.run_ranks(ranks, dcp_ranks.save_phase, cfg)[0]
    return {"ranks": ranks, "describe": w.describe(), "bytes": wl.total_bytes(w, itemsize), "cpus": os.cpu_count(),
            "samples": saved["times"], "files": saved["files"], "evict": saved["evict"]}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _option(text: str) -> dict[str, Any]:
    key, _, value = text.partition("=")
    return {key: ast.literal_eval(value)}


def _names(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=0.25, help="state dict size per workload and dtype")
    ap.add_argument("--dtypes", type=_names, default=["bf16"], help="comma-separated: bf16,fp32")
    ap.add_argument("--workloads", type=_names, default=["tuned", "untuned"], help="comma-separated, see workloads.py")
    ap.add_argument("--layouts", type=_names, default=["plain", "packed"], help="tsckpt layouts, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--reshard-world", type=int, default=2)
    ap.add_argument("--dcp-threads", type=_ints, default=[1],
                    help="FileSystemWriter thread_count values (e.g. 1,2,4); the first should be 1, DCP's default")
    ap.add_argument("--paths", type=_names, default=list(cont.PATHS),
                    help="tsckpt call paths: dcp (dcp.save/dcp.load with DCP's default planners), api (tsckpt.save)")
    ap.add_argument("--variants", nargs="*", type=_option, default=[],
                    help="extra tsckpt.save contenders, one writer option each (e.g. compression='zstd')")
    ap.add_argument("--unsynced", action=argparse.BooleanOptionalAction, default=True,
                    help="also the contenders that do not fsync: tsckpt.save with sync_files=False, compared with "
                         f"{', '.join(cont.OPTIONAL)} (each skipped with a note when its package is missing)")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds to wait (after sync) before each save")
    ap.add_argument("--phases", type=_names, default=list(PHASES), help=f"comma-separated subset of {PHASES}")
    ap.add_argument("--fetch-gb", type=float, default=0.25, help="state dict size for bytes fetched on local disk")
    ap.add_argument("--fetch-workload", default="untuned", choices=sorted(wl.WORKLOADS))
    ap.add_argument("--reshards", default=fetched.RESHARDS,
                    help="loads measured for bytes fetched, as PLACEMENT:RANKS (row, column, replicated), comma-separated")
    ap.add_argument("--many-ranks", type=_ints, default=[8, 16])
    ap.add_argument("--many-gb", type=float, default=0.02, help="size of the many-small-tensors state dict")
    ap.add_argument("--many-reps", type=int, default=None, help="repetitions of the many-rank runs (default --reps)")
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, 1 repetition, no settling")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    ap.add_argument("--out", default=os.path.join(harness.RESULTS, "local"),
                    help="where results.json and results.md go")
    ap.add_argument("--update-docs", "--update-readme", dest="update_docs", action="store_true",
                    help="replace the results block of docs/benchmarks/dcp.md")
    ap.add_argument("--plots", default="", help="where plots.py's figures (dcp_<kind>.png) go (default: --out)")
    args = ap.parse_args(argv)
    if args.quick:
        args.size_gb, args.fetch_gb, args.many_gb = 0.01, 0.01, 0.002
        args.reps, args.settle, args.many_ranks = 1, 0.0, args.many_ranks[:1]
    args.many_reps = args.many_reps or args.reps
    args.peers = list(cont.OPTIONAL) if args.unsynced else []
    if args.dcp_threads[0] != 1:
        ap.error("--dcp-threads must start with 1, DCP's default, which every ratio is taken against")
    return args


def environment(args: argparse.Namespace) -> dict[str, Any]:
    modules = ("torch", "tensorstore", *args.peers)
    return harness.environment("python -m benchmarks local", sys.argv[1:], modules) | {
        "args": vars(args), "reps": args.reps, "complete": False}


def write_results(args: argparse.Namespace, results: dict[str, Any]) -> str:
    import json

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = dcp_report.markdown(results)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text)
    dcp_report.write_plots(results, args.plots or args.out)
    if args.update_docs:
        dcp_report.update_block(dcp_report.DOCS_PAGE, text)
    return text


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    layouts, skipped = cont.supported_layouts(args.layouts)
    for lay in skipped:
        print(f"note: the installed tsckpt does not accept layout={lay!r}; skipping it", flush=True)
    if not layouts:
        raise SystemExit("no layout left to measure")
    missing = cont.missing_peers(args.peers)
    for name, why in missing.items():
        print(f"note: {why}; skipping {name}", flush=True)
    args.peers = [p for p in args.peers if p not in missing]
    results: dict[str, Any] = {"env": environment(args), "layouts": {"run": layouts, "skipped": skipped},
                               "peers": {"run": args.peers, "skipped": missing}, "runs": [], "many": []}
    base = tempfile.mkdtemp(prefix="tsckpt-bench-", dir=args.dir)
    try:
        if "timed" in args.phases:
            for dtype in args.dtypes:
                for name in args.workloads:
                    root = os.path.join(base, f"{name}-{dtype}")
                    os.makedirs(root)
                    results["runs"].append(run_workload(args, name, dtype, root, layouts))
                    shutil.rmtree(root)
                    write_results(args, results)  # keep what finished if a later phase fails
        if "fetched" in args.phases:
            results["fetched"] = fetched_run(args, layouts, base)
            write_results(args, results)
        if "many" in args.phases:
            for ranks in args.many_ranks:
                root = os.path.join(base, f"many-{ranks}")
                os.makedirs(root)
                results["many"].append(run_many(args, ranks, root, layouts))
                shutil.rmtree(root)
                write_results(args, results)
        results["env"]["complete"] = True
    finally:
        shutil.rmtree(base, ignore_errors=True)
        results["env"]["load_after"] = harness.loadavg()
        print(write_results(args, results))


def fetched_run(args: argparse.Namespace, layouts: list[str], base: str) -> dict[str, Any]:
    return fetched.run(args, layouts, base)


if __name__ == "__main__":
    main()
