"""The floor of a replicated load's exchange on this machine: gloo ranks sending their stripes to each other.

A replicated load with replica reads (``tsckpt/dcp/replica_reads.py``) has
each of ``--world`` replicas fetch a stripe of every tensor from storage and
send it to the others point to point. This times that exchange alone, with no
storage: every rank sends ``--mb`` MiB to each other rank and receives as
much from each (``isend``/``irecv``, as the reader does), between barriers.
Medians of ``--reps``; the MB/s counts the bytes received by all ranks.

    python benchmarks/bench_exchange.py --mb 76 --world 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402


def _ranks(rank: int, world: int, mb: int, reps: int) -> list[float] | None:
    import torch
    import torch.distributed as dist

    mine = torch.randint(0, 255, (mb << 20,), dtype=torch.uint8)
    theirs = {peer: torch.empty_like(mine) for peer in range(world) if peer != rank}
    times = []
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        works: list[Any] = [dist.isend(mine, peer) for peer in theirs]
        works += [dist.irecv(buf, peer) for peer, buf in theirs.items()]
        for w in works:
            w.wait()
        dist.barrier()
        times.append(time.perf_counter() - t)
    return times if rank == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=76, help="MiB each rank sends to each other rank")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--reps", type=int, default=6)
    args = ap.parse_args()
    times = harness.run_ranks(args.world, _ranks, args.mb, args.reps)[0]
    median = statistics.median(times)
    moved = args.world * (args.world - 1) * (args.mb << 20)
    print(f"{args.world} ranks, {args.mb} MiB from each to each other: median {median:.3f} s "
          f"(min {min(times):.3f}, max {max(times):.3f}), {moved / median / 1e6:.0f} MB/s received in all")


if __name__ == "__main__":
    main()
