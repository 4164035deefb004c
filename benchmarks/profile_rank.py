"""Profile rank 0 of a tsckpt save or column-resharded load, to see where a phase's CPU goes.

``--world`` gloo ranks build the workload's state dict row-sharded, save it
with ``dcp.save`` and tsckpt's writer (DCP's default planners), then repeat the
phase ``--reps`` times: ``save`` saves again, ``reshard`` loads the checkpoint
column-sharded into the same ranks. The last repetition runs under
``cProfile`` on rank 0, timed in that thread's CPU time (not wall time, which
on a machine with more ranks than cores mostly measures waiting for a core),
and the functions that took most of it are printed, with the CPU seconds
(all threads of each rank process, summed over the ranks) of every
repetition.

    python -m benchmarks profile --phase reshard
    python -m benchmarks profile --phase save --workload small --gb 0.16
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import resource
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dcp_ranks  # noqa: E402
import harness  # noqa: E402
import workloads as wl  # noqa: E402


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _ranks(rank: int, world: int, root: str, cfg: dict[str, Any], phase: str, reps: int,
           top: int, sort: str = "tottime", dump: str = "") -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import tsckpt

    devices = dcp_ranks.mesh(world)
    sd = dcp_ranks._state(cfg, devices, column=False, fill=True)
    path = os.path.join(root, "ck")
    dcp.save(sd, storage_writer=tsckpt.TensorStoreWriter(path))
    cpu: list[float] = []
    prof = cProfile.Profile(time.thread_time)
    for rep in range(reps):
        if phase == "reshard":
            dest = dcp_ranks._state(cfg, devices, column=True, fill=False)
            run = lambda: dcp.load(dest, storage_reader=tsckpt.TensorStoreReader(path))  # noqa: E731
        else:
            target = os.path.join(root, f"save-{rep}")
            run = lambda: dcp.save(sd, storage_writer=tsckpt.TensorStoreWriter(target))  # noqa: E731
        profiled = rep == reps - 1 and rank == 0
        dist.barrier()
        c = _cpu()
        if profiled:
            prof.enable()
        run()
        if profiled:
            prof.disable()
        total = torch.tensor([_cpu() - c], dtype=torch.float64)
        dist.all_reduce(total)
        cpu.append(round(float(total), 3))
        dist.barrier()
    if rank != 0:
        return None
    if dump:
        prof.dump_stats(dump)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats(sort).print_stats(top)
    return {"cpu": cpu, "profile": out.getvalue()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", choices=("reshard", "save"), default="reshard")
    ap.add_argument("--workload", default="untuned", choices=sorted(wl.WORKLOADS))
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--dtype", default="bf16", choices=sorted(wl.DTYPES))
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--top", type=int, default=20, help="how many functions to print")
    ap.add_argument("--sort", default="tottime", choices=("tottime", "cumulative"),
                    help="order functions by their own time, or with what they call")
    ap.add_argument("--dump", default="", help="also write rank 0's profile to this file, for pstats or snakeviz")
    args = ap.parse_args()
    work = wl.WORKLOADS[args.workload].for_size(args.gb * 1e9, wl.DTYPES[args.dtype].itemsize)
    cfg = {"workload": wl.to_dict(work), "dtype": args.dtype}
    root = tempfile.mkdtemp(prefix="tsckpt-profile-")
    try:
        res = harness.run_ranks(args.world, _ranks, root, cfg, args.phase, args.reps, args.top,
                                 args.sort, os.path.abspath(args.dump) if args.dump else "")[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.workload} {args.dtype}, {args.world} ranks, {args.phase}: CPU s of every rank, summed, per "
          f"repetition: {res['cpu']}; rank 0's last repetition, by its thread's CPU time:")
    print(res["profile"])


if __name__ == "__main__":
    main()
