"""tsckpt vs DCP's FileSystemWriter/Reader vs raw disk, on one sharded state dict, in one run.

A transformer-like state dict (embedding, attention and MLP matrices, norms,
two AdamW moments per parameter, step counters) of ``--size-gb`` per dtype is
row-sharded over ``--world`` spawned gloo CPU ranks and

* saved by raw disk (each rank's bytes to one file, fsync), DCP with each
  ``--dcp-threads`` thread_count, and tsckpt; then loaded back into the same
  topology (raw: ``numpy.fromfile``), checksums compared;
* saved with ``async_save`` (time until it returns vs one staging copy);
* loaded column-sharded into ``--reshard-world`` ranks;
* opened, and one tensor slice read, in a single process without a process group.

Each figure is the median of ``--reps`` repetitions. Before every load the
checkpoint's files are dropped from the page cache (``drop_caches`` where
permitted, otherwise ``posix_fadvise(DONTNEED)`` per file; the output says which).
Writes ``results.md``, ``results.png`` and ``results.json`` to ``--out``.

    python benchmarks/bench_dcp.py                      # 1 GB, bf16 and fp32
    python benchmarks/bench_dcp.py --size-gb 0.2 --reps 1 --dtypes bf16
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dcp_ranks  # noqa: E402
import dcp_report  # noqa: E402

SLICE_KEY = "model.embed.weight"
SLICE_ROWS = 128


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(phase: Any, world: int, cfg: dict[str, Any], tmp: str) -> dict[str, Any]:
    out = os.path.join(tmp, f"{phase.__name__}.json")
    mp.start_processes(phase, args=(world, _free_port(), cfg, out), nprocs=world, start_method="spawn")
    with open(out) as f:
        return json.load(f)


def single_process(cfg: dict[str, Any], best_dcp: str) -> dict[str, dict[str, float]]:
    """Open and slice-read each checkpoint in this process, no process group."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    import tsckpt

    warnings.simplefilter("ignore")
    shape = (cfg["shapes"]["vocab"], cfg["shapes"]["hidden"])
    dtype = dcp_ranks.DTYPES[cfg["dtype"]]
    rows = slice(shape[0] // 2, shape[0] // 2 + SLICE_ROWS)

    def dcp_open(path: str) -> Any:
        return FileSystemReader(path).read_metadata()

    def dcp_slice(path: str) -> Any:
        # DCP has no partial read of a tensor: load it whole, then slice.
        whole = {"model": {"embed.weight": torch.empty(shape, dtype=dtype)}}
        dcp.load(whole, storage_reader=FileSystemReader(path), no_dist=True)
        return whole["model"]["embed.weight"][rows].clone()

    def ts_slice(path: str) -> Any:
        return tsckpt.open(path)[SLICE_KEY][rows]

    ops = {"tsckpt": {"open": tsckpt.open, "slice": ts_slice}, best_dcp: {"open": dcp_open, "slice": dcp_slice}}
    out: dict[str, dict[str, list[float]]] = {}
    for _ in range(cfg["reps"]):
        for name, fns in ops.items():
            path = dcp_ranks.checkpoint_path(cfg["root"], name, cfg["reps"] - 1)
            for what, fn in fns.items():
                dcp_ranks.evict(path)
                t0 = time.perf_counter()
                fn(path)
                out.setdefault(name, {}).setdefault(what, []).append(time.perf_counter() - t0)
    last = cfg["reps"] - 1
    check = tsckpt.open(dcp_ranks.checkpoint_path(cfg["root"], "tsckpt", last))[SLICE_KEY][rows]
    if not torch.equal(check, dcp_slice(dcp_ranks.checkpoint_path(cfg["root"], best_dcp, last))):
        raise AssertionError("tsckpt and DCP slices differ")
    return {n: {w: statistics.median(v) for w, v in d.items()} for n, d in out.items()}


def run_dtype(args: argparse.Namespace, dtype: str, root: str) -> dict[str, Any]:
    itemsize = dcp_ranks.DTYPES[dtype].itemsize
    shapes = dcp_ranks.Shapes.for_size(args.size_gb * 1e9, itemsize)
    cfg = {"dtype": dtype, "shapes": dataclasses.asdict(shapes), "reps": args.reps, "root": root,
           "dcp_threads": args.dcp_threads, "settle": args.settle, "variants": [{}] + [_option(v) for v in args.variants]}
    print(f"[{dtype}] {shapes}, {args.world} ranks, {args.reps} reps", flush=True)
    saved = _spawn(dcp_ranks.save_phase, args.world, cfg, root)
    dcp_names = [f"dcp-t{t}" for t in args.dcp_threads]
    best = min(dcp_names, key=lambda n: statistics.median(saved["times"][n]["save"]))
    print(f"[{dtype}] saves done; resharding {args.world} -> {args.reshard_world} ranks", flush=True)
    resharded = _spawn(dcp_ranks.reshard_phase, args.reshard_world, cfg | {"checksums": saved["checksums"]}, root)
    single = single_process(cfg, best)
    times = {name: {what: statistics.median(xs) for what, xs in d.items()} for name, d in saved["times"].items()}
    for name, d in resharded["times"].items():
        times[name]["reshard"] = statistics.median(d["reshard"])
    for name, d in single.items():
        times[name] |= d
    total = sum(itemsize * math.prod(s) * 3 for s in shapes.params().values())
    samples = dict(saved["times"])
    for name, d in resharded["times"].items():
        samples[name] = samples[name] | d
    return {"dtype": dtype, "shapes": dataclasses.asdict(shapes), "bytes": total, "times": times, "samples": samples,
            "memory": saved["memory"], "files": saved["files"], "local_bytes": saved["local_bytes"],
            "evict": saved["evict"], "dcp_default": dcp_names[0], "dcp_best": best,
            "variants": [dcp_ranks.variant_name(v) for v in cfg["variants"]]}


def _option(text: str) -> dict[str, Any]:
    key, _, value = text.partition("=")
    return {key: ast.literal_eval(value)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=1.0, help="state dict size per dtype variant")
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=sorted(dcp_ranks.DTYPES))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--reshard-world", type=int, default=2)
    ap.add_argument("--dcp-threads", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4],
                    help="FileSystemWriter thread_count values to try; the first is DCP's default")
    ap.add_argument("--variants", nargs="*", default=["checksums=True"],
                    help="extra tsckpt contenders, one writer option each (e.g. compression='zstd')")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds to wait (after sync) before each save")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--update-readme", action="store_true", help="replace the README's benchmark table")
    args = ap.parse_args()

    base = tempfile.mkdtemp(prefix="tsckpt-bench-", dir=args.dir)
    runs = []
    try:
        for dtype in args.dtypes:
            root = os.path.join(base, dtype)
            os.makedirs(root)
            runs.append(run_dtype(args, dtype, root))
            shutil.rmtree(root)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    env = {"cpus": os.cpu_count(), "python": platform.python_version(), "args": vars(args),
           "date": time.strftime("%Y-%m-%d %H:%M")}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"env": env, "runs": runs}, f, indent=1)
    markdown = dcp_report.markdown(runs, env)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(markdown)
    dcp_report.plot(runs, os.path.join(args.out, "results.png"))
    if args.update_readme:
        dcp_report.update_readme(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md"),
                                 markdown)
    print(markdown)


if __name__ == "__main__":
    main()
