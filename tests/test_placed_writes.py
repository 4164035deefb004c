"""DTensors laid out from their placements: no rank's gathered plan lists them, and every box is written once.

The geometry is checked against ``torch.chunk`` applied mesh dimension by
mesh dimension (what DTensor does); then real gloo ranks on a 2 x 2 mesh save
uneven, empty, 0-d, replicated and large replicated tensors through
``tsckpt.save``, and the checkpoint is read back whole and into another
world size.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import tsckpt
from dist import run_ranks
from tsckpt.dcp.contract import PlannerNotes
from tsckpt.dcp.placed_writes import Placed, own_boxes, pieces, shard_box
from tsckpt.dcp.planner import SavePlanner


def _reference_shard(shape, mesh, dims, coordinate):
    """The shard of ``coordinate`` by torch.chunk on an index tensor, one mesh dimension after the other."""
    index = torch.arange(int(np.prod(shape))).reshape(shape) if shape else torch.tensor(0)
    for i, d in enumerate(dims):
        if d == -1:
            continue
        parts = torch.chunk(index, mesh[i], dim=d)
        index = parts[coordinate[i]] if coordinate[i] < len(parts) else index.narrow(d, index.shape[d], 0)
    return index


@pytest.mark.parametrize("shape,mesh,dims", [
    ((7, 5), (2, 2), (0, 0)), ((10,), (3, 2), (0, 0)), ((3,), (2, 2), (0, 0)), ((9, 6), (2, 2), (0, -1)),
    ((4, 11), (2, 3), (-1, 1)), ((5, 7), (2, 2), (1, 0)), ((), (2,), (-1,)), ((0, 4), (2,), (0,)),
])
def test_each_shard_is_what_torch_chunk_gives_and_the_written_boxes_tile_the_tensor_once(shape, mesh, dims):
    placed = Placed(shape, 4, mesh, dims)
    for coordinate in itertools.product(*[range(n) for n in mesh]):
        ref = _reference_shard(shape, mesh, dims, coordinate)
        offsets, sizes = shard_box(placed, coordinate)
        assert sizes == tuple(ref.shape)
        if ref.numel():
            first = np.unravel_index(int(ref.flatten()[0]), shape) if shape else ()
            assert offsets == tuple(int(x) for x in first)
    cover = np.zeros(shape, np.int64)
    for coordinate in itertools.product(*[range(n) for n in mesh]):
        for o, s in own_boxes(placed, "w", coordinate).tolist():
            cover[tuple(slice(a, a + n) for a, n in zip(o, s))] += 1
            assert all(a >= x and a + n <= x + m for a, n, x, m in zip(o, s, *shard_box(placed, coordinate)))
    assert (cover == 1).all()


def test_a_large_replicated_shard_is_cut_into_row_pieces_for_its_replicas_and_small_ones_spread_by_key():
    big = Placed((1024, 1024), 4, (2, 2), (-1, 1))  # 2 MiB shards, two replicas each
    assert len(pieces(big).boxes) == 4
    writers = {tuple(np.sort(pieces(big).writers(k))) for k in ("a", "b")}
    assert writers == {(0, 1, 2, 3)}  # every rank writes a piece
    small = Placed((8, 8), 4, (4,), (-1,))
    chosen = {int(pieces(small).writers(f"k{i}")[0]) for i in range(40)}
    assert chosen == {0, 1, 2, 3}


def _full(name: str, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g)


PLACED = {"a": ((7, 5), [Shard(0), Shard(0)]), "b": ((9, 6), [Shard(0), Replicate()]),
          "c": ((1024, 1024), [Replicate(), Shard(1)]), "d": ((), [Replicate(), Replicate()]),
          "e": ((3,), [Shard(0), Shard(0)]), "f": ((5, 7), [Shard(1), Shard(0)])}


def _state() -> dict:
    mesh = init_device_mesh("cpu", (2, 2))
    model = {k: distribute_tensor(_full(k, shape), mesh, placements) for k, (shape, placements) in PLACED.items()}
    return {"model": model | {"bias": torch.arange(4.0)}, "epoch": 3}


def _save(rank: int, world: int, path: str) -> tuple[int, list[str]]:
    state = _state()
    planner = SavePlanner()
    planner.set_up_planner(dict(state), is_coordinator=rank == 0)
    sent = planner.create_local_plan()
    tsckpt.save(state, path)
    dtensor_items = sum(item.index.fqn in ("model.a", "model.e") for item in sent.items)
    assert all(item.index.fqn in ("model.a", "model.e", "model.bias", "epoch") for item in sent.items)
    return dtensor_items, sorted(PlannerNotes.of(sent).arrays)


def _load(rank: int, world: int, path: str) -> bool:
    mesh = init_device_mesh("cpu", (world,))
    state = {"model": {k: distribute_tensor(torch.zeros(shape), mesh, [Shard(0)] if shape else [Replicate()])
                       for k, (shape, _) in PLACED.items()} | {"bias": torch.zeros(4)}, "epoch": None}
    tsckpt.load(state, path)
    ok = state["epoch"] == 3 and torch.equal(state["model"]["bias"], torch.arange(4.0))
    for k, (shape, _) in PLACED.items():
        ok &= torch.equal(state["model"][k].full_tensor(), _full(k, shape))
    dist.barrier()
    return bool(ok)


def test_ranks_of_a_2x2_mesh_send_no_dtensor_item_and_the_checkpoint_loads_whole_and_into_3_ranks(tmp_path):
    path = str(tmp_path / "ck")
    sent = run_ranks(4, _save, path)
    assert [n for n, _ in sent] == [2, 2, 2, 2]
    nested = {"a", "e"}  # one dimension split over both mesh dimensions: listed in the plans instead
    assert sent[0][1] == sorted(f"model.{k}" for k in PLACED if k not in nested)
    assert all(not names for _, names in sent[1:])
    ck = tsckpt.open(path)
    for k, (shape, _) in PLACED.items():
        assert np.array_equal(np.asarray(ck[f"model.{k}"][...]), _full(k, shape).numpy())
    assert run_ranks(3, _load, path) == [True] * 3
