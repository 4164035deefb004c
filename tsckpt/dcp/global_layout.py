"""The coordinator's decision: which array each tensor of a save becomes (:func:`~tsckpt.format.plan.plan_tensor`),
and which arrays each rank writes (ranks writing the same tensors share one pre-pickled ``ArrayTable``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan

from ..errors import PlanError, UnsupportedDtypeError
from ..format import dtypes
from ..format.metadata import TensorEntry
from ..format.names import KeyPath, zarr_path
from ..format.plan import check_unique_paths, plan_tensor
from .contract import ArrayTable, PlacedArrays, PlannerNotes, Prepickled, fqn_digest
from .placed_writes import Placed, pieces


@dataclass(frozen=True)
class GlobalLayout:
    """Every array of a save and what each rank writes; tensors are numbered in the order of ``entries``."""

    entries: dict[str, TensorEntry]
    blobs: dict[str, str]  # non-tensor value -> its blob's path
    key_paths: dict[str, KeyPath]
    placements: dict[str, Mapping[str, Any]]
    tables: list[Prepickled[ArrayTable]]  # per rank
    objects: list[dict[str, str]]  # per rank: the values it writes, with their paths
    inner_chunk_bytes: int
    bands: bool  # whether sharded tensors are cut into bands (the layout's choice for the location)
    placed: Prepickled[PlacedArrays] | None = None  # the arrays of DTensors laid out from their placements

    @property
    def nchunks(self) -> list[int]:
        return [e.grid.nchunks for e in self.entries.values()]

    def check_planned(self, metadata: Metadata, where: str) -> None:
        """Refuse to commit arrays that are not the tensors DCP planned (e.g. a stale cached plan)."""
        expected = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        odd = sorted(set(self.entries) ^ expected)
        if odd:
            raise PlanError(f"saving {where}: tensor {odd[0]!r} is not in both DCP's plan and the planned arrays "
                            f"({len(odd)} such keys); nothing was committed")

    def key_path(self, fqn: str) -> KeyPath:
        return self.key_paths.get(fqn, (fqn,))

    @classmethod
    def plan(cls, plans: Sequence[SavePlan], inner_chunk_bytes: int, where: str, *,
             bands: bool = False) -> GlobalLayout:
        placements: dict[str, Mapping[str, Any]] = {}
        placed_records: dict[str, Mapping[str, Any]] = {}
        for p in plans:
            notes = PlannerNotes.of(p)  # only the ranks that describe tensors have any
            placements.update(notes.placements)
            placed_records.update(notes.arrays)
        # The arrays laid out from placements are numbered first: the root document lists tensors in this order.
        placed = _placed_entries(placed_records, placements, inner_chunk_bytes, bands, where)
        # One pass over every rank's items, flat lists per tensor: the coordinator's hot loop.
        boxes: dict[str, list[Any]] = {}  # fqn -> [write data, flat offsets+sizes, item count, number, first rank]
        first_holder: dict[str, int] = {}  # non-tensor value -> the first rank writing it
        rank_ids: list[list[int]] = []
        rank_objects: list[list[str]] = []
        for r, p in enumerate(plans):
            ids: list[int] = []
            objs: list[str] = []
            for item in p.items:
                td = item.tensor_data
                fqn = item.index.fqn
                if td is None:  # BYTE_IO
                    objs.append(fqn)
                    first_holder.setdefault(fqn, r)
                    continue
                found = boxes.get(fqn)
                if found is None:
                    if fqn in placed:
                        raise PlanError(f"saving {where}: tensor {fqn!r} is both in rank {r}'s plan and laid out "
                                        f"from its placement (its ranks do not agree on its placements?)")
                    boxes[fqn] = found = [td, [], 0, len(placed) + len(boxes), r]
                found[1].extend((*td.chunk.offsets, *td.chunk.sizes))
                found[2] += 1
                ids.append(found[3])
            rank_ids.append(ids)
            rank_objects.append(objs)
        # A key's path in the state dict, as the first rank writing it maps it (DCP's planner_data).
        first_holder.update((fqn, found[4]) for fqn, found in boxes.items())
        key_paths = {fqn: key_path_of(plans[r].planner_data, fqn) for fqn, r in first_holder.items()}
        key_paths.update((fqn, e.key_path) for fqn, e in placed.items())
        entries: dict[str, TensorEntry] = dict(placed)
        for fqn, (td, flat, count, _, _) in boxes.items():
            try:
                dtype = dtypes.from_torch(td.properties.dtype).zarr
            except UnsupportedDtypeError as e:
                raise UnsupportedDtypeError(f"tensor {fqn!r} in {where}: {e}") from None
            entries[fqn] = plan_tensor(fqn, key_paths[fqn], td.size, dtype,
                                       np.array(flat, dtype=np.int64).reshape(count, 2, len(td.size)),
                                       inner_chunk_bytes=inner_chunk_bytes, bands=bands)
        columns = _Columns(entries)
        tables = _rank_tables(columns, rank_ids)
        placed_ids = np.arange(len(placed), dtype=np.int32)
        placed_table = Prepickled(PlacedArrays(tuple(placed), columns.table(placed_ids))) if placed else None
        blobs = {fqn: zarr_path(key_paths[fqn]) for objs in rank_objects for fqn in objs}
        check_unique_paths([e.path for e in entries.values()] + list(blobs.values()), where)
        return cls(entries=entries, blobs=blobs, key_paths=key_paths, placements=placements,
                   tables=tables, objects=[{f: blobs[f] for f in o} for o in rank_objects],
                   inner_chunk_bytes=inner_chunk_bytes, bands=bands, placed=placed_table)


def _placed_entries(records: Mapping[str, Mapping[str, Any]], placements: Mapping[str, Mapping[str, Any]],
                    inner_chunk_bytes: int, bands: bool, where: str) -> dict[str, TensorEntry]:
    """The arrays of the DTensors no plan lists, laid out from their placements (each distinct layout once)."""
    out: dict[str, TensorEntry] = {}
    planned: dict[tuple[Placed, str], TensorEntry] = {}
    for fqn, record in records.items():
        try:
            dtype = dtypes.from_torch_name(record["dtype"])
        except UnsupportedDtypeError as e:
            raise UnsupportedDtypeError(f"tensor {fqn!r} in {where}: {e}") from None
        if "world" in record:  # a plain tensor every rank holds: replicated over the world
            placed = Placed(tuple(record["shape"]), dtype.itemsize, (int(record["world"]),), (-1,))
        else:
            placed = Placed.from_record(record["shape"], dtype.itemsize, placements.get(fqn, {}))
        if placed is None:
            raise PlanError(f"saving {where}: tensor {fqn!r} has no placement a layout follows from "
                            f"({placements.get(fqn)!r})")
        template = planned.get((placed, dtype.zarr))
        if template is None:
            template = planned[(placed, dtype.zarr)] = plan_tensor(
                fqn, (fqn,), placed.shape, dtype.zarr, pieces(placed).boxes, inner_chunk_bytes=inner_chunk_bytes,
                bands=bands)
        key_path = tuple(record["key_path"])
        out[fqn] = dataclasses.replace(template, key_path=key_path, path=zarr_path(key_path))
    return out


def key_path_of(planner_data: Any, fqn: str) -> KeyPath:
    """Where ``fqn`` sits in the state dict, as DCP's flattening mapped it (a plan's ``planner_data``)."""
    found = planner_data.get(fqn) if isinstance(planner_data, Mapping) else None
    return tuple(found) if found is not None else (fqn,)


def _rank_tables(columns: _Columns, rank_ids: Sequence[Sequence[int]]) -> list[Prepickled[ArrayTable]]:
    shared: dict[bytes, Prepickled[ArrayTable]] = {}
    out = []
    for ids in rank_ids:
        unique = dict.fromkeys(ids)  # a rank with several shards of one tensor writes its array once
        order = np.fromiter(unique, np.int32, len(unique))
        table = shared.get(order.tobytes())
        if table is None:
            table = shared[order.tobytes()] = Prepickled(columns.table(order))
        out.append(table)
    return out


class _Columns:
    """Every array's layout in columns, computed once; :meth:`table` picks the rows of one rank's arrays."""

    def __init__(self, entries: Mapping[str, TensorEntry]):
        self.names = list(entries)
        self.listed = listed = list(entries.values())
        maxnd = max((len(e.shape) for e in listed), default=0)
        dims = np.zeros((len(listed), 3, maxnd), np.int64)
        for i, e in enumerate(listed):
            nd = len(e.shape)
            dims[i, 0, :nd], dims[i, 1, :nd] = e.shape, e.chunk_shape
            dims[i, 2, :nd] = e.inner_chunk_shape or 0
        self.ndims = np.array([len(e.shape) for e in listed], np.uint8)
        self.sharded = np.array([e.inner_chunk_shape is not None for e in listed], bool)
        if not dims.size or dims.max() < 2**31:
            dims = dims.astype(np.int32)  # half the bytes, for the shapes that occur
        self.dims = dims

    def table(self, order: np.ndarray) -> ArrayTable:
        return ArrayTable(ids=order, ndims=self.ndims[order], dims=self.dims[order], sharded=self.sharded[order],
                          dtypes=tuple(self.listed[i].dtype for i in order),
                          key_paths=tuple(self.listed[i].key_path for i in order),
                          digest=fqn_digest([self.names[i] for i in order]))
