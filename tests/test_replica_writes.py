"""Replicated tensors are written by all their replicas, each rank within 1.25x of an even share.

The pure planning (:mod:`tsckpt.dcp.replica_writes`) on plans as DCP's own
deduplication leaves them, then real 4-rank gloo saves of a DDP-style state
dict (every rank holds the same plain tensors) and of HSDP-style DTensors,
read back bit-exactly, by zarr-python too, with the bytes each rank wrote
taken from the ranks the checkpoint records for its chunks.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import zarr
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

import tsckpt
from dist import run_ranks
from tsckpt.dcp.contract import PlannerNotes
from tsckpt.dcp.global_layout import GlobalLayout
from tsckpt.dcp.replica_writes import Holdings, box_bytes, piece_of, spread
from tsckpt.errors import PlanError
from tsckpt.format.plan import DEFAULT_INNER_CHUNK_BYTES
from zoo import expected, same_bits

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from bench_replica_writes import bytes_by_writer, imbalance  # noqa: E402

MiB = 1 << 20


# --- planning ----------------------------------------------------------------------


def _item(fqn: str, shape: tuple[int, ...], offsets: tuple[int, ...] | None = None,
          sizes: tuple[int, ...] | None = None, dtype: torch.dtype = torch.float32) -> WriteItem:
    offsets = offsets if offsets is not None else (0,) * len(shape)
    sizes = sizes if sizes is not None else shape
    return WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)),
                     type=WriteItemType.SHARD if sizes != shape else WriteItemType.TENSOR,
                     tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                                                 TensorProperties(dtype=dtype), torch.Size(shape)))


def _planned(per_rank: list[list[WriteItem]]) -> list[SavePlan]:
    """Local plans as each rank's writer passes them on, deduplicated by DCP."""
    local = []
    for items in per_rank:
        plan = SavePlan(items + [WriteItem(index=MetadataIndex("step"), type=WriteItemType.BYTE_IO)])
        local.append(SavePlan(plan.items, storage_data=Holdings.of(plan)))
    return dedup_save_plans(local)


def _loads(plans: list[SavePlan]) -> dict[int, int]:
    return {r: sum(box_bytes(i) for i in p.items) for r, p in enumerate(plans)}


def _boxes(plans: list[SavePlan], fqn: str) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    return [(r, tuple(i.tensor_data.chunk.offsets), tuple(i.tensor_data.chunk.sizes))
            for r, p in enumerate(plans) for i in p.items if i.index.fqn == fqn]


def _assert_each_chunk_has_one_writer(plans: list[SavePlan]) -> GlobalLayout:
    """Lay the plans out as the writer does; every outer chunk lies whole inside one rank's box."""
    layout = GlobalLayout.plan(plans, DEFAULT_INNER_CHUNK_BYTES, "test")  # checks the boxes tile each tensor
    for fqn, entry in layout.entries.items():
        grid = entry.grid
        owned = [index for p in plans for i in p.items if i.index.fqn == fqn
                 for index, _ in grid.chunks_within(i.tensor_data.chunk.offsets, i.tensor_data.chunk.sizes)]
        assert sorted(owned) == sorted(grid.indices()), fqn
        if entry.inner_chunk_shape:
            assert all(c % i == 0 for c, i in zip(entry.chunk_shape, entry.inner_chunk_shape)), fqn
    return layout


def _ddp(shapes: dict[str, tuple[int, ...]], world: int = 4) -> list[SavePlan]:
    return _planned([[_item(k, s) for k, s in shapes.items()] for _ in range(world)])


def _with_embedding(fraction: float, rest: int = 30) -> dict[str, tuple[int, ...]]:
    """A 2 MB-per-matrix state dict in which one (10000 x d) embedding holds ``fraction`` of the bytes."""
    d = round(rest * 2_000_000 / 4 * fraction / (1 - fraction) / 10000)
    return {"embed": (10000, d), **{f"layers.{i}.w": (500, 1000) for i in range(rest)}}


def test_ddp_with_a_large_embedding_is_spread_within_a_quarter_of_even():
    plans = _ddp(_with_embedding(0.4))
    assert imbalance(_loads(plans), 4) > 1.5  # what DCP's deduplication alone leaves
    out = spread(plans)
    assert imbalance(_loads(out), 4) <= 1.25
    embed = _boxes(out, "embed")
    assert len(embed) == 4 and len({r for r, _, _ in embed}) == 4  # four row pieces, one per replica
    assert [o[0] for _, o, _ in sorted(embed, key=lambda b: b[1])] == [0, 2500, 5000, 7500]
    assert sum(box_bytes(i) for p in out for i in p.items) == sum(box_bytes(i) for p in plans for i in p.items)
    assert all(sum(i.tensor_data is None for i in p.items) == sum(i.tensor_data is None for i in q.items)
               for p, q in zip(out, plans))  # values stay where DCP put them
    layout = _assert_each_chunk_has_one_writer(out)
    assert layout.entries["embed"].chunk_shape[0] == 2500


@pytest.mark.parametrize("world", [2, 3, 8])
def test_ddp_spread_for_other_world_sizes(world):
    out = spread(_ddp(_with_embedding(0.35), world))
    assert imbalance(_loads(out), world) <= 1.25
    _assert_each_chunk_has_one_writer(out)


def test_hsdp_replica_groups_spread_within_each_group():
    """2 replicas x 2 shards: ranks 0, 2 hold shard 0 of every tensor, ranks 1, 3 shard 1 (rows split unevenly)."""
    shapes = {"embed": (10001, 800), **{f"w{i}": (400, 1000) for i in range(16)}}

    def shard(fqn, shape, s):
        rows = -(-shape[0] // 2)
        lo = s * rows
        return _item(fqn, shape, (lo, 0), (min(rows, shape[0] - lo), shape[1]))

    plans = _planned([[shard(k, v, r % 2) for k, v in shapes.items()] for r in range(4)])
    out = spread(plans)
    assert imbalance(_loads(out), 4) <= 1.25
    for r, p in enumerate(out):
        for i in p.items:
            if i.tensor_data is not None:
                start = i.tensor_data.chunk.offsets[0]
                assert (start >= -(-i.tensor_data.size[0] // 2)) == (r % 2 == 1), (r, i.index.fqn)
    assert {r for r, _, _ in _boxes(out, "embed")} == {0, 1, 2, 3}
    layout = _assert_each_chunk_has_one_writer(out)
    assert layout.entries["embed"].chunk_shape[0] == 1667  # 5001 = 3 x 1667 rows: cut no finer than needed


def test_disjoint_shards_are_left_as_dcp_planned():
    shapes = {"embed": (10000, 400), "w": (4000, 1000)}
    per_rank = [[_item(k, s, (r * s[0] // 4, 0), (s[0] // 4, s[1])) for k, s in shapes.items()] for r in range(4)]
    plans = _planned(per_rank)
    assert all(a is b for a, b in zip(spread(plans), plans))


def test_small_tensors_are_not_cut_but_still_balanced():
    shapes = {f"b{i}": (128, 128) for i in range(50)}  # 64 KiB each
    out = spread(_ddp(shapes))
    assert all(tuple(i.tensor_data.chunk.sizes) == tuple(i.tensor_data.size)
               for p in out for i in p.items if i.tensor_data is not None)
    assert imbalance(_loads(out), 4) <= 1.05


def test_pieces_are_never_smaller_than_a_mebibyte():
    out = spread(_ddp({"big": (3 * 1024, 256)}))  # 3 MiB alone: three 1 MiB pieces, not four
    assert sorted(s for _, _, s in _boxes(out, "big")) == [(1024, 256)] * 3


def test_uneven_rows_are_cut_into_pieces_that_tile():
    out = spread(_ddp({"odd": (1001, 2048), "small": (10, 10)}))
    assert [s[0] for _, _, s in sorted(_boxes(out, "odd"), key=lambda b: b[1])] == [251, 251, 251, 248]
    assert _assert_each_chunk_has_one_writer(out).entries["odd"].chunk_shape[0] == 251


def test_one_dimensional_tensors_are_cut_too():
    out = spread(_ddp({"flat": (3_000_001,), "scalar": ()}))
    assert max(_boxes(out, "flat"), key=lambda b: b[1])[1:] == ((2_250_003,), (749_998,))
    assert len({r for r, _, _ in _boxes(out, "flat")}) == 4
    _assert_each_chunk_has_one_writer(out)


def test_holdings_keep_the_planner_notes_readable():
    notes = PlannerNotes(placements={"w": {"kind": "replicated"}})
    plan = SavePlan([_item("w", (4, 4))], storage_data=notes)
    held = SavePlan(plan.items, storage_data=Holdings.of(plan))
    assert PlannerNotes.of(held) is notes and PlannerNotes.found(held) is notes
    bare = SavePlan(plan.items)
    assert PlannerNotes.found(SavePlan(bare.items, storage_data=Holdings.of(bare))) is None
    # The digest names the boxes, not their order in the plan.
    other = SavePlan([_item("v", (2,)), _item("w", (4, 4))])
    assert Holdings.of(other).digest != Holdings.of(plan).digest
    assert Holdings.of(SavePlan(other.items[::-1])).digest == Holdings.of(other).digest


def test_a_piece_is_a_view_of_the_resolved_tensor_and_a_stray_box_is_refused():
    data = torch.arange(60.0).reshape(10, 6)[4:]  # a rank's shard: rows 4..9 of the tensor
    item = _item("w", (10, 6), (4, 0), (6, 6))
    piece = _with_box(item, (6, 0), (3, 6))
    view = piece_of(data, piece, "ckpt")
    assert view.data_ptr() == data[2:5].data_ptr() and torch.equal(view, torch.arange(36.0, 54.0).reshape(3, 6))
    with pytest.raises(PlanError, match=r"tensor 'w'.*offsets=\[8, 0\] sizes=\[3, 6\]"):
        piece_of(data, _with_box(item, (8, 0), (3, 6)), "ckpt")


def _with_box(item: WriteItem, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> WriteItem:
    td = dataclasses.replace(item.tensor_data, chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
    return dataclasses.replace(item, tensor_data=td)


# --- real saves on 4 gloo ranks ------------------------------------------------------------

DDP_SHAPES = {"embed": (1600, 1024), **{f"layers.{i}.w": (96 + i, 1024) for i in range(24)}, "norm": (1024,)}


def _ddp_state(step: int) -> dict:
    return {**{k: expected(k, s, torch.float32) + step for k, s in DDP_SHAPES.items()}, "step": step}


def _hsdp_state(mesh) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return {k: distribute_tensor(expected(k, s, torch.float32), mesh, [Replicate(), Shard(0)], src_data_rank=None)
            for k, s in DDP_SHAPES.items()}


def save_replicated(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh

    dcp.save(_ddp_state(0), storage_writer=tsckpt.TensorStoreWriter(f"{root}/dcp_planner", layout="plain"))
    tsckpt.save(_ddp_state(0), f"{root}/tsckpt", layout="plain")
    for step in range(2):
        dcp.save(_ddp_state(step), storage_writer=tsckpt.TensorStoreWriter(f"{root}/cached{step}", layout="plain"),
                 planner=DefaultSavePlanner(enable_plan_caching=True))
        dcp.save(_ddp_state(step), storage_writer=tsckpt.TensorStoreWriter(f"{root}/tcached{step}", layout="packed"),
                 planner=tsckpt.SavePlanner(enable_plan_caching=True))
    back = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in _ddp_state(0).items()}
    dcp.load(back, storage_reader=tsckpt.TensorStoreReader(f"{root}/tcached1"))
    loaded = all(same_bits(back[k], v) for k, v in _ddp_state(1).items() if isinstance(v, torch.Tensor))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    tsckpt.save(_hsdp_state(mesh), f"{root}/hsdp")
    return loaded and back["step"] == 1


@pytest.fixture(scope="module")
def replicated_saves(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("replicas"))
    assert all(run_ranks(4, save_replicated, root))  # dcp.load on every rank got the cached save back
    return root


@pytest.mark.parametrize("name, step", [("dcp_planner", 0), ("tsckpt", 0), ("cached0", 0), ("cached1", 1),
                                        ("tcached0", 0), ("tcached1", 1)])
def test_ddp_saves_spread_bytes_and_read_back_exactly(replicated_saves, name, step):
    path = f"{replicated_saves}/{name}"
    per_rank = bytes_by_writer(path)
    assert imbalance(per_rank, 4) <= 1.25, per_rank
    ck = tsckpt.open(path)
    assert len(set(ck.tensors["embed"].writers().values())) >= 3
    state = ck.to_state_dict()
    for key, value in _ddp_state(step).items():
        assert same_bits(state[key], value) if isinstance(value, torch.Tensor) else state[key] == value, key
    if not name.startswith("tcached"):  # the plain layout (tcached: packed): zarr-python reads the arrays itself
        group = zarr.open_group(path, mode="r")
        np.testing.assert_array_equal(group["embed"][...], _ddp_state(step)["embed"].numpy())
        np.testing.assert_array_equal(group["norm"][...], _ddp_state(step)["norm"].numpy())


def test_hsdp_save_spreads_each_shard_over_its_replicas(replicated_saves):
    path = f"{replicated_saves}/hsdp"
    assert imbalance(bytes_by_writer(path), 4) <= 1.25
    ck = tsckpt.open(path)
    handle = ck.tensors["embed"]
    for index, rank in handle.writers().items():
        rows = handle.chunks.chunk_region(index)[0]
        # Mesh [[0, 1], [2, 3]], Shard(0) along its columns: ranks 0 and 2 hold rows 0-799, ranks 1 and 3 the rest.
        assert rank in ((0, 2) if rows.start < 800 else (1, 3)), (index, rank)
    assert len(set(handle.writers().values())) == 4
    state = ck.to_state_dict()
    for key, shape in DDP_SHAPES.items():
        assert same_bits(state[key], expected(key, shape, torch.float32)), key
