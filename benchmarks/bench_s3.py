"""Save and load a sharded state dict to local disk and to an S3 server, in one run.

Starts ``--world`` gloo ranks on CPU. Each rank owns a row shard of every
tensor (DTensor, ``Shard(0)``). Every rank saves to a local directory, then to
``s3://bench/...`` on a moto server started on 127.0.0.1, and loads each back
into fresh tensors of the same layout, checking the bytes. Times are wall
clock on rank 0 between barriers. Prints a markdown table.

    python benchmarks/bench_s3.py --mb 200 --world 4

moto keeps objects in memory in one Python process, so its figures measure
the S3 protocol path (HTTP, signing, one request per chunk) rather than a
real object store's bandwidth.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import run_ranks, table  # noqa: E402
from s3server import MotoServer, restore_credentials, set_credentials  # noqa: E402

TENSOR_ROWS = 4096


def _state_dict(world: int, total_bytes: int, seed: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    rank = dist.get_rank()
    n_tensors = 10
    cols = max(total_bytes // (n_tensors * TENSOR_ROWS * 4), 1)
    rows_per_rank = TENSOR_ROWS // world
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return {
        f"layer{i}.weight": DTensor.from_local(
            torch.rand(rows_per_rank, cols, generator=g), mesh, [Shard(0)], run_check=False)
        for i in range(n_tensors)
    }


def _nbytes(sd: dict[str, Any]) -> int:
    return sum(t.to_local().numel() * t.to_local().element_size() for t in sd.values())


def _timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def bench_rank(rank: int, world: int, total_bytes: int, targets: dict[str, Any], repeat: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import tsckpt

    sd = _state_dict(world, total_bytes, seed=1)
    local = torch.tensor([_nbytes(sd)], dtype=torch.int64)
    dist.all_reduce(local)
    out: dict[str, Any] = {"bytes": int(local.item())}
    # First save/load in a process pays one-time costs (imports, planner set-up); keep them out.
    warm_dir = targets["local disk"] + "-warmup"
    small = {k: v for k, v in list(sd.items())[:1]}
    tsckpt.save(small, warm_dir)
    tsckpt.load(small, warm_dir)
    for name, location in targets.items():
        saves, loads = [], []
        for r in range(repeat):
            where = _with_suffix(location, r)
            saves.append(_timed(lambda: tsckpt.save(sd, where)))
            fresh = {k: DTensor.from_local(
                torch.zeros_like(v.to_local()), v.device_mesh, v.placements, run_check=False) for k, v in sd.items()}
            loads.append(_timed(lambda: tsckpt.load(fresh, where)))
            if not all(torch.equal(fresh[k].to_local(), sd[k].to_local()) for k in sd):
                raise AssertionError(f"rank {rank}: loaded data differs from saved data at {where}")
        out[name] = {"save": min(saves), "load": min(loads)}
    return out


def _with_suffix(location: Any, r: int) -> Any:
    if isinstance(location, dict):
        return {**location, "url": f"{location['url']}-{r}"}
    return f"{location}-{r}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200, help="total state dict size in MB (10^6 bytes)")
    parser.add_argument("--world", type=int, default=4, help="number of ranks")
    parser.add_argument("--repeat", type=int, default=2, help="runs per target; the best is reported")
    parser.add_argument("--dir", default=None, help="local directory for the disk checkpoint (default: a temp dir)")
    args = parser.parse_args()

    local_root = tempfile.mkdtemp(prefix="tsckpt-bench-", dir=args.dir)
    previous = set_credentials()
    try:
        with MotoServer() as s3:
            s3.create_bucket("bench")
            targets = {
                "local disk": os.path.join(local_root, "ckpt"),
                "S3 (moto, 127.0.0.1)": s3.location("bench", "ckpt"),
            }
            results = run_ranks(args.world, bench_rank, args.mb * 10**6, targets, args.repeat)[0]
    finally:
        restore_credentials(previous)
        shutil.rmtree(local_root, ignore_errors=True)

    gb = results["bytes"] / 1e9
    print(f"\n{args.world} ranks, {results['bytes'] / 1e6:.0f} MB float32 (10 DTensors, Shard(0)), best of {args.repeat}\n")
    rows = [[name, f"{r['save']:.2f}", f"{gb / r['save']:.3f}", f"{r['load']:.2f}", f"{gb / r['load']:.3f}"]
            for name, r in ((name, results[name]) for name in targets)]
    local, remote = results["local disk"], results["S3 (moto, 127.0.0.1)"]
    rows.append(["S3/local time ratio", f"{remote['save'] / local['save']:.2f}x", "",
                 f"{remote['load'] / local['load']:.2f}x", ""])
    print(table(["target", "save s", "save GB/s", "load s", "load GB/s"], rows, "lrrrr"))


if __name__ == "__main__":
    main()
