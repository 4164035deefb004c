"""Rank-side work of ``bench_dcp.py``: timing helpers and the timed save and load phases.

Each phase runs on gloo CPU ranks started by ``harness.run_ranks`` and returns
its figures from rank 0. Times are wall-clock between two barriers, so they
are the slowest rank's. Every repetition rotates which contender goes first.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import contenders as cont
import workloads as wl
from harness import evict


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


def count_files(path: str) -> int:
    return sum(len(files) for _, _, files in os.walk(path))


def mesh(world: int) -> Any:
    """The 1-D CPU mesh over every rank of the group ``harness.run_ranks`` set up."""
    return init_device_mesh("cpu", (world,))


def checkpoint_path(root: str, name: str, rep: int) -> str:
    # A new directory per repetition, deleted only at the end of the run, as
    # training saves step_N directories: deleting thousands of inodes right
    # before creating thousands more makes ext4's inode allocator scan.
    return os.path.join(root, name.replace("/", "-"), f"rep{rep}")


def rank0(result: dict[str, Any]) -> dict[str, Any] | None:
    """What a phase returns: its figures from rank 0 (every rank holds the same ones after its reductions)."""
    return result if dist.get_rank() == 0 else None


def rotated(items: list[Any], rep: int) -> list[Any]:
    """``items`` starting at position ``rep`` (mod length): who goes first changes every repetition."""
    k = rep % len(items) if items else 0
    return items[k:] + items[:k]


def _add(times: dict[str, dict[str, list[float]]], name: str, figure: str, seconds: float) -> None:
    times.setdefault(name, {}).setdefault(figure, []).append(seconds)


def _state(cfg: dict[str, Any], mesh: Any, column: bool, fill: bool) -> dict[str, Any]:
    return wl.build_state_dict(wl.from_dict(cfg["workload"]), wl.DTYPES[cfg["dtype"]], mesh, column, fill)


# --- phases -------------------------------------------------------------------

def save_phase(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """Save with every contender and load back into the same topology; with ``extras``, async saves too."""
    devices = mesh(world)
    sd = _state(cfg, devices, column=False, fill=True)
    expected = wl.checksums(sd)
    everyone = cont.contenders(cfg, raw=cfg["raw"])
    times: dict[str, dict[str, list[float]]] = {}
    memory: dict[str, int] = {}
    files: dict[str, int] = {}
    how = ""
    for rep in range(cfg["reps"]):
        # Rotate who goes first: on a VM disk the first writer after a pause
        # gets the host's write cache to itself.
        for c in rotated(everyone, rep):
            path = checkpoint_path(cfg["root"], c.name, rep)
            settle(cfg["settle"])
            seconds, extra = peak_extra_bytes(lambda: c.save(sd, path))
            _add(times, c.name, "save", seconds)
            memory[c.name] = max(memory.get(c.name, 0), extra)
            dest = _state(cfg, devices, column=False, fill=False)
            if rank == 0:
                how = evict(path)
                files[c.name] = count_files(path)
            _add(times, c.name, "load", timed(lambda: c.load(dest, path)))
            if c is not cont.RAW and rep == 0 and wl.checksums(dest) != expected:
                raise AssertionError(f"{c.name}: loaded state dict differs from the saved one")
            dest = None  # free it before the next save
        if cfg["extras"]:
            _async_saves(cfg, sd, everyone, rep, times)
    local = torch.tensor([wl.local_bytes(sd)], dtype=torch.int64)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return rank0({"times": times, "memory": memory, "files": files, "evict": how,
                  "local_bytes": int(local), "checksums": expected})


def _async_saves(cfg: dict[str, Any], sd: dict[str, Any], everyone: list[cont.Contender], rep: int,
                 times: dict[str, dict[str, list[float]]]) -> None:
    """``async_save`` of DCP's default and of tsckpt.async_save: time blocked and time until durable."""
    for c in rotated([c for c in everyone if c.async_save is not None], rep):
        path = checkpoint_path(cfg["root"], c.name + "-async", rep)
        settle(cfg["settle"])
        t0 = time.perf_counter()
        fut = c.async_save(sd, path)
        blocked = torch.tensor([time.perf_counter() - t0])
        fut.result()
        dist.barrier()
        total = time.perf_counter() - t0
        dist.all_reduce(blocked, op=dist.ReduceOp.MAX)
        _add(times, c.name, "async_block", float(blocked))
        _add(times, c.name, "async_total", total)
    _add(times, "staging copy", "copy", timed(lambda: [t.clone() for t in wl.local_tensors(sd)]))


def first_phase(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """A job's first save and load: one contender, in a process group (and processes) started for it alone.

    Nothing was imported, planned or cached before: what the first checkpoint
    of a training job costs. The save and the load are timed between barriers
    as in :func:`save_phase`, the page cache dropped before the load.
    """
    devices = mesh(world)
    sd = _state(cfg, devices, column=False, fill=True)
    (c,) = [c for c in cont.contenders(cfg, raw=True) if c.name == cfg["contender"]]
    path = checkpoint_path(cfg["root"], c.name + "-first", cfg["rep"])
    settle(cfg["settle"])
    times: dict[str, dict[str, list[float]]] = {}
    _add(times, c.name, "first_save", timed(lambda: c.save(sd, path)))
    dest = _state(cfg, devices, column=False, fill=False)
    if rank == 0:
        evict(path)
    _add(times, c.name, "first_load", timed(lambda: c.load(dest, path)))
    return rank0({"times": times})


def reshard_phase(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """Load each contender's last row-sharded checkpoint column-sharded into ``world`` ranks (those that reshard)."""
    everyone = [c for c in cont.contenders(cfg, raw=False) if c.reshards]
    dest = _state(cfg, mesh(world), column=True, fill=False)
    times: dict[str, dict[str, list[float]]] = {}
    for rep in range(cfg["reps"]):
        for c in rotated(everyone, rep):
            path = checkpoint_path(cfg["root"], c.name, cfg["reps"] - 1)
            if rank == 0:
                evict(path)
            _add(times, c.name, cfg["figure"], timed(lambda: c.load(dest, path)))
            if rep == 0 and wl.checksums(dest) != cfg["checksums"]:
                raise AssertionError(f"{c.name}: resharded state dict differs from the saved one")
    return rank0({"times": times})
