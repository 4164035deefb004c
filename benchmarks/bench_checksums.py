"""What the default chunk checksums cost: tsckpt saves and loads with and without them, side by side.

One process (no process group), a state dict of ``--size-mb`` in bf16 and fp32
tensors of mixed shapes (a vocabulary not divisible by anything handy, square
matrices, 1-D norms), saved with ``tsckpt.save`` to a fresh directory per run and
loaded back with ``tsckpt.load``. The two variants alternate, which goes first
alternating each repetition; the checkpoint's files are evicted from the page
cache before each load. Medians, and the ratio with/without, as a markdown table.

Checksums on means a crc32c and an XXH3-128 content hash per chunk
(``tsckpt/format/content_hashes.py``). A third variant, ``no-hash``, keeps the
crc32c and replaces the content hash by a constant in this process, so the
hash's own share of a full save shows (issue 22 allows it at most 5%).

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
from tsckpt.format import checksums, content_hashes  # noqa: E402


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


def crc_alone(data) -> tuple[int, bytes]:
    """What a save computed per chunk before content hashes: the crc32c alone (and a constant digest)."""
    return checksums.crc32c(data), bytes(16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=512)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--target", choices=["disk", "memory"], default="disk")
    args = ap.parse_args()
    sd = state_dict(args.size_mb)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    base = tempfile.mkdtemp(prefix="tsckpt-crc-")
    variants = ("on", "no-hash", "off")
    times: dict[str, dict[str, list[float]]] = {v: {"save": [], "load": []} for v in variants}
    both = content_hashes.crc_and_digest
    try:
        tsckpt.save(sd, os.path.join(base, "warm-up"))  # imports and first-use costs, not timed
        shutil.rmtree(os.path.join(base, "warm-up"))
        for rep in range(args.reps):
            order = variants[rep % 3:] + variants[:rep % 3]
            for variant in order:
                content_hashes.crc_and_digest = both if variant != "no-hash" else crc_alone
                path = (os.path.join(base, f"{variant}-{rep}") if args.target == "disk"
                        else f"memory://crc-{variant}-{rep}")
                t = time.perf_counter()
                tsckpt.save(sd, path, checksums=variant != "off")
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
        content_hashes.crc_and_digest = both
        shutil.rmtree(base, ignore_errors=True)
    print(f"{nbytes / 1e6:.0f} MB, {len(sd)} tensors, target {args.target}, {args.reps} repetitions (medians):\n")
    rows = []
    for op in ("save", "load"):
        on, off = (statistics.median(times[v][op]) for v in ("on", "off"))
        rows.append([op, f"{on:.3f}", f"{off:.3f}", f"{100 * (on / off - 1):+.1f}%",
                     " ".join(f"{x:.3f}" for x in times["on"][op]), " ".join(f"{x:.3f}" for x in times["off"][op])])
    print(table(["operation", "checksums on, s", "off, s", "on costs", "samples on, s", "samples off, s"], rows, "lrrr"))
    on, crc_only = (statistics.median(times[v]["save"]) for v in ("on", "no-hash"))
    paired = statistics.median(a / b for a, b in zip(times["on"]["save"], times["no-hash"]["save"]))
    print(f"\nsave: the content hash costs {100 * (on / crc_only - 1):+.1f}% (medians), "
          f"{100 * (paired - 1):+.1f}% (median of per-repetition ratios)")


if __name__ == "__main__":
    main()
