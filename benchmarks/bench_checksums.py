"""What the default chunk checksums cost: tsckpt saves and loads with and without them, side by side.

One process (no process group), a state dict of ``--size-mb`` in bf16 and fp32
tensors of mixed shapes (a vocabulary not divisible by anything handy, square
matrices, 1-D norms), saved with ``tsckpt.save`` to a fresh directory per run and
loaded back with ``tsckpt.load``. The two variants alternate, which goes first
alternating each repetition; the checkpoint's files are evicted from the page
cache before each load. Medians, and the ratio with/without, as a markdown table.

    python benchmarks/bench_checksums.py                 # 512 MB, 7 repetitions
    python benchmarks/bench_checksums.py --target memory # no disk: the CPU cost alone
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import evict, table  # noqa: E402  (puts this checkout's tsckpt first on the path)

import torch  # noqa: E402

import tsckpt  # noqa: E402


def state_dict(size_mb: int) -> dict:
    """A quarter of the bytes in a bf16 embedding of 50257 rows, the rest in six fp32 matrices and 1-D norms."""
    g = torch.Generator().manual_seed(0)
    total = size_mb << 20
    sd = {"embed": torch.randn(50257, max(8, total // 4 // (50257 * 2)), generator=g).bfloat16()}
    cols = max(8, total * 3 // 4 // 6 // (1000 * 4))
    for i in range(6):
        sd[f"layers.{i}.w"] = torch.randn(1000, cols, generator=g)
        sd[f"layers.{i}.norm"] = torch.randn(4099, generator=g)
    return sd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=512)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--target", choices=["disk", "memory"], default="disk")
    args = ap.parse_args()
    sd = state_dict(args.size_mb)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    base = tempfile.mkdtemp(prefix="tsckpt-crc-")
    times: dict[str, dict[str, list[float]]] = {v: {"save": [], "load": []} for v in ("on", "off")}
    try:
        tsckpt.save(sd, os.path.join(base, "warm-up"))  # imports and first-use costs, not timed
        shutil.rmtree(os.path.join(base, "warm-up"))
        for rep in range(args.reps):
            order = ("on", "off") if rep % 2 == 0 else ("off", "on")
            for variant in order:
                path = (os.path.join(base, f"{variant}-{rep}") if args.target == "disk"
                        else f"memory://crc-{variant}-{rep}")
                t = time.perf_counter()
                tsckpt.save(sd, path, checksums=variant == "on")
                times[variant]["save"].append(time.perf_counter() - t)
                back = {k: torch.empty_like(v) for k, v in sd.items()}
                if args.target == "disk":
                    evict(path)
                t = time.perf_counter()
                tsckpt.load(back, path)
                times[variant]["load"].append(time.perf_counter() - t)
                if args.target == "disk":
                    shutil.rmtree(path)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"{nbytes / 1e6:.0f} MB, {len(sd)} tensors, target {args.target}, {args.reps} repetitions (medians):\n")
    rows = []
    for op in ("save", "load"):
        on, off = (statistics.median(times[v][op]) for v in ("on", "off"))
        rows.append([op, f"{on:.3f}", f"{off:.3f}", f"{100 * (on / off - 1):+.1f}%",
                     " ".join(f"{x:.3f}" for x in times["on"][op]), " ".join(f"{x:.3f}" for x in times["off"][op])])
    print(table(["operation", "checksums on, s", "off, s", "on costs", "samples on, s", "samples off, s"], rows, "lrrr"))


if __name__ == "__main__":
    main()
