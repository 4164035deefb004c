"""Conversion throughput: safetensors -> tsckpt and tsckpt -> safetensors.

Writes a bf16 safetensors file of about ``--size-mb`` MB (tensors of ``--tensor-mb``),
converts it to tsckpt and back, and reports MB/s next to the time it takes
just to read the source's bytes (the reference: a conversion cannot beat
reading its input) and the disk's plain write+fsync speed (what it must also
pay to write its output). Page caches are not dropped, so on a machine with
enough RAM both are warm-cache figures; run it on an idle machine.

    python -m benchmarks convert --size-mb 500
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import table  # noqa: E402  (puts this checkout's tsckpt first on the path)

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tsckpt import convert, diff  # noqa: E402


def raw_read_seconds(path: str) -> float:
    """Seconds to read every file under ``path`` into one reused buffer."""
    files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    buf = bytearray(64 << 20)
    start = time.perf_counter()
    for name in files:
        with open(name, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - start


def raw_write_seconds(path: str, nbytes: int) -> float:
    """Seconds to write and fsync ``nbytes`` to one new file: the disk's own write speed."""
    block = os.urandom(16 << 20)
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(block[:left])
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    os.remove(path)
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=500)
    ap.add_argument("--tensor-mb", type=float, default=16)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a new temporary one)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(dir=args.dir, prefix="bench_convert_")
    try:
        cols = 2048
        rows = max(1, int(args.tensor_mb * 1e6 / (cols * 2)))
        n = max(1, round(args.size_mb / args.tensor_mb))
        g = torch.Generator().manual_seed(0)
        src = os.path.join(root, "model.safetensors")
        save_file({f"layers.{i}.weight": torch.randn(rows, cols, generator=g).bfloat16() for i in range(n)}, src)
        mb = os.path.getsize(src) / 1e6

        rows_out = []
        ts_dir, back = os.path.join(root, "ts"), os.path.join(root, "back.safetensors")
        for label, a, b in (("safetensors -> tsckpt", src, ts_dir), ("tsckpt -> safetensors", ts_dir, back)):
            raw = raw_read_seconds(a)
            write = raw_write_seconds(os.path.join(root, "raw.bin"), int(mb * 1e6))
            result = convert(a, b)
            rows_out.append({"conversion": label, "MB": round(mb, 1), "seconds": round(result.seconds, 3),
                             "MB/s": round(mb / result.seconds), "raw_read_s": round(raw, 3),
                             "raw_read_MB/s": round(mb / raw), "time_vs_raw_read": round(result.seconds / raw, 2),
                             "raw_write_MB/s": round(mb / write)})
        assert diff(src, back).identical, "round trip changed the data"
        keys = ["conversion", "MB", "seconds", "MB/s", "raw_read_MB/s", "time_vs_raw_read", "raw_write_MB/s"]
        print(table(["conversion", "MB", "s", "MB/s", "raw read MB/s", "x raw read", "raw write MB/s"],
                    [[r[k] for k in keys] for r in rows_out], "lrrrrrr"))
        print(json.dumps(rows_out))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
