"""The coordinator <-> rank contract of a save: what each side hands the other, beyond DCP's own plan items.

DCP runs a save as four collectives around the storage writer's methods. With
``TensorStoreWriter`` (and, optionally, tsckpt's :class:`~tsckpt.dcp.planner.SavePlanner`):

1. ``reset(checkpoint_id)``, ``storage_meta()``, ``set_up_storage_writer(is_coordinator, rank=r)``
   -- every rank. The coordinator alone begins the save
   (:func:`~tsckpt.commit.publication.begin_save`): it refuses what must not be
   replaced, fences off other saves and chooses where this save's data goes
   (a staging directory beside the target on a local filesystem, the target
   itself elsewhere). Nothing is written by any rank yet.
2. ``planner.create_local_plan()``, then ``writer.prepare_local_plan(plan)`` -- every rank;
   the plans are **gathered** to the coordinator. tsckpt's planner puts
   :class:`PlannerNotes` in ``storage_data``: the placement records of the
   tensors this rank describes; and it leaves out of the plan every DTensor
   whose placements give its layout (:mod:`tsckpt.dcp.placed_writes`), whose
   record (shape, dtype, key path) the lowest rank of its mesh sends instead,
   so that what is gathered grows with tensors plus ranks. DCP's own planner
   puts nothing there and lists every shard. The
   writer wraps it in the rank's :class:`~tsckpt.dcp.replica_writes.Holdings`,
   by which the coordinator finds replicas and spreads their writes.
3. ``planner.create_global_plan(plans)``, then ``writer.prepare_global_plan(plans)`` -- the
   coordinator only. (With DCP's plan caching on, DCP returns only the plans
   that changed; tsckpt's planner hands the writer every rank's full plan
   beside them, :class:`GlobalPlans`.) The writer lays out every array from
   all ranks' regions (:class:`~tsckpt.dcp.global_layout.GlobalLayout`) and returns, for each
   rank, that rank's plan with a :class:`RankPlan` as ``storage_data``: the
   whole :class:`WriteConfig`, the data location, and the layouts of the arrays
   *that rank* writes, pre-pickled (:class:`Prepickled`) once per distinct set
   of arrays, and one :class:`PlacedArrays` table shared by all ranks for the
   DTensors no plan lists. With DCP's plan caching, ranks whose plans did not change come
   back unusable. Every save writes to a new location, so each rank must
   hear of it: with tsckpt's planner, the empty plans carry only this save's
   :class:`NewOrders`; with another planner, the coordinator sends the ranks
   their cached plans again, pre-pickled, as it recalls them (:mod:`tsckpt.dcp.plan_cache`).
4. The plans are **scattered** (DCP pickles each rank's plan); every rank runs
   ``planner.finish_plan(plan)`` (tsckpt's applies :class:`NewOrders` to the
   plan DCP cached, and adds the rank's writes of the DTensors it left out),
   then ``writer.write_data(plan, planner)``. A rank
   writes only what its plan lists, only where its ``RankPlan`` says, and only
   as its ``WriteConfig`` says: its own writer's codec, checksum, layout and
   sync options are not used. It returns :class:`RankWrites`: no
   ``WriteResult`` (DCP only hands them to ``finish``), and a columnar :class:`RankSummary`
   (each outer chunk's tensor number, chunk index and, packed, where it is
   stored; each value's encoding; the rank's data files and digest table).
5. The results are **gathered**; ``writer.finish(metadata, results)`` runs on the coordinator:
   it checks that every rank wrote with this save's orders, merges the
   summaries (:class:`~tsckpt.dcp.merged_chunks.MergedChunks`, linear in chunks), checks that every
   chunk was written exactly once, writes every node (packed: the index of every value) and then the
   root document: the commit.
6. DCP **broadcasts** the metadata; every rank returns from ``dcp.save``.

What grows with the world size stays on the coordinator; what a rank receives
grows with what it writes.
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
    """A value pickled once on the coordinator and shared by many ranks' plans.

    DCP pickles every rank's plan separately; a shared value inside them would
    be pickled again for each rank. This one is pickled when it is made, and
    each rank's plan then only copies its bytes. It travels only within one
    save's process group, beside DCP's own pickled plans: nothing read from a
    checkpoint is ever unpickled here. The receiving rank unpickles
    it on first use.
    """

    __slots__ = ("_blob", "_value", "_loaded")

    def __init__(self, value: T):
        self._value, self._loaded = value, True
        self._blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_arrived, (self._blob,))

    @property
    def value(self) -> T:
        if not self._loaded:
            self._value, self._loaded = pickle.loads(self._blob), True
        return self._value  # type: ignore[return-value]


def _arrived(blob: bytes) -> Prepickled[Any]:
    """A :class:`Prepickled` as a rank receives it: its bytes, unpickled on first use."""
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

    def to_dict(self) -> dict[str, Any]:
        return {"layout": self.layout, "array_options": self.array_options.to_dict(), "checksums": self.checksums,
                "inner_chunk_bytes": self.inner_chunk_bytes, "sync_files": self.sync_files}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> WriteConfig:
        return cls(layout=d["layout"], array_options=ArrayOptions.from_dict(d["array_options"]),
                   checksums=d["checksums"], inner_chunk_bytes=d["inner_chunk_bytes"], sync_files=d["sync_files"])


@dataclass(frozen=True)
class PlannerNotes:
    """What tsckpt's planner adds to a rank's local plan, in ``storage_data`` (step 2).

    ``placements``: the placement record (mesh inline) of each tensor this rank describes.
    ``arrays``: of those, each DTensor whose layout its placements give
    (:mod:`tsckpt.dcp.placed_writes`): ``{"shape", "dtype", "key_path"}``,
    and ``"world"`` (the world size) for a plain tensor every rank holds.
    No rank's plan lists such a tensor's items; the coordinator lays out its
    array from this record alone.
    """

    placements: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    arrays: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @staticmethod
    def of(plan: SavePlan) -> PlannerNotes:
        return PlannerNotes.found(plan) or PlannerNotes()

    @staticmethod
    def found(plan: SavePlan) -> PlannerNotes | None:
        """The notes tsckpt's planner put in the plan (under the writer's :class:`Holdings`), if it did."""
        data = Holdings.unwrapped(plan.storage_data)
        return data if isinstance(data, PlannerNotes) else None


@dataclass(frozen=True, eq=False)
class GlobalPlans:
    """What tsckpt's caching planner hands the writer in step 3, on the coordinator, in every plan's ``storage_data``.

    ``plans``: every rank's full plan, as DCP's global planning made them (its
    ``global_plan``: the very list its plan cache keeps, while nothing
    changed), where the plans it returns leave out those of ranks whose plan
    did not change. ``cache_key``: the planner's class, whose saves share one
    cache in DCP. It stays on the coordinator: the writer replaces it before
    the plans are scattered.
    """

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
    """The layouts of the arrays one rank writes, in columns, in the order the rank's plan first names them.

    ``ids`` are the coordinator's numbers for the tensors (the rank reports
    chunks by them); ``dims[i]`` holds shape, chunk shape and inner chunk shape
    of array ``i``, padded to the largest rank, and ``sharded[i]`` whether it
    has inner chunks at all; ``digest`` is :func:`fqn_digest` of the keys in
    order, which the rank checks against its plan.
    """

    ids: np.ndarray  # int32 [n]
    ndims: np.ndarray  # uint8 [n]
    dims: np.ndarray  # int32 or int64 [n, 3, max ndim]
    sharded: np.ndarray  # bool [n]
    dtypes: tuple[str, ...]  # Zarr data type names
    key_paths: tuple[tuple[str | int, ...], ...]
    digest: int

    def to_dict(self) -> dict[str, Any]:
        return {"ids": self.ids.tolist(), "ndims": self.ndims.tolist(), "dims": self.dims.tolist(),
                "sharded": self.sharded.tolist(), "dtypes": list(self.dtypes),
                "key_paths": [list(k) for k in self.key_paths], "digest": self.digest}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ArrayTable:
        n = len(d["ids"])
        return cls(np.asarray(d["ids"], np.int32), np.asarray(d["ndims"], np.uint8),
                   np.asarray(d["dims"], np.int64).reshape(n, 3, -1), np.asarray(d["sharded"], bool),
                   tuple(d["dtypes"]), tuple(tuple(k) for k in d["key_paths"]), int(d["digest"]))

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
    """The arrays of the DTensors laid out from their placements (step 3): one table, the same for every rank.

    Each rank finds in it the arrays of the placed DTensors it holds and
    writes what :func:`~tsckpt.dcp.placed_writes.own_boxes` gives it.
    """

    names: tuple[str, ...]
    table: ArrayTable

    def entries(self) -> dict[str, tuple[int, TensorEntry]]:
        """Each array's key, with its coordinator number and layout."""
        return self.table.entries(self.names, "the placed arrays")


@dataclass(frozen=True)
class SaveOrders:
    """What every rank of one save is told alike: how to write, where, and which save this is."""

    config: WriteConfig
    location: Location
    save_id: str
    #: The base of an incremental save (:mod:`tsckpt.base_chunks`), when one was given.
    base: BaseChoice | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "location": _location_dict(self.location),
                "save_id": self.save_id,
                "base": None if self.base is None else {**dataclasses.asdict(self.base),
                                                        "location": _location_dict(self.base.location)}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SaveOrders:
        base = d.get("base")
        return cls(WriteConfig.from_dict(d["config"]), _location(d["location"]), d["save_id"],
                   None if base is None else BaseChoice(**{**base, "location": _location(base["location"])}))


def _location_dict(location: Location) -> dict[str, Any]:
    return {"spec": dict(location.spec), "context": dict(location.context)}


def _location(d: Mapping[str, Any]) -> Location:
    return Location(d["spec"], d["context"])


@dataclass(frozen=True)
class RankPlan:
    """What the coordinator tells one rank (step 3): the save's orders and the arrays this rank writes.

    ``orders`` is the same object in every rank's plan; ``arrays`` is shared by
    ranks that write the same tensors; ``placed``, the same object in every
    plan, holds the arrays of DTensors that no plan lists (:class:`PlacedArrays`).
    ``objects``: path of each non-tensor value this rank writes.
    """

    orders: Prepickled[SaveOrders]
    arrays: Prepickled[ArrayTable]
    objects: Mapping[str, str] = field(default_factory=dict)
    placed: Prepickled[PlacedArrays] | None = None

    def entries(self, fqns: Sequence[str], where: str) -> dict[str, tuple[int, TensorEntry]]:
        """Each tensor of the rank's plan (in plan order) with its coordinator number and array layout."""
        placed = self.placed.value.entries() if self.placed is not None else {}
        out = self.arrays.value.entries([f for f in fqns if f not in placed], where)
        out.update((f, placed[f]) for f in fqns if f in placed)
        return out

    @property
    def config(self) -> WriteConfig:
        return self.orders.value.config

    @property
    def location(self) -> Location:
        return self.orders.value.location


@dataclass(frozen=True)
class NewOrders:
    """Step 3 when DCP's cache found no plan changed and tsckpt's planner made them: only this save's orders.

    It rides on the empty plan DCP sends each rank; tsckpt's planner puts it
    into the rank's cached plan (whose arrays are still the coordinator's
    layout) in ``finish_plan``. A few hundred bytes per rank, whatever it writes.
    """

    orders: Prepickled[SaveOrders]

    def applied_to(self, cached: SavePlan) -> SavePlan | None:
        """The rank's cached plan with these orders; None if it holds no :class:`RankPlan` to update."""
        if not isinstance(cached.storage_data, RankPlan):
            return None
        return dataclasses.replace(cached, storage_data=dataclasses.replace(cached.storage_data, orders=self.orders))


class RankWrites(list):
    """One rank's answer to ``write_data``: a ``WriteResult`` list (empty: DCP only hands it to ``finish``),
    with the rank's summary beside it."""

    def __init__(self, results: Sequence[WriteResult], summary: RankSummary):
        super().__init__(results)
        self.summary = summary

    @staticmethod
    def summary_of(results: Sequence[WriteResult], save_id: str, where: str) -> RankSummary:
        """The summary of one rank's results, checked to be this save's."""
        summary = getattr(results, "summary", None)
        if not isinstance(summary, RankSummary):
            raise PlanError(f"saving {where}: a rank returned write results without tsckpt's summary "
                            f"(its storage writer is not a TensorStoreWriter?)")
        if summary.save_id != save_id and summary.failure is None:
            raise PlanError(f"saving {where}: rank {summary.rank} wrote with the orders of save {summary.save_id}, "
                            f"not of this save {save_id} (a stale cached plan?); nothing was committed")
        return summary
