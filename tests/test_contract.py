"""The coordinator <-> rank contract: what each rank is sent, and how the coordinator reads what comes back.

The coordinator's side runs in this process on DCP-shaped plans, as DCP would
call it; plans cross a real pickle, as DCP's scatter sends them. Whole saves on
real ranks are in test_distributed.py, test_dropin_args.py and test_writer_options.py.
"""

from __future__ import annotations

import dataclasses

import pickle

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from tsckpt.base_chunks import BaseChoice
from tsckpt.dcp.contract import ArrayTable, RankPlan, RankSummary, RankWrites, SaveOrders, WriteConfig
from tsckpt.dcp import summary
from tsckpt.dcp.summary import PerRank, columns_of, full
from tsckpt.dcp.merged_chunks import MergedChunks
from tsckpt.dcp.storage import TensorStoreWriter
from tsckpt.errors import PlanError
from tsckpt.format.data_files import FileRef, RankFiles
from tsckpt.format.metadata import ArrayOptions
from tsckpt.storage.location import parse_location


def _item(fqn: str, shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> WriteItem:
    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
    return WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=torch.float32),
                                                 size=torch.Size(shape)))


def _stage_plans(world: int, per_rank: int) -> list[SavePlan]:
    """Pipeline-style: each rank writes its own ``per_rank`` whole tensors, plus its row of one shared tensor."""
    plans = []
    for r in range(world):
        items = [_item(f"stage{r}.layer{t}.weight", (16, 8), (0, 0), (16, 8)) for t in range(per_rank)]
        items.append(_item("embed.weight", (world * 2, 4), (2 * r, 0), (2, 4)))
        plans.append(SavePlan(items, planner_data={it.index.fqn: ("model", it.index.fqn) for it in items}))
    return plans


def _coordinator(tmp_name: str) -> TensorStoreWriter:
    writer = TensorStoreWriter(f"memory://{tmp_name}", overwrite=True, compression="zstd", checksums=False)
    writer.set_up_storage_writer(True, rank=0)
    return writer


def _received(plan: SavePlan) -> tuple[SavePlan, int]:
    """The plan as its rank unpickles it, and how many bytes it was."""
    blob = pickle.dumps(plan)
    return pickle.loads(blob), len(blob)


def test_each_rank_is_sent_the_coordinators_options_and_only_the_arrays_it_writes():
    writer = _coordinator("contract-only-own")
    sent = writer.prepare_global_plan(_stage_plans(4, 3))
    for r, plan in enumerate(sent):
        got, _ = _received(plan)
        rank_plan = got.storage_data
        assert isinstance(rank_plan, RankPlan)
        config = rank_plan.orders.value.config
        assert config == writer.config and config.array_options.compression == "zstd"
        fqns = list(dict.fromkeys(i.index.fqn for i in got.items))
        arrays = rank_plan.arrays.value.entries(fqns, "here")
        assert set(arrays) == {f"stage{r}.layer{t}.weight" for t in range(3)} | {"embed.weight"}
        for fqn, (number, entry) in arrays.items():
            assert list(writer._layout.entries)[number] == fqn
            assert entry == writer._layout.entries[fqn]
    # The options and location are one shared payload, not a copy per rank.
    assert len({id(p.storage_data.orders) for p in sent}) == 1


def test_what_a_rank_receives_grows_with_what_it_writes_not_with_the_world():
    sizes = {}
    for world in (4, 64):
        writer = _coordinator(f"contract-grow-{world}")
        sizes[world] = max(_received(p)[1] for p in writer.prepare_global_plan(_stage_plans(world, 5)))
    assert sizes[64] < 1.1 * sizes[4], sizes


def test_a_plan_whose_tensors_changed_after_global_planning_is_refused():
    writer = _coordinator("contract-changed")
    got, _ = _received(writer.prepare_global_plan(_stage_plans(2, 2))[1])
    fqns = list(dict.fromkeys(i.index.fqn for i in got.items))
    with pytest.raises(PlanError, match="does not list the 3 tensors the coordinator laid out"):
        got.storage_data.arrays.value.entries(list(reversed(fqns)), "ckpt")


def _summary(rank: int, tensor: list[int], chunk: list[int], offset: list[int] | None = None) -> RankSummary:
    """A rank's summary: its chunks stored back to back in its own data file, at ``offset`` when given."""
    offset = offset if offset is not None else [10 * k for k in range(len(chunk))]
    return RankSummary(rank, "s1", np.array(tensor, np.int32), np.array(chunk, np.int64),
                       np.zeros(len(chunk), np.int32), np.array(offset, np.int64), np.full(len(chunk), 10, np.int64),
                       np.array([c == 2 for c in chunk], bool), (f"d/s1-{rank}",),
                       RankFiles((FileRef(f"d/s1-{rank}", 10 * len(chunk)),), None))


def test_written_chunks_are_placed_per_tensor_in_grid_order():
    merged = MergedChunks.merge([_summary(1, [1, 0, 1], [1, 0, 0], [11, 20, 10]), _summary(0, [1], [2], [12])],
                                [1, 3], ["a", "b"], "ckpt")
    b = merged.of(1)
    assert b.writer.tolist() == [1, 1, 0] and b.offset.tolist() == [10, 11, 12]
    assert [merged.files[f] for f in b.file.tolist()] == ["d/s1-1", "d/s1-1", "d/s1-0"]
    assert b.reused.tolist() == [False, False, True]
    assert merged.of(0).writer.tolist() == [1]


@pytest.mark.parametrize("gathered", [False, True])
def test_gathered_summaries_decode_together_to_what_each_rank_held(gathered):
    wide = _summary(2, list(range(300)), [5] * 300, [k * 100_000 for k in range(300)])
    summaries = [_summary(1, [1, 0, 1], [1, 0, 0], [11, 20, 10]), _summary(0, [], []), wide, _summary(0, [1], [2], [12])]
    if gathered:
        summaries = [pickle.loads(pickle.dumps(s)) for s in summaries]
        assert all(s.packed is not None and s.tensor is None for s in summaries)
        assert [s.decoded().to_dict() for s in summaries] == [s.to_dict() for s in summaries]
    columns = columns_of(summaries)
    assert columns["rows"].tolist() == [3, 0, 300, 1]
    assert columns["tensor"].tolist() == [1, 0, 1, *range(300), 1]
    assert columns["offset"].tolist() == [11, 20, 10, *(k * 100_000 for k in range(300)), 12]
    # Sent as one value by every rank: kept as one value per rank, not a column of every row.
    assert isinstance(columns["reused"], PerRank) and columns["reused"].values.tolist() == [0, 0, 0, 1]
    assert full(columns["reused"], columns["rows"]).tolist() == [0, 0, 0, *[0] * 300, 1]


@pytest.mark.parametrize("gathered", [False, True])
def test_a_run_sent_as_one_difference_decodes_as_the_run(gathered):
    # Rank 1 holds tensors 1 and 2 (differences 1, 1: one value sent) and every other column is one value too.
    plain = [RankSummary(r, "s1", np.array(t, np.int32), np.zeros(len(t), np.int64), np.full(len(t), -1, np.int32),
                         np.zeros(len(t), np.int64), np.zeros(len(t), np.int64), np.zeros(len(t), bool), (),
                         RankFiles((), None)) for r, t in ((0, [0]), (1, [1, 2]))]
    if gathered:
        plain = [pickle.loads(pickle.dumps(s)) for s in plain]
    assert columns_of(plain)["tensor"].tolist() == [0, 1, 2]
    merged = MergedChunks.merge(plain, [1, 1, 1], ["a", "b", "c"], "ckpt")
    assert merged.writer.tolist() == [0, 1, 1] and merged.file.tolist() == [-1, -1, -1]


@pytest.mark.parametrize("summaries, message", [
    ([_summary(0, [0], [0])], "chunk 1 of tensor 'a' was never written"),
    ([_summary(0, [0, 0], [0, 1]), _summary(1, [0], [1])], "chunk 1 of tensor 'a' was written by 2 ranks"),
    ([_summary(0, [0, 0], [0, 2])], "outside its tensor's grid"),
    ([_summary(0, [0, 1], [0, 1])], "a tensor the coordinator did not lay out"),
])
def test_a_missing_doubled_or_stray_chunk_stops_the_commit(summaries, message):
    with pytest.raises(PlanError, match=message):
        MergedChunks.merge(summaries, [2], ["a"], "ckpt")


def test_a_rank_that_does_not_say_where_its_chunks_are_stops_the_commit():
    silent = dataclasses.replace(_summary(0, [0], [0]), offset=None)
    with pytest.raises(PlanError, match="did not say where its chunks are stored"):
        MergedChunks.merge([silent], [1], ["a"], "ckpt")



@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_each_chunk_keeps_its_own_row_whether_a_column_holds_one_value_per_rank_or_not(seed, gathered):
    # A column of one value per rank is taken by writer, any other is scattered: both must give each chunk its row.
    rng = np.random.default_rng(seed)
    world, nchunks = 12, [7, 0, 30, 5]
    owner = [rng.integers(0, world - 1, n) for n in nchunks]  # the last rank writes nothing
    summaries, expected = [], {}
    for r in rng.permutation(world).tolist():  # gathered in any order
        rows = [(t, c) for t, n in enumerate(nchunks) for c in range(n) if owner[t][c] == r]
        files = tuple(f"d/s1-{r}-{k}" for k in range(1 + (seed % 2) * (r % 3)))
        file = np.arange(len(rows), dtype=np.int32) % len(files)
        offset = rng.integers(0, 1 << 20, len(rows)) * (1 << 33 if seed % 3 == 2 else 1)
        length = np.full(len(rows), 10) if seed % 3 == 0 else rng.integers(1, 1 << 20, len(rows))
        reused = rng.random(len(rows)) < 0.5 if seed % 3 == 1 else np.zeros(len(rows), bool)
        summaries.append(RankSummary(r, "s1", np.array([t for t, _ in rows], np.int32),
                                     np.array([c for _, c in rows], np.int64), file, offset, length, reused, files,
                                     RankFiles(tuple(FileRef(f, 1 << 40) for f in files), None)))
        for k, chunk in enumerate(rows):
            expected[chunk] = (r, files[file[k]], int(offset[k]), int(length[k]), bool(reused[k]))
    if gathered:
        summaries = [pickle.loads(pickle.dumps(s)) for s in summaries]
    merged = MergedChunks.merge(summaries, nchunks, ["a", "b", "c", "d"], "ckpt")
    found = {}
    for t, n in enumerate(nchunks):
        at = merged.of(t)
        for c in range(n):
            found[t, c] = (int(at.writer[c]), merged.files[at.file[c]], int(at.offset[c]), int(at.length[c]),
                           bool(at.reused[c]))
    assert found == expected

def test_contract_records_round_trip_through_pickle():
    def again(x):
        return pickle.loads(pickle.dumps(x))

    config = WriteConfig("packed", ArrayOptions(crc32c_codec=True, compression="zstd"), False, 1 << 20, False)
    assert again(config) == config
    orders = SaveOrders(config, parse_location("memory://x"), "s1")
    assert again(orders) == orders
    based = SaveOrders(config, parse_location("memory://x"), "s1", BaseChoice(parse_location("memory://b"), "s0", None, "why"))
    assert again(based) == based
    summary = _summary(3, [0, 1], [4, 5], [7, 8])
    back = RankSummary.from_dict(summary.to_dict())
    assert back.to_dict() == summary.to_dict()
    table = ArrayTable(np.array([2, 0], np.int32), np.array([2, 0], np.uint8), np.zeros((2, 3, 2), np.int64),
                       np.array([True, False]), ("float32", "bool"), (("m", "w"), ("step",)), 99)
    table_back = again(table)
    assert all(np.array_equal(getattr(table_back, f), getattr(table, f)) for f in ("ids", "ndims", "dims", "sharded"))
    assert (table_back.dtypes, table_back.key_paths, table_back.digest) == (table.dtypes, table.key_paths, table.digest)


def test_results_written_with_another_saves_orders_stop_the_commit():
    results = RankWrites([], _summary(2, [], []))
    assert RankWrites.summary_of(results, "s1", "ckpt").rank == 2
    with pytest.raises(PlanError, match="rank 2 wrote with the orders of save s1, not of this save s2"):
        RankWrites.summary_of(results, "s2", "ckpt")
    with pytest.raises(PlanError, match="without tsckpt's summary"):
        RankWrites.summary_of([], "s2", "ckpt")


@pytest.mark.parametrize("block", [7, 1 << 16])
def test_columns_decode_to_each_ranks_rows_whether_a_block_holds_many_ranks_or_part_of_one(block, monkeypatch):
    monkeypatch.setattr(summary, "_BLOCK", block)
    rng = np.random.default_rng(block)
    summaries, expected = [], {"tensor": [], "chunk": [], "offset": []}
    for r in range(50):
        n = int(rng.integers(0, 20))
        rows = {"tensor": np.sort(rng.integers(0, 5, n)).astype(np.int32), "chunk": rng.integers(0, 1 << 40, n),
                "offset": rng.integers(0, 1 << 35, n)}
        summaries.append(pickle.loads(pickle.dumps(RankSummary(
            r, "s1", rows["tensor"], rows["chunk"], np.zeros(n, np.int32), rows["offset"], np.full(n, 3),
            np.zeros(n, bool), ("f",), None))))
        for name, values in rows.items():
            expected[name] += values.tolist()
    columns = columns_of(summaries)
    assert {name: columns[name].tolist() for name in expected} == expected
