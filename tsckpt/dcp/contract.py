"""The coordinator <-> rank contract of a save: what each side hands the other, beyond DCP's own plan items.

DCP runs a save as collectives around the storage writer's methods; with ``TensorStoreWriter``:

1. ``reset``, ``storage_meta``, ``set_up_storage_writer``: every rank; nothing is written yet.
2. ``create_local_plan``, ``prepare_local_plan``: every rank; plans **gathered**. tsckpt's planner puts
   :class:`PlannerNotes` in ``storage_data`` (placement records; the DTensors laid out from their placements,
   :mod:`tsckpt.dcp.placed_writes`); the writer wraps it in its :class:`~tsckpt.dcp.replica_writes.Holdings`.
3. ``create_global_plan``, ``prepare_global_plan``: the coordinator begins the save
   (:func:`~tsckpt.commit.protocol.begin_save`), lays out every array
   (:class:`~tsckpt.dcp.global_layout.GlobalLayout`) and gives each rank a :class:`RankPlan`: the
   :class:`SaveOrders` and the layouts of the arrays that rank writes, each :class:`Prepickled` once per
   distinct set, plus one :class:`PlacedArrays` table. Plan caching: :mod:`tsckpt.dcp.plan_cache`.
4. Plans **scattered**; ``finish_plan``, then ``write_data`` writes what the plan lists, as its ``RankPlan``
   says, and returns :class:`RankWrites` (no ``WriteResult``; a columnar :class:`RankSummary`).
5. Results **gathered**; ``finish`` on the coordinator checks every rank wrote with this save's orders,
   merges the summaries (:class:`~tsckpt.dcp.merged_chunks.MergedChunks`), checks every chunk was written
   exactly once, writes every node, then the root document: the commit.
6. DCP **broadcasts** the metadata. What grows with the world size stays on the coordinator.
"""

from __future__ import annotations

import dataclasses
import pickle
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from ..errors import OptionError, PlanError
from ..base_chunks import BaseChoice
from ..storage.layouts import LAYOUTS
from ..format.metadata import ArrayOptions, TensorEntry
from .summary import RankSummary, SummaryBuilder  # noqa: F401 - part of the contract
from ..format.names import zarr_path
from ..storage.location import Location
from .replica_writes import Holdings

T = TypeVar("T")


class Prepickled(Generic[T]):
    """A value pickled once on the coordinator and shared by many ranks' plans, which then only copy its bytes.

    It travels only within one save's process group (nothing read from a checkpoint is unpickled here) and is
    unpickled on first use. Compressed, as it is copied once per rank: a table of 2,000 arrays is 17 KB, not
    178 KB (16 GB less copied and sent at 100,000 ranks).
    """

    __slots__ = ("_blob", "_value", "_loaded")

    def __init__(self, value: T):
        self._value, self._loaded = value, True
        self._blob = zlib.compress(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), 1)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_arrived, (self._blob,))

    @property
    def value(self) -> T:
        if not self._loaded:
            self._value, self._loaded = pickle.loads(zlib.decompress(self._blob)), True
        return self._value  # type: ignore[return-value]


def _arrived(blob: bytes) -> Prepickled[Any]:
    obj: Prepickled[Any] = Prepickled.__new__(Prepickled)
    obj._blob, obj._value, obj._loaded = blob, None, False
    return obj


@dataclass(frozen=True)
class WriteConfig:
    """How every rank of a save writes: the coordinator's writer options, sent to all ranks in their plans."""

    layout: str
    array_options: ArrayOptions = ArrayOptions()
    checksums: bool = True
    inner_chunk_bytes: int = 0
    sync_files: bool = True

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise OptionError(f"unknown layout {self.layout!r}: expected one of {sorted(LAYOUTS)}")


@dataclass(frozen=True)
class PlannerNotes:
    """What tsckpt's planner adds to a rank's local plan, in ``storage_data`` (step 2): ``placements``, the
    placement record of each tensor this rank describes; ``arrays``, of those, each one no plan lists
    (:mod:`tsckpt.dcp.placed_writes`): ``{"shape", "dtype", "key_path"}`` (+ ``"world"``: a plain tensor)."""

    placements: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    arrays: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @staticmethod
    def of(plan: SavePlan) -> PlannerNotes:
        return PlannerNotes.found(plan) or PlannerNotes()

    @staticmethod
    def found(plan: SavePlan) -> PlannerNotes | None:
        data = Holdings.unwrapped(plan.storage_data)
        return data if isinstance(data, PlannerNotes) else None


@dataclass(frozen=True, eq=False)
class GlobalPlans:
    """What tsckpt's caching planner hands the writer in step 3, in every plan's ``storage_data``: ``plans``,
    every rank's full plan (DCP's ``global_plan``; the plans it returns leave out unchanged ones); ``cache_key``,
    the planner's class, whose saves share one cache in DCP."""

    plans: list[SavePlan]
    cache_key: str

    @staticmethod
    def found(plans: Sequence[SavePlan]) -> GlobalPlans | None:
        data = plans[0].storage_data if plans else None
        return data if isinstance(data, GlobalPlans) else None


def fqn_digest(fqns: Sequence[str]) -> int:
    """A crc32 of a sequence of keys, to check that two sides list the same keys in the same order."""
    crc = 0
    for fqn in fqns:
        crc = zlib.crc32(fqn.encode("utf-8", "surrogatepass") + b"\0", crc)
    return crc


@dataclass(frozen=True)
class ArrayTable:
    """The layouts of the arrays one rank writes, in columns, in the order the rank's plan first names them;
    ``digest``: :func:`fqn_digest` of the keys, checked against the rank's plan."""

    ids: np.ndarray  # int32 [n]
    ndims: np.ndarray  # uint8 [n]
    dims: np.ndarray  # int32 or int64 [n, 3, max ndim]: shape, chunk shape, inner chunk shape (padded)
    sharded: np.ndarray  # bool [n]: has inner chunks
    dtypes: tuple[str, ...]  # Zarr data type names
    key_paths: tuple[tuple[str | int, ...], ...]
    digest: int

    def entries(self, fqns: Sequence[str], where: str) -> dict[str, tuple[int, TensorEntry]]:
        """Each of ``fqns`` (the rank's tensors in plan order) with its coordinator number and array layout."""
        if len(fqns) != len(self.ids) or fqn_digest(fqns) != self.digest:
            raise PlanError(f"saving {where}: this rank's plan does not list the {len(self.ids)} tensors the "
                            f"coordinator laid out for it (a planner changed the plan after global planning?)")
        out = {}
        for i, fqn in enumerate(fqns):
            nd = int(self.ndims[i])
            shape, chunk, inner = (tuple(int(x) for x in row[:nd]) for row in self.dims[i])
            key_path = self.key_paths[i]
            out[fqn] = (int(self.ids[i]), TensorEntry(
                key_path=key_path, path=zarr_path(key_path), shape=shape, dtype=self.dtypes[i], chunk_shape=chunk,
                inner_chunk_shape=inner if self.sharded[i] else None, placement=None))
        return out


@dataclass(frozen=True)
class PlacedArrays:
    """The arrays of the DTensors laid out from their placements (step 3): one table, the same for every rank."""

    names: tuple[str, ...]
    table: ArrayTable

    def entries(self) -> dict[str, tuple[int, TensorEntry]]:
        return self.table.entries(self.names, "the placed arrays")


@dataclass(frozen=True)
class SaveOrders:
    """What every rank of one save is told alike: how to write, where, and which save this is."""

    config: WriteConfig
    location: Location
    save_id: str
    #: The base of an incremental save (:mod:`tsckpt.base_chunks`), when one was given.
    base: BaseChoice | None = None


@dataclass(frozen=True)
class RankPlan:
    """What the coordinator tells one rank (step 3). ``orders`` and ``placed`` are the same object in every
    rank's plan; ``arrays`` is shared by ranks that write the same tensors; ``objects``: path of each value."""

    orders: Prepickled[SaveOrders]
    arrays: Prepickled[ArrayTable]
    objects: Mapping[str, str] = field(default_factory=dict)
    placed: Prepickled[PlacedArrays] | None = None

    def entries(self, fqns: Sequence[str], where: str) -> dict[str, tuple[int, TensorEntry]]:
        placed = self.placed.value.entries() if self.placed is not None else {}
        out = self.arrays.value.entries([f for f in fqns if f not in placed], where)
        out.update((f, placed[f]) for f in fqns if f in placed)
        return out


@dataclass(frozen=True)
class NewOrders:
    """Step 3 when DCP's cache found no plan changed and tsckpt's planner made them: only this save's orders,
    on the empty plan DCP sends each rank; tsckpt's ``finish_plan`` puts them into the rank's cached plan."""

    orders: Prepickled[SaveOrders]

    def applied_to(self, cached: SavePlan) -> SavePlan | None:
        if not isinstance(cached.storage_data, RankPlan):
            return None
        return dataclasses.replace(cached, storage_data=dataclasses.replace(cached.storage_data, orders=self.orders))


class RankWrites(list):
    """One rank's answer to ``write_data``: an empty ``WriteResult`` list, with the rank's summary beside it."""

    def __init__(self, results: Sequence[WriteResult], summary: RankSummary):
        super().__init__(results)
        self.summary = summary

    @staticmethod
    def summary_of(results: Sequence[WriteResult], save_id: str, where: str) -> RankSummary:
        summary = getattr(results, "summary", None)
        if not isinstance(summary, RankSummary):
            raise PlanError(f"saving {where}: a rank returned write results without tsckpt's summary "
                            f"(its storage writer is not a TensorStoreWriter?)")
        if summary.save_id != save_id and summary.failure is None:
            raise PlanError(f"saving {where}: rank {summary.rank} wrote with the orders of save {summary.save_id}, "
                            f"not of this save {save_id} (a stale cached plan?); nothing was committed")
        return summary
