"""The synthetic FSDP world of ``bench_scale.py``: what the coordinator holds, and what each rank sends and receives.

``ranks`` ranks save ``tensors`` bf16 tensors of ``[rows, cols]``, each
row-split as FSDP2 splits it (``torch.chunk``: ``ceil(rows / ranks)`` rows per
rank, the last ranks empty when the rows run out).

Two representations of the same plans, so that 10,000 ranks fit in memory:

* :meth:`World.gathered` -- the global plans the writer's ``prepare_global_plan``
  receives, held all at once as DCP holds them. Real ``SavePlan``/``WriteItem``/
  ``MetadataIndex`` objects, one per item; with ``shared``, each rank's items
  share one ``TensorWriteData`` (their chunk, properties and global size are
  equal values). Global planning only reads attributes, so sharing does not
  change what it costs; it cuts the memory to about a third (some 300 instead
  of 900 bytes per item once pickled). The empty shards (offset ``rows``, zero rows) have the same
  index on every empty rank, so DCP's planner deduplicates them:
  ``dedup_save_plans`` runs on the empty ranks (the only ranks those indices
  occur on, so its choice is the one it makes over all ranks).
* :func:`as_sent` -- one rank's items rebuilt as DCP's planner makes them on
  that rank (every item its own chunk, sizes, properties and global size), to
  pickle exactly the bytes DCP pickles for that rank, one rank at a time.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from tsckpt.dcp.contract import PlannerNotes, RankSummary, RankWrites
from tsckpt.dcp.replica_writes import Holdings
from tsckpt.format.chunk_table import ChunkTable
from tsckpt.format.data_files import FileRef, RankFiles, Span


class World:
    """One synthetic save: plan sizes and rank offsets, computed, never stored per item."""

    def __init__(self, ranks: int, tensors: int, rows: int, cols: int):
        self.ranks, self.tensors, self.rows, self.cols = ranks, tensors, rows, cols
        self.fqns = [f"model.layers.{t}.weight" for t in range(tensors)]
        self.mappings = {fqn: ("model", fqn[len("model."):]) for fqn in self.fqns}  # DCP's flatten mappings
        self.per = -(-rows // ranks)
        self.size = torch.Size([rows, cols])
        self.props = TensorProperties(dtype=torch.bfloat16)

    def start(self, r: int) -> int:
        return min(r * self.per, self.rows)

    def nrows(self, r: int) -> int:
        return max(0, min(self.per, self.rows - self.start(r)))

    @property
    def regions(self) -> int:
        """Ranks holding rows (the others hold empty shards)."""
        return sum(self.nrows(r) > 0 for r in range(self.ranks))

    def notes(self) -> PlannerNotes:
        """tsckpt's planner's placement notes for every tensor (the lowest rank of the mesh describes them)."""
        mesh = {"shape": [self.ranks], "dim_names": ["dp_shard"], "device_type": "cuda",
                "ranks": list(range(self.ranks))}
        record = {"kind": "dtensor", "mesh": mesh, "placements": [{"type": "shard", "dim": 0}]}
        return PlannerNotes({fqn: record for fqn in self.fqns})

    def compact(self) -> list[SavePlan]:
        """Every rank's local plan as tsckpt's planner sends it, wrapped by its writer: no item of a DTensor whose
        placements give its layout; rank 0 (the lowest of the mesh) sends each tensor's record."""
        notes = self.notes()
        arrays = {fqn: {"shape": [self.rows, self.cols], "dtype": "bfloat16", "key_path": list(self.mappings[fqn])}
                  for fqn in self.fqns}
        first = SavePlan([], storage_data=PlannerNotes(notes.placements, arrays))
        rest = SavePlan([], storage_data=PlannerNotes())
        return [SavePlan([], storage_data=Holdings.of(first), planner_data={})] + [
            SavePlan([], storage_data=Holdings.of(rest), planner_data={}) for _ in range(self.ranks - 1)]

    def items(self, r: int) -> list[WriteItem]:
        offsets = torch.Size([self.start(r), 0])
        td = TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([self.nrows(r), self.cols])),
                             properties=self.props, size=self.size)
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD, tensor_data=td)
                for fqn in self.fqns]

    def gathered(self, with_notes: bool, shared: bool) -> list[SavePlan]:
        """Every rank's global plan after DCP's planner (its dedup included); rank 0 carries tsckpt's notes.

        ``shared``: a rank's items share their ``TensorWriteData``; else no two items share an object.
        """
        full = [r for r in range(self.ranks) if self.nrows(r) > 0]
        plans = [SavePlan(self.items(r) if shared else as_sent(self.items(r)), planner_data=self.mappings)
                 for r in full]
        empty = self.ranks - len(full)
        if empty:
            shared = self.items(len(full))  # equal on every empty rank: the same objects serve them all
            plans += dedup_save_plans([SavePlan(shared, planner_data=self.mappings)] * empty)
        if with_notes:
            plans[0] = SavePlan(plans[0].items, storage_data=self.notes(), planner_data=self.mappings)
        return plans

    def metadata(self, sent: list[list[WriteItem]]) -> Metadata:
        """The global metadata DCP's planner hands ``finish``, with the chunks of the ranks whose items are given."""
        md = Metadata(state_dict_metadata={fqn: TensorStorageMetadata(self.props, self.size, []) for fqn in self.fqns},
                      planner_data=self.mappings)
        for items in sent:
            self.add_chunks(md, items)
        return md

    @staticmethod
    def add_chunks(md: Metadata, items: list[WriteItem]) -> None:
        """Add one rank's chunks (its items' own objects, as DCP's planner collects them)."""
        for item in items:
            md.state_dict_metadata[item.index.fqn].chunks.append(item.tensor_data.chunk)


def as_sent(items: list[WriteItem]) -> list[WriteItem]:
    """A rank's items as the coordinator holds them after unpickling them: no object shared between two items.

    Each object's ``__dict__`` is made, as unpickling makes it (CPython keeps
    fresh instances without one until something asks).
    """
    out = []
    for item in items:
        td = item.tensor_data
        if td is None:
            out.append(WriteItem(index=MetadataIndex(item.index.fqn), type=item.type))
            continue
        offsets = torch.Size(td.chunk.offsets)  # shared by index and chunk, as DCP's planner shares it
        index = MetadataIndex(item.index.fqn, offsets)
        chunk = ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(td.chunk.sizes))
        data = TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=td.properties.dtype),
                               size=torch.Size(td.size))
        made = WriteItem(index=index, type=item.type, tensor_data=data)
        for obj in (index, chunk, data, data.properties, made):
            vars(obj)
        out.append(made)
    return out


def sent_plan(plan: SavePlan, gathered: SavePlan, items: list[WriteItem]) -> SavePlan:
    """What DCP pickles for one rank: ``plan`` with ``items`` (:func:`as_sent`) if it lists the gathered items."""
    if type(plan) is SavePlan and plan.items and plan.items is gathered.items:
        return SavePlan(items, plan.storage_data, plan.planner_data, plan.usable)
    return plan  # pre-pickled, or without items


def tsckpt_results(items: list[WriteItem], r: int, layout: Any, save_id: str, tables: str | None = None) -> RankWrites:
    """What rank ``r``'s ``TensorStoreWriter.write_data`` returns: one columnar summary
    (each chunk where the packed layout stores it: back to back in the rank's data file). With ``tables`` (the
    save's staging directory), the rank's chunk table is written there at the end of its data file, as the
    rank writes it (the chunks before it are a hole: never read)."""
    numbers = {fqn: i for i, fqn in enumerate(layout.entries)}
    found_for: dict[tuple[Any, ...], list[int]] = {}
    tensor, chunk, length = [], [], []
    for item in items:
        entry = layout.entries[item.index.fqn]
        c = item.tensor_data.chunk
        key = (entry.shape, entry.chunk_shape, tuple(c.offsets), tuple(c.sizes))
        found = found_for.get(key)
        if found is None:  # every tensor has the same grid here: computed once per rank
            found = found_for[key] = [entry.grid.flat_index(i) for i, _ in entry.grid.chunks_within(c.offsets, c.sizes)]
        number = numbers[item.index.fqn]
        chunk += found
        tensor += [number] * len(found)
        length += [math.prod(entry.chunk_shape) * 2] * len(found)
    sizes = np.asarray(length, np.int64)
    offsets = np.zeros(len(sizes), np.int64)
    np.cumsum(sizes[:-1], out=offsets[1:])
    path = f"d/{save_id}-{r}"
    end, table = int(sizes.sum()), b""
    if tables is not None:
        names = list(layout.entries)
        paths = [layout.entries[names[t]].path for t in tensor]
        table = ChunkTable.of(paths, chunk, files=[path], where=[(0, int(o), int(n)) for o, n in zip(offsets, sizes)],
                              digests=[bytes(16)] * len(paths)).encode()
        os.makedirs(os.path.join(tables, "d"), exist_ok=True)
        with open(os.path.join(tables, path), "wb") as f:
            f.truncate(end)
            f.seek(end)
            f.write(table)
    summary = RankSummary(r, save_id, np.asarray(tensor, np.int32), np.asarray(chunk, np.int64),
                          np.zeros(len(sizes), np.int32), offsets, sizes, np.zeros(len(sizes), bool), (path,),
                          RankFiles((FileRef(path, end + len(table)),), Span(path, end, len(table))))
    return RankWrites([], summary)  # no WriteResult per item, as the writer returns


def direct_results(world: World, r: int, layout: Any, save_id: str) -> RankWrites:
    """What :func:`tsckpt_results` returns for rank ``r`` without a chunk table (the same summary, the same
    pickled bytes), built from the world's arithmetic instead of the rank's items: every tensor has the same
    layout, so the rank's chunks of one are its chunks of all. For worlds too large to build item by item."""
    entry = next(iter(layout.entries.values()))
    n = world.nrows(r)
    found = entry.grid.flat_indices_within((world.start(r), 0), (n, world.cols)) if n else np.zeros(0, np.int64)
    tensors = len(layout.entries)
    sizes = np.full(len(found) * tensors, math.prod(entry.chunk_shape) * 2, np.int64)
    offsets = np.zeros(len(sizes), np.int64)
    np.cumsum(sizes[:-1], out=offsets[1:])
    path = f"d/{save_id}-{r}"
    end = int(sizes.sum())
    summary = RankSummary(r, save_id, np.repeat(np.arange(tensors, dtype=np.int32), len(found)),
                          np.tile(found.astype(np.int64), tensors), np.zeros(len(sizes), np.int32), offsets, sizes,
                          np.zeros(len(sizes), bool), (path,), RankFiles((FileRef(path, end),), Span(path, end, 0)))
    return RankWrites([], summary)


def dcp_results(items: list[WriteItem], r: int) -> list[WriteResult]:
    """What rank ``r``'s ``FileSystemWriter.write_data`` returns: a result per item, with where its bytes went."""
    offset, results = 0, []
    for item in items:
        length = math.prod(item.tensor_data.chunk.sizes) * 2
        results.append(WriteResult(index=item.index, size_in_bytes=length,
                                   storage_data=_StorageInfo(f"__{r}_0.distcp", offset, length)))
        offset += length
    return results


def slices(n: int, size: int) -> Iterator[range]:
    for a in range(0, n, size):
        yield range(a, min(n, a + size))
