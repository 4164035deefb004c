"""Spawn real gloo ranks on CPU for multi-process tests.

``run_ranks(world_size, fn, *args)`` starts ``world_size`` processes, each of
which joins a gloo process group on loopback and calls ``fn(rank, world_size,
*args)``. ``fn`` must be a module-level function (it is pickled by reference).
Return values come back as a list indexed by rank; an exception in any rank
fails the call with that rank's traceback.

``start_method="forkserver"`` forks ranks from a server process that imported
torch and tsckpt once, so a test that starts many groups pays that import once
rather than per rank. The server keeps the environment it started with.
"""

from __future__ import annotations

import io
import os
import socket
import time
import traceback
import warnings
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        # Tensors would travel as shared-memory handles that die with this process: send bytes.
        buf = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 300,
              start_method: str = "spawn") -> list[Any]:
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "tsckpt.dcp.api", "dist"])
    queue = ctx.SimpleQueue()
    procs = mp.start_processes(
        _entry, args=(world_size, free_port(), fn, args, queue), nprocs=world_size, join=False,
        start_method=start_method,
    )
    results: dict[int, Any] = {}
    errors: list[str] = []

    def drain() -> None:
        while not queue.empty():
            rank, status, value = queue.get()
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(value), weights_only=True)
            else:
                errors.append(f"--- rank {rank} ---\n{value}")

    deadline = time.monotonic() + timeout
    try:
        while True:
            drain()
            if procs.join(timeout=0.2):
                break
            if time.monotonic() > deadline:
                for p in procs.processes:
                    p.kill()
                raise AssertionError(f"ranks did not finish within {timeout}s")
    except Exception as e:
        drain()
        raise AssertionError("\n".join(errors) or str(e)) from None
    drain()
    return [results.get(r) for r in range(world_size)]
