"""How a save makes its chunk files durable on a local disk: one ``syncfs`` per rank against an fsync per file.

``--world`` gloo CPU ranks save the untuned workload (``workloads.py``) of
``--size-gb``, row-sharded, through ``dcp.save`` with DCP's default planner,
``--reps`` times each for three contenders in rotating order:

* ``syncfs``: tsckpt as it ships (on ext4, xfs, btrfs, f2fs or tmpfs);
* ``fsync-each``: tsckpt with the local-filesystem list emptied in every rank,
  so each chunk file is fsynced as on a network filesystem;
* ``dcp``: DCP's ``FileSystemWriter`` (one file per rank, fsynced).

Everything is flushed before each save; times are between barriers (the
slowest rank's). Prints medians, ranges and the ratios.

    python benchmarks/bench_durability.py --size-gb 1 --reps 6
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import workloads as wl  # noqa: E402

NAMES = ["syncfs", "fsync-each", "dcp"]


def ranks(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, list[float]] | None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh

    import tsckpt
    from tsckpt.storage import localfs

    local = dict(localfs.LOCAL_FILESYSTEMS)
    w = wl.Untuned.for_size(cfg["gb"] * 1e9, 2)
    sd = wl.build_state_dict(w, torch.bfloat16, init_device_mesh("cpu", (world,)), False, True)
    out: dict[str, list[float]] = {}
    for rep in range(cfg["reps"]):
        for name in NAMES[rep % len(NAMES):] + NAMES[:rep % len(NAMES)]:
            path = os.path.join(cfg["root"], f"{name}-{rep}")
            localfs.LOCAL_FILESYSTEMS.clear()
            if name == "syncfs":
                localfs.LOCAL_FILESYSTEMS.update(local)
            if rank == 0:
                os.sync()
            dist.barrier()
            t0 = time.perf_counter()
            if name == "dcp":
                dcp.save(sd, storage_writer=FileSystemWriter(path))
            else:
                dcp.save(sd, storage_writer=tsckpt.TensorStoreWriter(path, layout=cfg["layout"]))
            dist.barrier()
            out.setdefault(name, []).append(time.perf_counter() - t0)
    return out if rank == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--layout", default="plain", choices=["plain", "packed"])
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="tsckpt-durability-", dir=args.dir)
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    try:
        got = harness.run_ranks(args.world, ranks, {"gb": args.size_gb, "layout": args.layout, "root": root,
                                                    "reps": args.reps})[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in got.items()}
    print(f"{args.world} ranks, {args.size_gb} GB untuned bf16, {args.layout} layout, {args.reps} reps, "
          f"load average before {load}")
    rows = [[k, f"{med[k]:.3f} s ({min(v):.2f}-{max(v):.2f})", f"{med['dcp'] / med[k]:.2f}x"] for k, v in got.items()]
    print(harness.table(["contender", "median save (min-max)", "speed-up over DCP"], rows))


if __name__ == "__main__":
    main()
