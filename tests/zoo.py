"""Deterministic global tensors and the sharded state dicts built from them.

Every rank builds the same global tensors from a name-derived seed, then keeps
its own part, so any process can rebuild the expected value of any tensor.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import tsckpt

SPECS = {
    # name: (shape, dtype)
    "even": ((8, 6), torch.float32),
    "uneven": ((10, 3), torch.bfloat16),
    "zero": ((3, 5), torch.float16),
    "cols": ((4, 10), torch.float64),
    "mesh2d": ((6, 8), torch.float32),
    "nested": ((10, 4), torch.int32),
    "repl": ((5, 5), torch.float32),
    "hybrid": ((8, 3), torch.float32),
    "st": ((10, 4), torch.float32),
    "plain": ((7,), torch.int64),
    "scalar": ((), torch.float32),
}
DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16,
          torch.uint32, torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64,
          torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
ST_ROWS = [2, 1, 3, 3, 1]  # irregular ShardedTensor row boundaries, 5 shards on 4 ranks


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality, float8 and NaN payloads included."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.itemsize == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def dtype_key(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def expected(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 4).to(dtype)
    hi = 100 if dtype in (torch.uint8, torch.int8) else 10_000
    return torch.randint(0, hi, shape, generator=g).to(dtype)


def expected_all() -> dict[str, torch.Tensor]:
    out = {name: expected(name, shape, dt) for name, (shape, dt) in SPECS.items()}
    out |= {f"dtypes.{dtype_key(dt)}": expected(dtype_key(dt), (8, 3), dt) for dt in DTYPES}
    return out


def sharded_tensor(full: torch.Tensor, rows: list[int], world: int):
    from torch.distributed._shard.sharded_tensor import Shard as STShard, init_from_local_shards
    from torch.distributed._shard.metadata import ShardMetadata

    rank, local, offset = dist.get_rank(), [], 0
    for i, n in enumerate(rows):
        owner = i % world
        if owner == rank:
            md = ShardMetadata([offset, 0], [n, full.shape[1]], f"rank:{owner}/cpu")
            local.append(STShard(full[offset:offset + n].clone(), md))
        offset += n
    return init_from_local_shards(local, *full.shape)


def zoo_state_dict(world: int, without: tuple[str, ...] = ()) -> dict:
    """The 4-rank (or 2-rank) save: every placement kind and dtype, plus plain values."""
    mesh1 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    e = expected_all()

    def dt(name, mesh, placements):
        return distribute_tensor(e[name], mesh, placements, src_data_rank=None)

    model = {
        "even": dt("even", mesh1, [Shard(0)]),
        "uneven": dt("uneven", mesh1, [Shard(0)]),
        "zero": dt("zero", mesh1, [Shard(0)]),
        "cols": dt("cols", mesh1, [Shard(1)]),
        "mesh2d": dt("mesh2d", mesh2, [Shard(0), Shard(1)]),
        "nested": dt("nested", mesh2, [Shard(0), Shard(0)]),
        "repl": dt("repl", mesh1, [Replicate()]),
        "hybrid": dt("hybrid", mesh2, [Replicate(), Shard(0)]),
        "st": sharded_tensor(e["st"], ST_ROWS, world),
        "plain": e["plain"].clone(),
        "scalar": e["scalar"].clone(),
    }
    dtypes = {dtype_key(d): dt(f"dtypes.{dtype_key(d)}", mesh1, [Shard(0)]) for d in DTYPES}
    model = {k: v for k, v in model.items() if k not in without}
    extra = {"lr": 0.1, "name": "run-1", "groups": [{"lr": 0.01, "betas": (0.9, 0.99), "params": [0, 1]}]}
    return {"model": model, "dtypes": dtypes, "extra": extra}


def save_zoo(rank: int, world: int, location, layout: str | None = None) -> None:
    """Run on each of ``world`` ranks: save the zoo to ``location`` (in ``layout``, else the default one)."""
    tsckpt.save(zoo_state_dict(world), location, **({"layout": layout} if layout else {}))


def empty_like_expected(without: tuple[str, ...] = ()) -> dict:
    """Plain full tensors (and value placeholders) to load the zoo into, in one process."""
    e = expected_all()
    model = {k: torch.zeros_like(e[k]) for k in SPECS if k not in without}
    dtypes = {dtype_key(d): torch.zeros_like(e[f"dtypes.{dtype_key(d)}"]) for d in DTYPES}
    extra = {"lr": None, "name": None, "groups": [{"lr": None, "betas": None, "params": None}]}
    return {"model": model, "dtypes": dtypes, "extra": extra}


def assert_zoo_tensors(sd: dict) -> None:
    """Every tensor of a loaded zoo state dict equals the expected global value, bit for bit."""
    expected = expected_all()
    for name in sd["model"]:
        assert same_bits(sd["model"][name], expected[name]), name
    for dt in DTYPES:
        key = dtype_key(dt)
        assert same_bits(sd["dtypes"][key], expected[f"dtypes.{key}"]), key
