"""CPU seconds per GB of state: tsckpt against DCP's FileSystemWriter/Reader, on local disk, alternating.

``--world`` gloo ranks save the untuned (or ``--workload``) state dict
row-sharded through ``dcp.save`` with DCP's default planners, then load it
back into the same ranks and column-sharded into the same number of ranks.
Each phase is timed between barriers, and its CPU is the user + system time of
every rank process (all threads, ``getrusage(RUSAGE_SELF)``), summed over the
ranks, per GB of state. Every repetition rotates which contender goes first;
the page cache is emptied of a checkpoint's files before each load. Medians of
``--reps`` with their range; ratios are tsckpt's CPU over DCP's (below 1:
tsckpt uses less). ``--json FILE`` keeps every sample.

    python -m benchmarks cpu --gb 1 --reps 6
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dcp_ranks  # noqa: E402
import harness  # noqa: E402
import workloads as wl  # noqa: E402

PHASES = ("save", "load", "reshard")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _ranks(rank: int, world: int, root: str, cfg: dict[str, Any], layouts: list[str], reps: int,
           settle: float) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    import tsckpt

    devices = dcp_ranks.mesh(world)
    sd = dcp_ranks._state(cfg, devices, column=False, fill=True)
    contenders: dict[str, tuple[Any, Any]] = {"dcp": (FileSystemWriter, FileSystemReader)}
    for layout in layouts:
        contenders[f"tsckpt {layout}"] = (lambda p, lay=layout: tsckpt.TensorStoreWriter(p, layout=lay),
                                          tsckpt.TensorStoreReader)
    out: dict[str, dict[str, list[tuple[float, float]]]] = {n: {p: [] for p in PHASES} for n in contenders}

    def summed(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t)

    def timed(name: str, phase: str, fn: Any) -> None:
        dist.barrier()
        t, c = time.perf_counter(), _cpu()
        fn()
        c = _cpu() - c
        dist.barrier()
        out[name][phase].append((time.perf_counter() - t, summed(c)))

    for rep in range(reps):
        for name in dcp_ranks.rotated(list(contenders), rep):
            writer, reader = contenders[name]
            path = os.path.join(root, f"{name.replace(' ', '-')}-{rep}")
            dcp_ranks.settle(settle)
            timed(name, "save", lambda: dcp.save(sd, storage_writer=writer(path)))
            for phase, column in (("load", False), ("reshard", True)):
                dest = dcp_ranks._state(cfg, devices, column=column, fill=False)
                if rank == 0:
                    harness.evict(path)
                timed(name, phase, lambda: dcp.load(dest, storage_reader=reader(path)))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    return out if rank == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--workload", default="untuned", choices=sorted(wl.WORKLOADS))
    ap.add_argument("--dtype", default="bf16", choices=sorted(wl.DTYPES))
    ap.add_argument("--layouts", default="packed", help="tsckpt layouts, comma-separated")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--settle", type=float, default=1.0, help="seconds to wait (after sync) before each save")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    ap.add_argument("--json", default=None, help="also write the samples here")
    args = ap.parse_args()
    env = harness.environment("python -m benchmarks cpu", sys.argv[1:])
    work = wl.WORKLOADS[args.workload].for_size(args.gb * 1e9, wl.DTYPES[args.dtype].itemsize)
    cfg = {"workload": wl.to_dict(work), "dtype": args.dtype}
    gb = wl.total_bytes(work, wl.DTYPES[args.dtype].itemsize) / 1e9
    root = tempfile.mkdtemp(prefix="tsckpt-cpu-", dir=args.dir)
    print(f"{args.workload} {args.dtype}, {gb:.3f} GB, {args.world} ranks, {args.reps} reps; load average "
          f"{os.getloadavg()[0]:.1f} before", flush=True)
    try:
        res = harness.run_ranks(args.world, _ranks, root, cfg, args.layouts.split(","), args.reps, args.settle)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    env["load_after"] = harness.loadavg()
    print(f"\nload average {os.getloadavg()[0]:.1f} after\n")
    print(harness.table(["phase", "contender", "wall, median (min-max)", "CPU s / GB, median (min-max)",
                         "CPU vs DCP"], rows(res, gb)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "state": f"{args.workload} {args.dtype}, {gb:.2f} GB", "gb": gb,
                       "world": args.world, "samples": res}, f, indent=1)


def rows(res: dict[str, dict[str, list[tuple[float, float]]]], gb: float) -> list[list[str]]:
    """A row per phase and contender: wall seconds and CPU seconds per GB, medians with their range."""
    def cell(xs: list[float], fmt: str) -> str:
        return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})"

    out = []
    for phase in PHASES:
        dcp_cpu = statistics.median(s[1] for s in res["dcp"][phase]) / gb
        for name, phases in res.items():
            wall, cpu = [s[0] for s in phases[phase]], [s[1] / gb for s in phases[phase]]
            out.append([phase, name, cell(wall, ".3f"), cell(cpu, ".2f"),
                        "-" if name == "dcp" else f"**{statistics.median(cpu) / dcp_cpu:.2f}x**"])
    return out


if __name__ == "__main__":
    main()
