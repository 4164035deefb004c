"""Save and load CUDA tensors: time and host memory, tsckpt against DCP's FileSystemWriter.

One process (a gloo group of one) holds the ``untuned`` workload's weights and
one moment as plain tensors on the GPU: a 50257-row vocabulary, GQA
projections, 1-D norms and biases, 0-d steps. Each repetition saves and then
loads it back into zeroed GPU tensors with every contender, in rotating order,
and reports for each:

* median seconds of save and load, and DCP time / tsckpt time;
* the largest resident host memory above the start of the call (``VmHWM``
  after resetting it), against the state's bytes and its largest tensor. A
  bounded writer or reader stays near its copy-ahead window plus one tensor,
  whatever the state's size.

Each save and each load runs in a fresh process, so memory one contender
freed but the allocator kept cannot hide another's peak. Each loaded tensor is
compared bit for bit with what was saved. The checkpoint's files are evicted
from the page cache before every load.

    python -m benchmarks cuda --size-gb 8 --reps 3
    python -m benchmarks cuda --windows 0,268435456,none   # tsckpt's copy-ahead window
    python -m benchmarks cuda --device cpu --size-gb 0.01 --reps 1   # checks the script, no GPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import contenders as cont  # noqa: E402
from dcp_ranks import _status_kb, rotated  # noqa: E402
from harness import environment, evict, free_port, loadavg, table  # noqa: E402
from workloads import Untuned, total_bytes  # noqa: E402


def state_dict(w: Untuned, fill: bool, device: str) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(0)
    out: dict[str, Any] = {}
    for name, shape in w.params().items():
        for suffix in ("", *(f".{m}" for m in w.moments)):
            t = torch.empty(shape, dtype=torch.bfloat16, device=device)
            if fill:
                t.copy_(torch.randn(shape, generator=gen, device=device))
            else:
                t.zero_()
            out[name + suffix] = t
        out[name + ".step"] = torch.tensor(1000.0, device=device)
    return out


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def window_contender(layout: str, window: int | None) -> cont.Contender:
    """``dcp.save``/``dcp.load`` with tsckpt's writer and reader and a copy-ahead window of ``window`` bytes."""
    from tsckpt import TensorStoreReader, TensorStoreWriter

    options = cont.layout_options(layout) or {}

    def save(sd: dict[str, Any], path: str) -> None:
        dcp.save(sd, storage_writer=TensorStoreWriter(path, per_thread_copy_ahead=window, **options))

    def load(sd: dict[str, Any], path: str) -> None:
        dcp.load(sd, storage_reader=TensorStoreReader(path, per_thread_copy_ahead=window))

    label = "none" if window is None else f"{window >> 20}MiB"
    return cont.Contender(f"tsckpt-dcp/{layout}[window={label}]", save, load)


def measured(fn: Any) -> tuple[float, int, bool]:
    """Seconds of ``fn`` (GPU work synchronised), its peak resident bytes above the start, and whether the
    peak was reset first.

    Where the kernel refuses to reset ``VmHWM`` (some sandboxes), the peak is the process's since it
    started, less its resident memory before the call: the state lives on the GPU, so before the call
    the process holds little more than its libraries, and the call's own peak still dominates.
    """
    synchronize()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM
        reset = True
    except OSError:
        reset = False
    before = _status_kb("VmRSS")
    t0 = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - t0, (_status_kb("VmHWM") - before) * 1024, reset


def same(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return [k for k, v in a.items() if isinstance(v, torch.Tensor) and not torch.equal(v, b[k])]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=8.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--root", default=None, help="where checkpoints go (a temporary directory by default)")
    ap.add_argument("--layouts", default="plain,packed")
    ap.add_argument("--windows", default="", help="comma-separated copy-ahead windows in bytes ('none' for "
                    "unbounded), each run as an extra tsckpt contender on the first layout")
    ap.add_argument("--only", default="", help="comma-separated contender names to run (DCP's default always runs)")
    ap.add_argument("--json", default=None, help="also write the samples here")
    ap.add_argument("--device", default="cuda", help="where the state lives ('cpu' checks the script without a GPU)")
    ap.add_argument("--child", nargs=3, metavar=("OP", "NAME", "PATH"), help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def everyone(args: argparse.Namespace) -> dict[str, cont.Contender]:
    layouts, _ = cont.supported_layouts(args.layouts.split(","))
    out = [cont.dcp_contender(1), cont.dcp_contender(4)]
    out += [c for lay in layouts for c in (cont.tsckpt_via_dcp(lay), cont.tsckpt_api(lay))]
    for text in filter(None, args.windows.split(",")):
        out.append(window_contender(layouts[0], None if text == "none" else int(text)))
    return {c.name: c for c in out}


def child(args: argparse.Namespace) -> None:
    """One save or load in a fresh process, so no contender's freed memory hides another's peak."""
    op, name, path = args.child
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    c = everyone(args)[name]
    w = Untuned.for_size(args.size_gb * 1e9, 2)
    src = state_dict(w, fill=True, device=args.device)
    if op == "save":
        seconds, peak, reset = measured(lambda: c.save(src, path))
        bad = []
    else:
        dst = state_dict(w, fill=False, device=args.device)
        seconds, peak, reset = measured(lambda: c.load(dst, path))
        bad = same(src, dst)
    print(json.dumps({"seconds": seconds, "peak": peak, "reset": reset, "bad": bad[:3], "nbad": len(bad)}))
    dist.destroy_process_group()


def run_child(args: argparse.Namespace, op: str, name: str, path: str) -> dict[str, Any]:
    argv = [sys.executable, os.path.abspath(__file__), "--size-gb", str(args.size_gb), "--layouts", args.layouts,
            "--windows", args.windows, "--device", args.device, "--child", op, name, path]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    if got["nbad"]:
        raise SystemExit(f"{name}: {got['nbad']} tensors differ after the load, e.g. {got['bad']}")
    return got


def main() -> None:
    args = parse_args()
    if args.child:
        return child(args)
    env = environment("python -m benchmarks cuda", sys.argv[1:])
    names = [n for n in everyone(args) if not args.only or n == "dcp-t1" or n in args.only.split(",")]
    w = Untuned.for_size(args.size_gb * 1e9, 2)
    nbytes = total_bytes(w, 2)
    largest = max(math.prod(s) for s in w.params().values()) * 2
    root = args.root or tempfile.mkdtemp(prefix="bench-cuda-")
    where = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"{where}, torch {torch.__version__}; {w.describe()}; "
          f"{nbytes / 1e9:.2f} GB bf16, largest tensor {largest / 1e6:.0f} MB; "
          "each save and load in a fresh process", flush=True)
    samples: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    for rep in range(args.reps):
        for name in rotated(names, rep):
            path = os.path.join(root, name.replace("/", "-"))
            saved = run_child(args, "save", name, path)
            how = evict(path)
            loaded = run_child(args, "load", name, path)
            shutil.rmtree(path)
            for k, v in (("save", saved["seconds"]), ("load", loaded["seconds"]),
                         ("save_mem", saved["peak"]), ("load_mem", loaded["peak"])):
                samples[name].setdefault(k, []).append(v)
            note = "" if saved["reset"] and loaded["reset"] else "; peak not reset, counted from process start"
            print(f"rep {rep} {name}: save {saved['seconds']:.2f} s (+{saved['peak'] / 1e9:.2f} GB host), "
                  f"load {loaded['seconds']:.2f} s (+{loaded['peak'] / 1e9:.2f} GB host; cache {how}{note})",
                  flush=True)
    dcp_s = {k: statistics.median(samples["dcp-t1"][k]) for k in ("save", "load")}

    def seconds(xs: list[float]) -> str:
        return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"

    rows = []
    for name, s in samples.items():
        med = {k: statistics.median(v) for k, v in s.items()}
        rows.append([name, seconds(s["save"]), f"{nbytes / 1e9 / med['save']:.2f}",
                     f"{dcp_s['save'] / med['save']:.2f}",
                     f"{med['save_mem'] / 1e9:.2f}", seconds(s["load"]), f"{nbytes / 1e9 / med['load']:.2f}",
                     f"{dcp_s['load'] / med['load']:.2f}", f"{med['load_mem'] / 1e9:.2f}"])
    print(f"\nmedians of {args.reps} (range in brackets); state {nbytes / 1e9:.2f} GB, largest tensor "
          f"{largest / 1e9:.2f} GB")
    print(table(["contender", "save s", "save GB/s", "save x DCP", "save peak host GB", "load s", "load GB/s",
                 "load x DCP", "load peak host GB"], rows, "lrrrrrrrr"))
    if args.json:
        env["load_after"] = loadavg()
        env["machine"] += f", {where}"
        with open(args.json, "w") as f:
            json.dump({"env": env, "describe": f"{nbytes / 1e9:.2f} GB bf16 on {where}", "state_bytes": nbytes,
                       "largest_tensor_bytes": largest, "samples": samples}, f)


if __name__ == "__main__":
    main()
