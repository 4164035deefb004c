"""The main job that ``tsckpt demo`` runs: train a small FSDP2-sharded model on CPU ranks, save it, reload it.

:func:`run` spawns ``save_ranks`` gloo processes that train a tiny transformer sharded with ``fully_shard`` a few
AdamW steps and :func:`tsckpt.save` model, optimizer, step and RNG state; then ``load_ranks`` fresh processes
(other initial weights) :func:`tsckpt.load` it. The parent compares every gathered tensor of both byte for byte,
reads one array back with zarr-python, and prints what it did.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from .dcp import api
from .dcp.torch_private import flatten_state_dict
from .errors import TsckptError
from .storage.layouts import PLAIN
from .format.metadata import TensorEntry
from .read import checkpoint
from .wording import count

SEED = 0
STEPS = 3
VOCAB = 250  # not a multiple of the rank count: FSDP2 shards the embedding unevenly
DIM = 128
HEADS = 4
LAYERS = 2
SEQ = 32
BATCH = 4
_PROBE = "model.embed.weight"  # the tensor shown in detail and read back with zarr-python


class DemoError(TsckptError):
    """A rank failed, or the reloaded state differs from the saved one."""


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.ln2 = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self.qkv(self.ln1(x)).view(b, s, 3, HEADS, DIM // HEADS).unbind(2))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, DIM))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    """Embedding, a few blocks, final norm and an untied output head (about 1.8 MB of float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _build(world: int, seed: int) -> tuple[Any, Any]:
    """The model sharded FSDP2-style over all ``world`` ranks, and its AdamW."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = TinyLM()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _full_values(state: dict[str, Any]) -> dict[str, Any]:
    """Every leaf by dotted key, DTensors gathered to full numpy arrays (collective: all ranks call it)."""
    out = {}
    for key, value in flatten_state_dict(state)[0].items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if isinstance(value, torch.Tensor):
            value = value.detach().contiguous().numpy().copy()
        out[key] = value
    return out


def _timed(job: Callable[[], Any]) -> float:
    """Seconds ``job`` takes on the slowest rank."""
    dist.barrier()
    start = time.perf_counter()
    job()
    dist.barrier()
    return time.perf_counter() - start


def _save_rank(rank: int, world: int, path: str) -> dict[str, Any]:
    model, optim = _build(world, SEED)
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches; global RNG stays in step
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=data)
        loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd, "step": STEPS, "rng": torch.get_rng_state()}
    seconds = _timed(lambda: api.save(state, path))
    full = _full_values(state)
    return {"seconds": seconds, "losses": losses, "full": full if rank == 0 else None}


def _load_rank(rank: int, world: int, path: str) -> dict[str, Any]:
    # Other initial weights, so that only a real load can make the values match.
    model, optim = _build(world, SEED + 1)
    model_sd, optim_sd = get_state_dict(model, optim)  # also creates AdamW's state to load into
    state = {"model": model_sd, "optim": optim_sd, "step": 0, "rng": torch.zeros_like(torch.get_rng_state())}

    def load() -> None:
        api.load(state, path)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])

    seconds = _timed(load)
    model_sd, optim_sd = get_state_dict(model, optim)
    full = _full_values({"model": model_sd, "optim": optim_sd, "step": state["step"], "rng": state["rng"]})
    return {"seconds": seconds, "full": full if rank == 0 else None}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any) -> None:
    warnings.simplefilter("ignore")  # torch's FSDP/DCP notices would drown the demo's output
    faulthandler.enable()  # a rank that aborts, or is stopped as hung (_spawn), prints every thread's stack
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        queue.put((rank, True, fn(rank, world, *args)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


#: How long a rank that has returned its results may take to exit before it is treated as hung.
_EXIT_GRACE_S = 120.0


def stop_hung(processes: Sequence[Any]) -> None:
    """Stop those of ``processes`` still alive: SIGABRT, so faulthandler prints where each waits; 10 s later SIGKILL."""
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        os.kill(p.pid, signal.SIGABRT)
    deadline = time.monotonic() + 10
    for p in alive:
        p.join(timeout=max(deadline - time.monotonic(), 0))
        if p.is_alive():
            p.kill()


def _spawn(world: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo CPU ranks; results by rank."""
    queue = mp.get_context("spawn").SimpleQueue()
    procs = mp.start_processes(_rank_entry, args=(world, _free_port(), fn, args, queue), nprocs=world,
                               join=False, start_method="spawn")
    results: dict[int, Any] = {}
    failures: list[str] = []

    def drain() -> None:
        while not queue.empty():
            rank, ok, value = queue.get()
            if ok:
                results[rank] = value
            else:
                failures.append(f"rank {rank}:\n{value}")

    exit_deadline = None
    try:
        while not procs.join(timeout=0.2):
            drain()
            if exit_deadline is None and len(results) == world:
                exit_deadline = time.monotonic() + _EXIT_GRACE_S
            elif exit_deadline is not None and time.monotonic() > exit_deadline:
                hung = [r for r, p in enumerate(procs.processes) if p.is_alive()]
                stop_hung(procs.processes)
                raise DemoError(f"{fn.__name__}: {count(len(hung), 'rank')} {hung} returned results but did not exit "
                                f"within {_EXIT_GRACE_S:.0f} s; stopped, with their stacks printed above")
    except Exception as e:
        drain()
        raise DemoError(f"{fn.__name__} failed on {world} ranks:\n" + ("\n".join(failures) or str(e))) from None
    drain()
    return [results[r] for r in range(world)]


def _compare(saved: dict[str, Any], loaded: dict[str, Any]) -> tuple[int, list[str]]:
    """Number of tensors compared, and a line per difference."""
    problems = [f"{k}: saved but not reloaded" for k in saved.keys() - loaded.keys()]
    problems += [f"{k}: reloaded but never saved" for k in loaded.keys() - saved.keys()]
    tensors = 0
    for key in sorted(saved.keys() & loaded.keys()):
        a, b = saved[key], loaded[key]
        if isinstance(a, np.ndarray):
            tensors += 1
            if not isinstance(b, np.ndarray) or (a.dtype, a.shape) != (b.dtype, b.shape):
                problems.append(f"{key}: saved {a.dtype}{list(a.shape)}, reloaded {getattr(b, 'dtype', type(b))}"
                                f"{list(getattr(b, 'shape', []))}")
            elif a.tobytes() != b.tobytes():
                problems.append(f"{key}: {int((a != b).sum())} of {a.size} elements differ")
        elif a != b:
            problems.append(f"{key}: saved {a!r}, reloaded {b!r}")
    return tensors, problems


def _zarr_source(path: str, layout: str) -> Any:
    """What zarr-python opens: the directory itself (plain: no tsckpt code involved), or tsckpt's store (packed)."""
    if layout == PLAIN:
        return path
    from .read.zarr_store import zarr_store

    return zarr_store(path)


def _zarr_outline(path: str, layout: str) -> str:
    """The checkpoint as zarr-python sees it, a line per top-level member: the whole tree of a model and its
    optimizer state is over a hundred lines, and buries the demo's outcome."""
    import zarr

    members = zarr.open_group(_zarr_source(path, layout), mode="r").members()
    lines = ["/"]
    for n, (name, node) in enumerate(sorted(members)):
        branch = "└──" if n == len(members) - 1 else "├──"
        if isinstance(node, zarr.Array):
            lines.append(f"{branch} {name} {node.shape} {node.dtype}")
            continue
        arrays = sorted((k, a) for k, a in node.members(max_depth=None) if isinstance(a, zarr.Array))
        if not arrays:
            lines.append(f"{branch} {name}/ (empty)")
            continue
        key, first = arrays[0]
        lines.append(f"{branch} {name}/ {count(len(arrays), 'array')}, e.g. {key} {first.shape} {first.dtype}")
    return "\n".join(lines)


def _read_with_zarr(path: str, layout: str, entry: TensorEntry, saved: np.ndarray) -> None:
    """Read one float32 tensor with zarr-python and compare it with what was saved."""
    import zarr

    data = zarr.open_array(_zarr_source(path, layout), path=entry.path, mode="r")[...]
    if data.dtype != np.float32 or data.tobytes() != saved.tobytes():
        raise DemoError(f"zarr-python read {entry.path!r} in {path} as {data.dtype}{list(data.shape)}, "
                        f"which is not the saved float32{list(saved.shape)}")


def _prepare_path(path: str | None) -> tuple[str, bool]:
    """Where the demo saves, and whether that is a temporary directory it made."""
    if path is None:
        return os.path.join(tempfile.mkdtemp(prefix="tsckpt-demo-"), "ckpt"), True
    path = os.path.abspath(path)
    if os.path.isdir(path) and os.listdir(path):
        raise DemoError(f"{path} is not empty; the demo writes a new checkpoint and needs an empty or new directory")
    return path, False


def where_it_stays(path: str, temporary: bool) -> str:
    """The closing line about the checkpoint the demo leaves behind, and how to look at it or remove it."""
    line = f"the checkpoint stays in {path}: `tsckpt ls {path}` lists it"
    if temporary:
        line += f"; it is in a temporary directory, `rm -r {os.path.dirname(path)}` removes it"
    return line


def run(save_ranks: int = 4, load_ranks: int = 2, path: str | None = None) -> None:
    """Save on ``save_ranks`` CPU ranks, reload on ``load_ranks``, check every tensor bit-exactly; raises
    :class:`DemoError` if a rank fails or anything reloads differently."""
    if save_ranks < 1 or load_ranks < 1:
        raise DemoError(f"need at least one rank to save and one to load, got {save_ranks} and {load_ranks}")
    path, temporary = _prepare_path(path)
    print(f"checkpoint: {path}")
    print(f"save on {save_ranks} CPU ranks, reload on {load_ranks}: TinyLM (vocab {VOCAB}, dim {DIM}, "
          f"{LAYERS} blocks) sharded with FSDP2 fully_shard, AdamW, {STEPS} steps")

    started = time.perf_counter()
    saved = _spawn(save_ranks, _save_rank, path)
    saved_full = saved[0]["full"]
    save_s = max(r["seconds"] for r in saved)
    ck = checkpoint.open(path)
    files, disk = ck.storage_stats()
    md = ck.metadata
    tensor_bytes = sum(t.nbytes for t in md.tensors.values())
    losses = saved[0]["losses"]
    print(f"trained on {count(save_ranks, 'rank')}, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    print(f"saved {len(md.tensors)} tensors ({tensor_bytes / 1e6:.2f} MB) and {len(md.objects)} other values "
          f"in {save_s:.2f} s: {files} files, {disk / 1e6:.2f} MB on disk")
    embed = md.tensors[_PROBE]
    print(f"  e.g. {_PROBE}: shape {list(embed.shape)}, chunks {list(embed.chunk_shape)}, "
          f"written by ranks {sorted(set(ck.tensors[_PROBE].writers().values()))}")
    print(f"layout {md.layout}; as zarr-python sees it:")
    print(_zarr_outline(path, md.layout))

    loaded = _spawn(load_ranks, _load_rank, path)
    load_s = max(r["seconds"] for r in loaded)
    print(f"loaded on {count(load_ranks, 'rank')} (tsckpt.load + set_state_dict) in {load_s:.2f} s")
    tensors, problems = _compare(saved_full, loaded[0]["full"])
    if problems:
        shown = "\n  ".join(problems[:20])
        raise DemoError(f"{len(problems)} value(s) of {path} differ after reloading on {load_ranks} ranks:\n  {shown}")
    _read_with_zarr(path, md.layout, embed, saved_full[_PROBE])
    print(f"zarr-python read {embed.path!r} as float32{list(embed.shape)}: identical to the saved tensor")
    print(f"total {time.perf_counter() - started:.1f} s; {where_it_stays(path, temporary)}")
    print(f"OK: reloaded on {count(load_ranks, 'rank')}, all {tensors} tensors bit-exact")
