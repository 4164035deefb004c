"""DCP save planning: write items with JSON placement records (:class:`~tsckpt.dcp.contract.PlannerNotes`),
plain values as readable JSON, and DTensors whose placements give their layout kept out of the gathered plans
(:mod:`tsckpt.dcp.placed_writes`). Each distributed tensor is described by one rank (the lowest of its mesh,
or the holder of its first shard), so what the coordinator gathers does not grow with ranks x tensors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from ..errors import PlanError
from ..format import dtypes, object_values
from .contract import GlobalPlans, NewOrders, PlannerNotes
from .global_layout import key_path_of
from .placed_writes import Held, Placed, own_boxes, shard_box
from .torch_private import ShardedTensor, StridedShard, plan_caching_asked


def _placement_record(p: Any) -> dict[str, Any]:
    if isinstance(p, StridedShard):
        return {"type": "strided_shard", "dim": p.dim, "split_factor": p.split_factor}
    if isinstance(p, Shard):
        return {"type": "shard", "dim": p.dim}
    if isinstance(p, Replicate):
        return {"type": "replicate"}
    if isinstance(p, Partial):
        return {"type": "partial", "reduce_op": str(p.reduce_op)}
    return {"type": "other", "repr": repr(p)}


def whole_tensor(dtype: torch.dtype, shape: Any) -> TensorStorageMetadata:
    """DCP's metadata of a tensor stored as one whole chunk, of which DCP then asks for exact hyperslabs."""
    size = torch.Size(shape)
    return TensorStorageMetadata(TensorProperties(dtype=dtype), size,
                                 [ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)])


class MeshRecords:
    """JSON records of the device meshes of a state dict's DTensors, one per mesh object: ``DeviceMesh.mesh``
    rebuilds its rank tensor on every access (about 0.2 ms), and a shared record pickles once."""

    def __init__(self) -> None:
        self._records: dict[int, tuple[dict[str, Any], int]] = {}

    def record(self, mesh: Any) -> dict[str, Any]:
        return self._get(mesh)[0]

    def lowest_rank(self, mesh: Any) -> int:
        return self._get(mesh)[1]

    def _get(self, mesh: Any) -> tuple[dict[str, Any], int]:
        if id(mesh) not in self._records:
            ranks = mesh.mesh.flatten().tolist()
            names = list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
            self._records[id(mesh)] = ({"shape": list(mesh.shape), "dim_names": names,
                                        "device_type": mesh.device_type, "ranks": ranks}, min(ranks))
        return self._records[id(mesh)]


def describe(obj: Any, meshes: MeshRecords | None = None) -> dict[str, Any] | None:
    """The JSON placement record of a state-dict value (None for non-tensors)."""
    if isinstance(obj, DTensor):
        mesh = (meshes or MeshRecords()).record(obj.device_mesh)
        return {"kind": "dtensor", "mesh": mesh, "placements": [_placement_record(p) for p in obj.placements]}
    if isinstance(obj, ShardedTensor):
        return {"kind": "sharded_tensor",
                "shards": [{"offsets": list(s.shard_offsets), "sizes": list(s.shard_sizes),
                            "placement": str(s.placement)} for s in obj.metadata().shards_metadata]}
    if isinstance(obj, torch.Tensor):
        return {"kind": "replicated"}
    return None


def describes(obj: Any, rank: int, meshes: MeshRecords | None = None) -> bool:
    """Whether ``rank`` is the one rank that describes ``obj``'s placement (every rank, for a plain tensor)."""
    if isinstance(obj, DTensor):
        return (meshes or MeshRecords()).lowest_rank(obj.device_mesh) == rank
    if isinstance(obj, ShardedTensor):
        shards = obj.metadata().shards_metadata
        return not shards or shards[0].placement is None or shards[0].placement.rank() == rank
    return True


def placement_records(planner: Any, rank: int, plain: bool = True) -> dict[str, dict[str, Any]]:
    """The records of the tensors of ``planner.state_dict`` that ``rank`` describes (``plain``: plain ones too)."""
    state = getattr(planner, "state_dict", None)
    if not isinstance(state, Mapping):
        return {}
    meshes = MeshRecords()
    out = {}
    for fqn, obj in state.items():  # not only what this rank writes: replicas are written by one rank
        if (plain or isinstance(obj, (DTensor, ShardedTensor))) and describes(obj, rank, meshes):
            record = describe(obj, meshes)
            if record is not None:
                out[fqn] = record
    return out


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planning plus placement records and JSON-readable values.

    Takes ``DefaultSavePlanner``'s arguments. Its plans leave out every DTensor placed by ``Shard``/``Replicate``
    alone (:mod:`tsckpt.dcp.placed_writes`). ``create_local_plan`` and ``finish_plan`` run on every rank,
    ``create_global_plan`` on the coordinator between them.

    ``values_group``: the save's process group (``tsckpt.save`` passes it). ``create_local_plan`` then checks
    with one ``all_gather`` of a digest that every rank holds alike plain values; if so, plain tensors are
    written like DTensors replicated over the group, other values by its first rank. Leave it out where plain
    values may differ or a collective may not run (``dcp.async_save`` plans in a background thread).
    With ``enable_plan_caching=True``, see :mod:`tsckpt.dcp.plan_cache`.
    """

    def __init__(self, *args: Any, values_group: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.values_group = values_group
        self.caches_plans = plan_caching_asked(*args, **kwargs)

    @property
    def cache_key(self) -> str:
        """Whose plans DCP's cache holds: one planner class's, as DCP keys its cache by class."""
        return f"{type(self).__module__}.{type(self).__qualname__}"

    def create_local_plan(self) -> SavePlan:
        """Every rank: DCP's local plan, less the DTensors whose placements give their layout (restored by
        :meth:`finish_plan`); the lowest rank of each one's mesh sends its record (:class:`PlannerNotes`)."""
        plan = super().create_local_plan()
        full = self.plan  # DCP keeps the rank's whole plan here, sent or not
        world = self._values_world()  # a collective when asked for: before any early return
        self._held = HeldShards.of(self.state_dict, full, world)
        if not plan.usable:  # unchanged since DCP cached it
            return plan
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        first = world is None or world[0] == 0  # the rank that sends what every rank holds alike
        placements = placement_records(self, rank, plain=first)
        planner_data = full.planner_data
        arrays = {fqn: self._held.record(fqn, self.state_dict[fqn], list(key_path_of(planner_data, fqn)))
                  for fqn in placements if self._held.held(fqn)}
        sent = [item for item in full.items if not self._held.held(item.index.fqn)
                and (first or item.type != WriteItemType.BYTE_IO)]
        if isinstance(planner_data, Mapping):
            planner_data = {item.index.fqn: planner_data[item.index.fqn] for item in sent
                            if item.index.fqn in planner_data}
        self.plan = dataclasses.replace(full, items=sent, storage_data=PlannerNotes(placements, arrays),
                                        planner_data=planner_data)
        return self.plan

    def _values_world(self) -> tuple[int, int] | None:
        """(this rank, world size) of ``values_group`` if every rank there holds the same plain values (keys,
        kinds, shapes, dtypes: one ``all_gather`` of a digest), else None."""
        group = self.values_group
        if group is None or not (dist.is_available() and dist.is_initialized()):
            return None
        size = dist.get_world_size(group)
        if size < 2:
            return None
        signature = sorted((fqn, type(obj).__name__, tuple(obj.shape) if isinstance(obj, torch.Tensor) else (),
                            str(obj.dtype) if isinstance(obj, torch.Tensor) else "")
                           for fqn, obj in self.state_dict.items()
                           if not isinstance(obj, (DTensor, ShardedTensor)))
        digest = hashlib.blake2b(repr(signature).encode(), digest_size=16).digest()
        digests: list[Any] = [None] * size
        dist.all_gather_object(digests, digest, group=group)
        return (dist.get_rank(group), size) if all(d == digest for d in digests) else None

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """Coordinator: DCP's global planning; the metadata then lists the tensors laid out from placements too."""
        plans, metadata = super().create_global_plan(all_plans)
        placed = {}
        for p in self.global_plan:  # every rank's full plan, even where DCP returns only those that changed
            notes = PlannerNotes.found(p)
            for fqn, record in (notes.arrays if notes is not None else {}).items():
                placed[fqn] = whole_tensor(getattr(torch, record["dtype"]), record["shape"])
        if placed:
            metadata = self.metadata = dataclasses.replace(
                metadata, state_dict_metadata={**metadata.state_dict_metadata, **placed})
        if self.caches_plans:
            # DCP returns only the plans that changed; it keeps every rank's full plan as ``global_plan``.
            full = GlobalPlans(self.global_plan, self.cache_key)
            plans = [dataclasses.replace(p, storage_data=full) for p in plans]
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """Every rank: the coordinator's plan for it, plus its writes of the DTensors it kept back."""
        plan = super().finish_plan(new_plan)
        if not new_plan.usable and isinstance(new_plan.storage_data, NewOrders):
            # DCP's cache kept this rank's plan; the writer sent only this save's orders for it.
            updated = new_plan.storage_data.applied_to(plan)
            if updated is None:
                raise PlanError("the plan DCP cached on this rank carries no layout from tsckpt's writer; save once "
                                "with a planner that does not cache")
            plan = updated
        held = getattr(self, "_held", None)
        if held is not None and held.items:
            plan = dataclasses.replace(plan, items=list(plan.items) + held.own_writes())
        self.plan = plan
        return plan

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        if write_item.type != WriteItemType.BYTE_IO:
            return object
        encoding, payload = object_values.encode(object)
        if encoding == object_values.JSON:
            payload = json.dumps(payload, allow_nan=False).encode("utf-8")
        return EncodedValue(payload, encoding)


class EncodedValue(io.BytesIO):
    """A non-tensor value this planner serialized, tagged with the encoding to record."""

    def __init__(self, data: bytes, encoding: str):
        super().__init__(data)
        self.encoding = encoding


def encode_bytes(data: io.BytesIO) -> tuple[str, Any]:
    """How the writer stores a value: ``(JSON, tagged value)`` or ``(TORCH, torch.save bytes)``. DCP's default
    planner's ``torch.save`` bytes are loaded with ``weights_only=True`` and stored as JSON if plain data."""
    raw = data.getvalue()
    if isinstance(data, EncodedValue):
        return data.encoding, json.loads(raw) if data.encoding == object_values.JSON else raw
    try:
        value = torch.load(io.BytesIO(raw), weights_only=True)
        return object_values.JSON, object_values.to_json(value)
    except Exception:  # not loadable without unpickling code, or not plain data
        return object_values.TORCH, raw


class HeldShards:
    """A rank's items of the tensors laid out from their placements (with ``world``, (rank, world size), plain
    tensors too), kept back from the gathered plan; ``finish_plan`` turns them into :func:`own_boxes`'s."""

    def __init__(self, items: list[WriteItem], held: dict[str, Held]):
        self.items, self._held = items, held

    @classmethod
    def of(cls, state: Mapping[str, Any], plan: SavePlan, world: tuple[int, int] | None = None) -> HeldShards:
        held: dict[str, Held] = {}
        meshes = MeshRecords()
        for fqn, obj in state.items():
            if isinstance(obj, DTensor):
                coordinate = obj.device_mesh.get_coordinate()
                record = describe(obj, meshes)
                placed = Placed.from_record(obj.shape, obj.dtype.itemsize, record) if coordinate is not None else None
                if placed is not None:
                    held[fqn] = Held(fqn, placed, tuple(coordinate), tuple(meshes.record(obj.device_mesh)["ranks"]))
            elif world is not None and isinstance(obj, torch.Tensor) and not isinstance(obj, ShardedTensor):
                rank, size = world
                held[fqn] = Held(fqn, Placed(tuple(obj.shape), obj.dtype.itemsize, (size,), (-1,)), (rank,),
                                 tuple(range(size)))
        return cls([item for item in plan.items if item.index.fqn in held], held)

    def held(self, fqn: str) -> bool:
        return fqn in self._held

    def record(self, fqn: str, obj: torch.Tensor, key_path: list[Any]) -> dict[str, Any]:
        out = {"shape": list(obj.shape), "dtype": dtypes.torch_name(obj.dtype), "key_path": key_path}
        if not isinstance(obj, DTensor):
            out["world"] = self._held[fqn].placed.mesh_shape[0]
        return out

    def own_writes(self) -> list[WriteItem]:
        """This rank's items of the held tensors: each shard whole, in pieces, or not at all."""
        boxes = own_boxes([self._held[item.index.fqn] for item in self.items])
        out = []
        for item in self.items:
            fqn = item.index.fqn
            held = self._held[fqn]
            chunk = item.tensor_data.chunk
            expected = shard_box(held.placed, held.coordinate)
            if expected != (tuple(chunk.offsets), tuple(chunk.sizes)):
                raise PlanError(f"tensor {fqn!r}: DCP plans this rank's shard at offsets={list(chunk.offsets)} "
                                f"sizes={list(chunk.sizes)}, its placements give offsets={list(expected[0])} "
                                f"sizes={list(expected[1])}")
            for offsets, sizes in boxes[fqn].tolist():
                if (tuple(offsets), tuple(sizes)) == expected:
                    out.append(item)
                    continue
                box = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                out.append(dataclasses.replace(item, tensor_data=dataclasses.replace(item.tensor_data, chunk=box)))
        return out
