"""Bytes each rank writes when every rank holds the whole state dict (DDP), tsckpt against DCP's FileSystemWriter.

The ``untuned`` workload (``workloads.py``: a 50257-row embedding and output
head hold most of its bytes) of ``--size-gb``, replicated on ``--world`` gloo
ranks, once as ``Replicate()`` DTensors and once as plain tensors, is saved by

* DCP's ``FileSystemWriter`` (default planner): a rank's bytes are the sizes of
  its ``__<rank>_*.distcp`` files;
* ``dcp.save`` with ``TensorStoreWriter`` and DCP's default planner, and
  ``tsckpt.save`` (tsckpt's planner): a rank's bytes are those of the chunks
  the checkpoint records it wrote (each array's ``writers``).

Prints bytes per rank and the largest over an even share (1.00 is even).

    python -m benchmarks replica-writes --size-gb 0.1
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import workloads as wl  # noqa: E402

CONTENDERS = ("dcp", "tsckpt-dcp-planner", "tsckpt")
_DISTCP = re.compile(r"__(\d+)_\d+\.distcp$")


def bytes_by_writer(path: str) -> dict[int, int]:
    """Bytes of tensor data each rank wrote into a tsckpt checkpoint, from the ranks its arrays record per chunk."""
    import tsckpt
    from tsckpt.format import dtypes

    out: dict[int, int] = {}
    for handle in tsckpt.open(path).tensors.values():
        itemsize = dtypes.from_zarr(handle.zarr_dtype).itemsize
        grid = handle.chunks
        for index, rank in handle.writers().items():
            box = grid.chunk_region(index)
            out[rank] = out.get(rank, 0) + itemsize * math.prod(s.stop - s.start for s in box)
    return out


def distcp_bytes_by_rank(path: str) -> dict[int, int]:
    """Bytes of each rank's ``.distcp`` files in a DCP ``FileSystemWriter`` checkpoint."""
    out: dict[int, int] = {}
    for name in os.listdir(path):
        found = _DISTCP.match(name)
        if found:
            rank = int(found.group(1))
            out[rank] = out.get(rank, 0) + os.path.getsize(os.path.join(path, name))
    return out


def imbalance(per_rank: dict[int, int], world: int) -> float:
    """The most any rank wrote over an even share of everything written (1.0 is even)."""
    total = sum(per_rank.values())
    return max(per_rank.values(), default=0) / (total / world) if total else 1.0


def _plain(sd: Any) -> Any:
    """The same state dict with each DTensor replaced by its local tensor: what DDP ranks hold."""
    from torch.distributed.tensor import DTensor

    if isinstance(sd, dict):
        return {k: _plain(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_plain(v) for v in sd]
    return sd.to_local() if isinstance(sd, DTensor) else sd


def save_ranks(rank: int, world: int, cfg: dict[str, Any]) -> None:
    """Save the replicated workload with every contender, as DTensors and as plain tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import tsckpt

    w = wl.from_dict(cfg["workload"])
    mesh = init_device_mesh("cpu", (world,))
    dtensors = wl.build_state_dict(w, wl.DTYPES[cfg["dtype"]], mesh, column=False, fill=True, replicated=True)
    for kind, sd in (("dtensor", dtensors), ("plain", _plain(dtensors))):
        root = os.path.join(cfg["root"], kind)
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(os.path.join(root, "dcp")))
        dcp.save(sd, storage_writer=tsckpt.TensorStoreWriter(os.path.join(root, "tsckpt-dcp-planner")))
        tsckpt.save(sd, os.path.join(root, "tsckpt"))


def measure(root: str, world: int) -> dict[str, dict[str, dict[int, int]]]:
    """Bytes per rank of every checkpoint ``save_ranks`` wrote under ``root``, by state dict kind and contender."""
    out: dict[str, dict[str, dict[int, int]]] = {}
    for kind in ("dtensor", "plain"):
        out[kind] = {}
        for name in CONTENDERS:
            path = os.path.join(root, kind, name)
            out[kind][name] = distcp_bytes_by_rank(path) if name == "dcp" else bytes_by_writer(path)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=float, default=0.1)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--dtype", choices=sorted(wl.DTYPES), default="bf16")
    args = ap.parse_args()
    import torch

    itemsize = torch.empty((), dtype=wl.DTYPES[args.dtype]).element_size()
    w = wl.Untuned.for_size(args.size_gb * 1e9, itemsize)
    print(f"untuned workload, {w.describe()}: {wl.total_bytes(w, itemsize) / 1e9:.3f} GB {args.dtype}, "
          f"replicated on {args.world} ranks")
    with tempfile.TemporaryDirectory(prefix="bench_replica_writes_") as root:
        cfg = {"workload": wl.to_dict(w), "dtype": args.dtype, "root": root}
        harness.run_ranks(args.world, save_ranks, cfg)
        figures = measure(root, args.world)
    rows = []
    for kind, by_name in figures.items():
        for name, per_rank in by_name.items():
            mb = " / ".join(f"{per_rank.get(r, 0) / 1e6:.1f}" for r in range(args.world))
            rows.append([kind, name, mb, f"{imbalance(per_rank, args.world):.2f}"])
    print(harness.table(["state dict", "writer", "MB written per rank", "max / even"], rows, "llrr"))


if __name__ == "__main__":
    main()
