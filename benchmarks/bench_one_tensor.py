"""What reading one tensor of a checkpoint of many tensors reads beyond its root document.

Saves (once, in a temporary directory) ``--tensors`` tensors of [16, 8] float32 in one process, then,
in this process with tsckpt's modules already imported, opens the checkpoint and reads one tensor
whole through ``tsckpt.open``, counting the bytes the process read (``rchar`` of ``/proc/self/io``,
page-cache hits included) beyond the root document and the tensor's own bytes. Prints one line.

    python -m benchmarks one-tensor --tensors 30000
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch

import tsckpt


def rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=30000)
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="bench-one-tensor-")
    try:
        path = os.path.join(base, "ck")
        tsckpt.save({f"layers.{i}.w": torch.randn(16, 8) for i in range(args.tensors)}, path)
        with tsckpt.open(path) as ck:  # every module it uses imported, so rchar counts the checkpoint only
            ck["layers.0.w"][:]
        root = os.path.getsize(os.path.join(path, "zarr.json"))
        start, t = rchar(), time.perf_counter()
        with tsckpt.open(path) as ck:
            value = ck[f"layers.{args.tensors // 2}.w"][:]
        read, seconds = rchar() - start, time.perf_counter() - t
        print(f"{args.tensors} tensors: root document {root / 1e3:.0f} KB; read beyond it and the tensor's "
              f"{value.numel() * 4} bytes: {(read - root - value.numel() * 4) / 1e3:.1f} KB; {seconds:.2f} s")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
