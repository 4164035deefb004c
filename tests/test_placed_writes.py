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
from tsckpt.dcp.placed_writes import Held, Placed, own_boxes, pieces, shard_box
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
    ranks = tuple(range(int(np.prod(mesh))))
    for coordinate in itertools.product(*[range(n) for n in mesh]):
        for o, s in own_boxes([Held("w", placed, coordinate, ranks)])["w"].tolist():
            cover[tuple(slice(a, a + n) for a, n in zip(o, s))] += 1
            assert all(a >= x and a + n <= x + m for a, n, x, m in zip(o, s, *shard_box(placed, coordinate)))
    assert (cover == 1).all()


def _bytes_by_rank(tensors: dict[str, Placed], mesh: tuple[int, ...]) -> list[int]:
    ranks = tuple(range(int(np.prod(mesh))))
    out = []
    for coordinate in itertools.product(*[range(n) for n in mesh]):
        mine = own_boxes([Held(k, p, coordinate, ranks) for k, p in tensors.items()])
        out.append(sum(int(b[1].prod()) * tensors[k].itemsize for k, boxes in mine.items() for b in boxes))
    return out


def test_replicated_shards_are_cut_into_row_pieces_and_balanced_over_their_replicas():
    big = Placed((1024, 1024), 4, (2, 2), (-1, 1))  # 2 MiB shards, two replicas each: two 1 MiB pieces
    assert len(pieces(big).boxes) == 4
    assert _bytes_by_rank({"w": big}, (2, 2)) == [1 << 20] * 4
    small = {f"k{i}": Placed((8, 8 + i), 4, (4,), (-1,)) for i in range(40)}  # whole tensors, largest first
    loads = _bytes_by_rank(small, (4,))
    assert sum(loads) == sum(8 * (8 + i) * 4 for i in range(40)) and max(loads) - min(loads) <= 8 * 47 * 4


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


def _sent(rank: int, state: dict, **options) -> tuple[list[str], list[str]]:
    """The keys of the items this rank's local plan sends, and of the records it sends."""
    planner = SavePlanner(**options)
    planner.set_up_planner(dict(state), is_coordinator=rank == 0)
    sent = planner.create_local_plan()
    return sorted(item.index.fqn for item in sent.items), sorted(PlannerNotes.of(sent).arrays)


def _save(rank: int, world: int, path: str) -> tuple:
    state = _state()
    plain = _sent(rank, state)
    alike = _sent(rank, state, values_group=dist.group.WORLD)
    tsckpt.save(state, path)
    return plain, alike


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
    nested = ["model.a", "model.e"]  # one dimension split over both mesh dimensions: listed in the plans instead
    placed = sorted(f"model.{k}" for k in PLACED if f"model.{k}" not in nested)
    # DCP lists plain values on every rank; the lowest rank of the mesh sends the placed DTensors' records
    assert [items for (items, _), _ in sent] == [sorted(nested + ["epoch", "model.bias"])] * 4
    assert [records for (_, records), _ in sent] == [placed, [], [], []]
    # with every rank's plain values alike, only the first rank sends them: a tensor as a record
    assert [items for _, (items, _) in sent] == [sorted(nested + ["epoch"])] + [nested] * 3
    assert [records for _, (_, records) in sent] == [sorted(placed + ["model.bias"]), [], [], []]
    ck = tsckpt.open(path)
    for k, (shape, _) in PLACED.items():
        assert np.array_equal(np.asarray(ck[f"model.{k}"][...]), _full(k, shape).numpy())
    assert run_ranks(3, _load, path) == [True] * 3


def _save_unlike(rank: int, world: int, path: str) -> list[str]:
    state = {"bias": torch.arange(4.0), "epoch": 3} | ({"only_here": torch.ones(2)} if rank == 1 else {})
    items, _ = _sent(rank, state, values_group=dist.group.WORLD)
    tsckpt.save(state, path)
    return items


def test_when_one_rank_holds_other_plain_values_every_rank_lists_its_own_as_dcp_does(tmp_path):
    path = str(tmp_path / "ck")
    assert run_ranks(2, _save_unlike, path) == [["bias", "epoch"], ["bias", "epoch", "only_here"]]
    state = tsckpt.open(path).to_state_dict()
    assert torch.equal(state["bias"], torch.arange(4.0)) and torch.equal(state["only_here"], torch.ones(2))
    assert state["epoch"] == 3
