"""How fast ``tsckpt.open`` is on many tensors, and what a slice read saves over a full read.

Builds (once, in a temporary directory) a single-process checkpoint with
``--small`` tiny tensors plus one large float32 matrix, then times:

* ``tsckpt.open`` (reads the root metadata only) and listing every key,
* reading every small tensor's shape/dtype/placement (metadata, no I/O),
* a slice of ``--slice-rows`` rows of the large tensor vs the whole tensor,
  each through a fresh handle (the array is opened again; no TensorStore cache),
  so the figures are read costs; the OS page cache is warm.

Prints a markdown table. Usage::

    python -m benchmarks open [--small 2000] [--rows 4096] [--cols 4096] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import table  # noqa: E402  (puts this checkout's tsckpt first on the path)


def _best(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def build(path: str, small: int, rows: int, cols: int, inner_chunk_bytes: int) -> None:
    import torch

    import tsckpt

    warnings.simplefilter("ignore")
    sd: dict[str, Any] = {"layers": {f"{i}": {"w": torch.randn(8, 8), "b": torch.zeros(8)} for i in range(small // 2)}}
    sd["big"] = torch.randn(rows, cols)
    sd["step"] = 10
    tsckpt.save(sd, path, inner_chunk_bytes=inner_chunk_bytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", type=int, default=2000, help="number of small tensors")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--slice-rows", type=int, default=128)
    ap.add_argument("--inner-chunk-bytes", type=int, default=1 << 20, help="inner chunk size of the large tensor")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--path", default="", help="reuse/keep a checkpoint here instead of a temporary one")
    args = ap.parse_args()

    import tsckpt

    tmp = None if args.path else tempfile.mkdtemp(prefix="tsckpt-bench-")
    path = args.path or f"{tmp}/ckpt"
    try:
        try:
            tsckpt.open(path)
        except tsckpt.TsckptError:
            t0 = time.perf_counter()
            build(path, args.small, args.rows, args.cols, args.inner_chunk_bytes)
            print(f"built {path} in {time.perf_counter() - t0:.1f} s")

        ck = tsckpt.open(path)
        big = ck["big"]
        n_tensors = len(ck.tensors)

        def open_and_list() -> None:
            c = tsckpt.open(path)
            list(c)

        def metadata_of_all() -> None:
            c = tsckpt.open(path)
            for h in c.tensors.values():
                _ = (h.shape, h.zarr_dtype, h.placements, h.chunks)

        from tsckpt.read.checkpoint import TensorHandle

        def fresh_big() -> TensorHandle:
            # A new handle opens the array again (its zarr.json), like a first access after open.
            return TensorHandle(ck, "big", ck.metadata.tensors["big"])

        def slice_read() -> None:
            fresh_big().numpy(slice=(slice(0, args.slice_rows),))

        def full_read() -> None:
            fresh_big().numpy()

        def load_everything() -> None:
            tsckpt.open(path).to_state_dict()

        t_open = _best(open_and_list, args.repeat)
        t_meta = _best(metadata_of_all, args.repeat)
        t_slice = _best(slice_read, args.repeat)
        t_full = _best(full_read, args.repeat)
        t_all = _best(load_everything, max(1, args.repeat // 2))

        mb = big.nbytes / 2**20
        frac = args.slice_rows / big.shape[0]
        print()
        print(f"checkpoint: {n_tensors} tensors; large tensor {list(big.shape)} float32 ({mb:.0f} MiB), "
              f"chunks {list(big.chunks.chunk_shape)}, inner {list(big.chunks.inner_chunk_shape or [])}; "
              f"median of {args.repeat}")
        print()
        print(table(["operation", "seconds", "ratio"], [
            [f"`tsckpt.open` + list {n_tensors} keys", f"{t_open:.4f}", ""],
            [f"open + shape/dtype/placement/chunks of all {n_tensors}", f"{t_meta:.4f}", ""],
            [f"slice of {args.slice_rows} rows ({frac:.1%}) of the large tensor", f"{t_slice:.4f}",
             f"{t_slice / t_full:.3f} of full"],
            [f"whole large tensor ({mb:.0f} MiB)", f"{t_full:.4f}", "1.000"],
            ["open + `to_state_dict()` (everything)", f"{t_all:.4f}", f"{t_all / t_full:.2f} of full"],
        ], "lrr"))
        print()
        print(f"slice read is {t_full / t_slice:.1f}x faster than reading the whole tensor")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
