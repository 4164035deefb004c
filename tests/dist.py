"""Start real gloo ranks on CPU, for tests, benchmarks and tools: the one rank spawner.

``run_ranks(world_size, fn, *args)`` starts ``world_size`` processes, each of
which joins a gloo process group on loopback and calls ``fn(rank, world_size,
*args)``. ``fn`` must be a module-level function (it is pickled by reference).
Return values come back as a list indexed by rank; an exception in any rank,
or a rank that dies (a SIGKILL included), fails the call with every rank's
traceback.

Ranks are forked from a forkserver that imported torch, tsckpt and the test
helpers once per run: each rank is a fresh process (nothing of the caller's
state, its own pid to kill), but does not pay for those imports again. Spawning
instead costs seconds per rank on a busy two-core machine.

What differs from ``spawn``, and how it is made up for:

* the forkserver keeps the environment it started with, so each rank takes the
  caller's ``os.environ`` as it is at the call (a fixture's credentials, a
  monkeypatched ``TSCKPT_LAYOUT``);
* a forked rank leaves by ``os._exit`` without interpreter finalization, so the
  ``atexit`` hooks a spawned rank would run (tsckpt frees its TensorStore
  objects there) are run at the end of each rank explicitly.

What a forked rank cannot show is a crash during interpreter finalization.
``whole_interpreters=True`` spawns each rank as a new interpreter that exits
normally, as the packed reshard of test_distributed.py and
``tools/loop_packed_reshard.py`` do; ``tsckpt demo`` (test_demo.py) spawns its
own ranks that way too.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import io
import os
import socket
import time
import traceback
import warnings
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from tsckpt.main_job import stop_hung

#: Imported once by the forkserver, before it forks any rank. Names that do not import are skipped.
#: torch._dynamo (200-odd modules, about 2 s) is otherwise imported by each rank the first time it
#: builds a device mesh or a DTensor.
PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.tensor", "torch._dynamo", "numpy",
           "tensorstore", "zarr", "tsckpt", "tsckpt.dcp.api", "pytest", "dist", "zoo"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, environ: dict[str, str], forked: bool, fn: Callable[..., Any],
           args: tuple, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    faulthandler.enable()  # a rank that aborts, or is stopped with SIGABRT as hung, prints every thread's stack
    if forked:
        # What the forkserver imported is shared with it page by page until written: a garbage collection that
        # walked those objects would copy them all into this rank (seconds, at the atexit hooks' collections).
        gc.freeze()
    os.environ.clear()
    os.environ.update(environ)
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
        if forked:
            atexit._run_exitfuncs()


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float | None = 300,
              whole_interpreters: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; their return values, by rank.

    Fails with an AssertionError holding every failing rank's traceback, or if
    the ranks have not all finished within ``timeout`` seconds (None: no limit),
    in which case they are killed. ``whole_interpreters``: spawn each rank as a
    new interpreter that finalizes at exit, instead of forking it (module docstring).
    """
    method = "spawn" if whole_interpreters else "forkserver"
    ctx = mp.get_context(method)
    if not whole_interpreters:
        ctx.set_forkserver_preload(PRELOAD)  # only the first call of a run starts the server
    queue = ctx.SimpleQueue()
    procs = mp.start_processes(
        _entry, args=(world_size, free_port(), dict(os.environ), not whole_interpreters, fn, args, queue),
        nprocs=world_size, join=False, start_method=method,
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

    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            drain()
            if procs.join(timeout=0.2):
                break
            if deadline is not None and time.monotonic() > deadline:
                stop_hung(procs.processes)
                raise AssertionError(f"ranks did not finish within {timeout}s (their stacks are on stderr); "
                                     f"ranks that had returned: {sorted(results)}")
    except Exception as e:
        drain()
        finished = f" (ranks {sorted(results)} had returned their results)" if results else ""
        raise AssertionError("\n".join(errors) or f"{e}{finished}") from None
    drain()
    return [results.get(r) for r in range(world_size)]
