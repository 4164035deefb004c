"""Rank-side work of ``bench_dcp.py``: timing helpers and the timed save and load phases.

Each phase runs in spawned gloo CPU ranks; rank 0 writes its figures to a
JSON file that the parent process reads. Times are wall-clock between two
barriers, so they are the slowest rank's. Every repetition rotates which
contender goes first.
"""

from __future__ import annotations

import json
import os
import socket
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

import contenders as cont
import workloads as wl


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


def drop_page_cache() -> bool:
    """Drop the whole page cache (needs root); False where this machine does not allow it."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def evict(path: str) -> str:
    """Take ``path``'s files out of the page cache; returns how."""
    if drop_page_cache():
        return "drop_caches"
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(phase: Any, world: int, cfg: dict[str, Any], tmp: str) -> dict[str, Any]:
    """Run ``phase(rank, world, port, cfg, out)`` in ``world`` spawned ranks; returns rank 0's result."""
    out = os.path.join(tmp, f"{phase.__module__}.{phase.__name__}.json")
    mp.start_processes(phase, args=(world, free_port(), cfg, out), nprocs=world, start_method="spawn")
    with open(out) as f:
        return json.load(f)


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
    return os.path.join(root, name.replace("/", "-"), f"rep{rep}")


def write_result(out: str, result: dict[str, Any]) -> None:
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def rotated(items: list[Any], rep: int) -> list[Any]:
    """``items`` starting at position ``rep`` (mod length): who goes first changes every repetition."""
    k = rep % len(items) if items else 0
    return items[k:] + items[:k]


def _add(times: dict[str, dict[str, list[float]]], name: str, figure: str, seconds: float) -> None:
    times.setdefault(name, {}).setdefault(figure, []).append(seconds)


def _state(cfg: dict[str, Any], mesh: Any, column: bool, fill: bool) -> dict[str, Any]:
    return wl.build_state_dict(wl.from_dict(cfg["workload"]), wl.DTYPES[cfg["dtype"]], mesh, column, fill)


# --- phases -------------------------------------------------------------------

def save_phase(rank: int, world: int, port: int, cfg: dict[str, Any], out: str) -> None:
    """Save with every contender and load back into the same topology; with ``extras``, async saves too."""
    mesh = setup(rank, world, port)
    sd = _state(cfg, mesh, column=False, fill=True)
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
            dest = _state(cfg, mesh, column=False, fill=False)
            if rank == 0:
                how = evict(path)
                files[c.name] = count_files(path)
            _add(times, c.name, "load", timed(lambda: c.load(dest, path)))
            if c is not cont.RAW and rep == 0 and wl.checksums(dest) != expected:
                raise AssertionError(f"{c.name}: loaded state dict differs from the saved one")
            del dest
        if cfg["extras"]:
            _async_saves(cfg, sd, everyone, rep, times)
    local = torch.tensor([wl.local_bytes(sd)], dtype=torch.int64)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    write_result(out, {"times": times, "memory": memory, "files": files, "evict": how,
                       "local_bytes": int(local), "checksums": expected})
    dist.destroy_process_group()


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


def reshard_phase(rank: int, world: int, port: int, cfg: dict[str, Any], out: str) -> None:
    """Load each contender's last row-sharded checkpoint column-sharded into ``world`` ranks."""
    mesh = setup(rank, world, port)
    everyone = cont.contenders(cfg, raw=False)
    dest = _state(cfg, mesh, column=True, fill=False)
    times: dict[str, dict[str, list[float]]] = {}
    for rep in range(cfg["reps"]):
        for c in rotated(everyone, rep):
            path = checkpoint_path(cfg["root"], c.name, cfg["reps"] - 1)
            if rank == 0:
                evict(path)
            _add(times, c.name, cfg["figure"], timed(lambda: c.load(dest, path)))
            if rep == 0 and wl.checksums(dest) != cfg["checksums"]:
                raise AssertionError(f"{c.name}: resharded state dict differs from the saved one")
    write_result(out, {"times": times})
    dist.destroy_process_group()
