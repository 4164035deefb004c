"""Rank-side work of ``bench_dcp.py``: the workload, the contenders and the timed phases.

Each phase runs in spawned gloo CPU ranks; rank 0 writes its figures to a
JSON file that the parent process reads. Times are wall-clock between two
barriers, so they are the slowest rank's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.device_mesh import init_device_mesh

import tsckpt

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# --- workload ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Shapes:
    """A decoder-only transformer: embedding, L blocks of attention + MLP + norms."""

    hidden: int
    ffn: int
    vocab: int
    layers: int

    @classmethod
    def for_size(cls, total_bytes: float, itemsize: int) -> Shapes:
        # Parameters plus two Adam moments, all of one dtype: 3 copies of the weights.
        elems = total_bytes / (3 * itemsize)
        # About 12 blocks of 12 h^2 plus a 32 h x h embedding, h a multiple of 256.
        hidden = max(256, round(math.sqrt(elems / 176) / 256) * 256)
        vocab, ffn = 32 * hidden, 4 * hidden
        per_layer = 4 * hidden * hidden + 2 * ffn * hidden + 2 * hidden
        layers = max(1, round((elems - vocab * hidden - hidden) / per_layer))
        return cls(hidden, ffn, vocab, layers)

    def params(self) -> dict[str, tuple[int, ...]]:
        h, f = self.hidden, self.ffn
        shapes: dict[str, tuple[int, ...]] = {"embed.weight": (self.vocab, h)}
        for i in range(self.layers):
            p = f"layers.{i}."
            shapes |= {p + "attn_norm.weight": (h,), p + "attn.wq": (h, h), p + "attn.wk": (h, h),
                       p + "attn.wv": (h, h), p + "attn.wo": (h, h), p + "mlp_norm.weight": (h,),
                       p + "mlp.w1": (f, h), p + "mlp.w2": (h, f)}
        return shapes | {"norm.weight": (h,)}


def _placement(shape: tuple[int, ...], column: bool) -> list[Any]:
    return [Shard(1 if column and len(shape) > 1 else 0)]


def build_state_dict(shapes: Shapes, dtype: torch.dtype, mesh: Any, column: bool, fill: bool) -> dict[str, Any]:
    """The model + AdamW state dict, row- (or column-) sharded over ``mesh``.

    With ``fill`` every shard holds seeded normal values (a different seed per
    tensor and rank), otherwise uninitialised memory as a load destination.
    """
    rank = dist.get_rank()

    def tensor(name: str, shape: tuple[int, ...]) -> DTensor:
        placement = _placement(shape, column)
        local_shape = list(shape)
        dim = placement[0].dim
        n = mesh.size()
        local_shape[dim] = shape[dim] // n
        local = torch.empty(local_shape, dtype=dtype)
        if fill:
            gen = torch.Generator().manual_seed(zlib.crc32(f"{name}@{rank}".encode()))
            local.copy_(torch.randn(local_shape, generator=gen, dtype=torch.float32))
        return DTensor.from_local(local, mesh, placement, run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())

    model, state = {}, {}
    for name, shape in shapes.params().items():
        model[name] = tensor(name, shape)
        state[name] = {"exp_avg": tensor(name + ".m", shape), "exp_avg_sq": tensor(name + ".v", shape),
                       "step": torch.tensor(1000.0)}
    groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "params": list(model)}]
    return {"model": model, "optim": {"state": state, "param_groups": groups}, "step": 1000}


def local_tensors(sd: Any) -> Iterator[torch.Tensor]:
    if isinstance(sd, dict):
        for v in sd.values():
            yield from local_tensors(v)
    elif isinstance(sd, DTensor):
        yield sd.to_local()


def checksums(sd: dict[str, Any]) -> list[int]:
    """Order-independent exact checksum per tensor: the sum of its bit patterns."""
    sums = torch.tensor([int(_bits(t).sum(dtype=torch.int64)) for t in local_tensors(sd)], dtype=torch.int64)
    dist.all_reduce(sums)
    return sums.tolist()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


# --- contenders ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Contender:
    name: str
    save: Callable[[dict[str, Any], str], None]
    load: Callable[[dict[str, Any], str], None]
    async_save: Callable[[dict[str, Any], str], Any] | None = None


def dcp_contender(threads: int) -> Contender:
    def save(sd: dict[str, Any], path: str) -> None:
        dcp.save(sd, storage_writer=FileSystemWriter(path, thread_count=threads))

    def load(sd: dict[str, Any], path: str) -> None:
        dcp.load(sd, storage_reader=FileSystemReader(path))

    def async_save(sd: dict[str, Any], path: str) -> Any:
        return dcp.async_save(sd, storage_writer=FileSystemWriter(path, thread_count=threads))

    return Contender(f"dcp-t{threads}", save, load, async_save)


def variant_name(writer_options: dict[str, Any]) -> str:
    return "tsckpt" + (f"[{','.join(f'{k}={v}' for k, v in writer_options.items())}]" if writer_options else "")


def tsckpt_contender(**writer_options: Any) -> Contender:
    def save(sd: dict[str, Any], path: str) -> None:
        tsckpt.save(sd, path, **writer_options)

    def load(sd: dict[str, Any], path: str) -> None:
        tsckpt.load(sd, path)

    def async_save(sd: dict[str, Any], path: str) -> Any:
        return tsckpt.async_save(sd, path, **writer_options)

    return Contender(variant_name(writer_options), save, load, async_save)


def _raw_save(sd: dict[str, Any], path: str) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, f"rank{dist.get_rank()}.bin"), "wb") as f:
        for t in local_tensors(sd):
            f.write(t.contiguous().view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())


def _raw_load(sd: dict[str, Any], path: str) -> None:
    np.fromfile(os.path.join(path, f"rank{dist.get_rank()}.bin"), dtype=np.uint8)


RAW = Contender("raw", _raw_save, _raw_load)


# --- measuring ----------------------------------------------------------------

def timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def peak_extra_bytes(fn: Callable[[], Any]) -> tuple[float, int]:
    """Time ``fn`` and return the largest rank's resident-memory peak above its start."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak resident set size
    before = _status_kb("VmRSS")
    seconds = timed(fn)
    extra = torch.tensor([(_status_kb("VmHWM") - before) * 1024], dtype=torch.int64)
    dist.all_reduce(extra, op=dist.ReduceOp.MAX)
    return seconds, int(extra)


def settle(seconds: float) -> None:
    """Flush everything and wait, so one contender's writeback does not bill the next."""
    if dist.get_rank() == 0:
        os.sync()
        time.sleep(seconds)
    dist.barrier()


def evict(path: str) -> str:
    """Take ``path``'s files out of the page cache; returns how."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise"


def count_files(path: str) -> int:
    return sum(len(files) for _, _, files in os.walk(path))


def setup(rank: int, world: int, port: int) -> Any:
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return init_device_mesh("cpu", (world,))


def checkpoint_path(root: str, name: str, rep: int) -> str:
    # A new directory per repetition, deleted only at the end of the run, as
    # training saves step_N directories: deleting thousands of inodes right
    # before creating thousands more makes ext4's inode allocator scan.
    return os.path.join(root, name, f"rep{rep}")


def _write_result(out: str, result: dict[str, Any]) -> None:
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)


# --- phases -------------------------------------------------------------------

def save_phase(rank: int, world: int, port: int, cfg: dict[str, Any], out: str) -> None:
    """Save with every contender, reload into the same topology; async saves; staging copy."""
    mesh = setup(rank, world, port)
    shapes, dtype = Shapes(**cfg["shapes"]), DTYPES[cfg["dtype"]]
    sd = build_state_dict(shapes, dtype, mesh, column=False, fill=True)
    expected = checksums(sd)
    variants = [tsckpt_contender(**v) for v in cfg["variants"]]
    contenders = [RAW, *(dcp_contender(t) for t in cfg["dcp_threads"]), *variants]
    times: dict[str, dict[str, list[float]]] = {c.name: {} for c in contenders}
    memory: dict[str, int] = {}
    files: dict[str, int] = {}
    how = ""
    for rep in range(cfg["reps"]):
        # Rotate who goes first: on a VM disk the first writer after a pause
        # gets the host's write cache to itself.
        for c in contenders[rep % len(contenders):] + contenders[:rep % len(contenders)]:
            path = checkpoint_path(cfg["root"], c.name, rep)
            settle(cfg["settle"])
            seconds, extra = peak_extra_bytes(lambda: c.save(sd, path))
            times[c.name].setdefault("save", []).append(seconds)
            memory[c.name] = max(memory.get(c.name, 0), extra)
            dest = build_state_dict(shapes, dtype, mesh, column=False, fill=False)
            if rank == 0:
                how = evict(path)
                files[c.name] = count_files(path)
            times[c.name].setdefault("load", []).append(timed(lambda: c.load(dest, path)))
            if c is not RAW and rep == 0 and checksums(dest) != expected:
                raise AssertionError(f"{c.name}: loaded state dict differs from the saved one")
            del dest
        for c in (contenders[1], variants[0]):  # DCP's default and tsckpt's
            path = checkpoint_path(cfg["root"], c.name + "-async", rep)
            settle(cfg["settle"])
            t0 = time.perf_counter()
            fut = c.async_save(sd, path)
            blocked = torch.tensor([time.perf_counter() - t0])
            fut.result()
            dist.barrier()
            total = time.perf_counter() - t0
            dist.all_reduce(blocked, op=dist.ReduceOp.MAX)
            times[c.name].setdefault("async_block", []).append(float(blocked))
            times[c.name].setdefault("async_total", []).append(total)
        staged = timed(lambda: [t.clone() for t in local_tensors(sd)])
        times.setdefault("staging copy", {}).setdefault("copy", []).append(staged)
    local = torch.tensor([sum(t.numel() * t.element_size() for t in local_tensors(sd))], dtype=torch.int64)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    _write_result(out, {"times": times, "memory": memory, "files": files, "evict": how,
                        "local_bytes": int(local), "checksums": expected})
    dist.destroy_process_group()


def reshard_phase(rank: int, world: int, port: int, cfg: dict[str, Any], out: str) -> None:
    """Load the row-sharded checkpoints column-sharded into ``world`` ranks."""
    mesh = setup(rank, world, port)
    shapes, dtype = Shapes(**cfg["shapes"]), DTYPES[cfg["dtype"]]
    contenders = [*(dcp_contender(t) for t in cfg["dcp_threads"]), *(tsckpt_contender(**v) for v in cfg["variants"])]
    dest = build_state_dict(shapes, dtype, mesh, column=True, fill=False)
    times: dict[str, dict[str, list[float]]] = {}
    for rep in range(cfg["reps"]):
        for c in contenders:
            path = checkpoint_path(cfg["root"], c.name, cfg["reps"] - 1)
            if rank == 0:
                evict(path)
            times.setdefault(c.name, {}).setdefault("reshard", []).append(timed(lambda: c.load(dest, path)))
            if rep == 0 and checksums(dest) != cfg["checksums"]:
                raise AssertionError(f"{c.name}: resharded state dict differs from the saved one")
    _write_result(out, {"times": times})
    dist.destroy_process_group()
