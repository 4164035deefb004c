"""DCP planners: what each rank saves and loads, and how it is described.

Planning is separate from storage (as in DCP): this module looks at DTensors,
ShardedTensors and plain values and turns them into write items annotated with
JSON-able placement records (:mod:`tsckpt.dcp.protocol`); the storage layer never sees a DTensor.

Save: DCP's default planning already yields one item per DTensor local shard,
per ShardedTensor shard and per plain value, and deduplicates replicas by
giving each duplicate to the rank with the fewest bytes so far, which spreads
replicated writes over the replicas. On top of that tsckpt records each
tensor's mesh and placements, and stores plain values as readable JSON.
With DCP's own planner the writer gets the same records from
:func:`placement_records` while it writes, and decodes plain values itself.

Load: DCP asks for each local shard's hyperslab in global coordinates (the
reader reports every tensor as one whole chunk); tsckpt's load planner adds
safe restoration of non-tensor values and refuses narrowing dtype casts.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from ..errors import LoadMismatchError
from ..format import values
from .protocol import DecodedValue, EncodedValue, Placements


def _placement_record(p: Any) -> dict[str, Any]:
    if isinstance(p, _StridedShard):
        return {"type": "strided_shard", "dim": p.dim, "split_factor": p.split_factor}
    if isinstance(p, Shard):
        return {"type": "shard", "dim": p.dim}
    if isinstance(p, Replicate):
        return {"type": "replicate"}
    if isinstance(p, Partial):
        return {"type": "partial", "reduce_op": str(p.reduce_op)}
    return {"type": "other", "repr": repr(p)}


def describe(obj: Any, meshes: dict[int, dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """The JSON placement record of a state-dict value (None for non-tensors).

    ``meshes`` caches mesh records by mesh object: a state dict has hundreds of
    DTensors on one or two meshes, and a shared record also pickles once.
    """
    if isinstance(obj, DTensor):
        mesh = obj.device_mesh
        cache = {} if meshes is None else meshes
        if id(mesh) not in cache:
            cache[id(mesh)] = {
                "shape": list(mesh.shape),
                "dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
                "device_type": mesh.device_type,
                "ranks": mesh.mesh.flatten().tolist(),
            }
        return {"kind": "dtensor", "mesh": cache[id(mesh)],
                "placements": [_placement_record(p) for p in obj.placements]}
    if isinstance(obj, ShardedTensor):
        return {
            "kind": "sharded_tensor",
            "shards": [
                {"offsets": list(s.shard_offsets), "sizes": list(s.shard_sizes), "placement": str(s.placement)}
                for s in obj.metadata().shards_metadata
            ],
        }
    if isinstance(obj, torch.Tensor):
        return {"kind": "replicated"}
    return None


def _lossless(saved: torch.dtype, dest: torch.dtype) -> bool:
    """Whether every value of ``saved`` is exactly representable in ``dest``.

    Stricter than ``torch.promote_types``, which takes int64 -> float32 (or
    int32 -> float32) as widening although large integers round.
    """
    if torch.promote_types(saved, dest) != dest:
        return False
    if saved.is_floating_point or saved.is_complex or saved == torch.bool:
        return True
    if not (dest.is_floating_point or dest.is_complex):
        return True
    real = dest.to_real() if dest.is_complex else dest
    digits = round(-math.log2(torch.finfo(real).eps)) + 1  # significand bits, implicit one included
    info = torch.iinfo(saved)
    return info.bits - (1 if info.min < 0 else 0) <= digits


def placement_records(planner: Any, fqns: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The placement records of ``fqns``, read from the state dict a planner writes from.

    For plans that carry none (DCP's default planner): that planner keeps the
    flattened state dict as ``planner.state_dict``. A planner without one
    yields no records, and those tensors are saved without a placement.
    """
    state = getattr(planner, "state_dict", None)
    if not isinstance(state, Mapping):
        return {}
    meshes: dict[int, dict[str, Any]] = {}
    records = {fqn: describe(state.get(fqn), meshes) for fqn in fqns}
    return {fqn: r for fqn, r in records.items() if r is not None}


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planning plus placement records and JSON-readable values."""

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        placements: dict[str, Any] = {}
        meshes: dict[int, dict[str, Any]] = {}
        for fqn, obj in self.state_dict.items():
            record = describe(obj, meshes)
            if record is not None:
                placements[fqn] = record
        plan = dataclasses.replace(plan, storage_data=Placements(placements))
        self.plan = plan
        return plan

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        if write_item.type != WriteItemType.BYTE_IO:
            return object
        encoding, payload = values.encode(object)
        if encoding == values.JSON:
            payload = json.dumps(payload, allow_nan=False).encode("utf-8")
        return EncodedValue(payload, encoding)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planning, with safe values and checked dtypes.

    Args:
        allow_partial_load: keys of ``state_dict`` missing from the checkpoint are skipped.
        allow_dtype_cast: allow loading into a dtype that cannot hold every saved
            value (e.g. float32 -> bfloat16); widening casts are always allowed.
    """

    def __init__(self, *, allow_partial_load: bool = False, allow_dtype_cast: bool = False, **kwargs: Any):
        super().__init__(allow_partial_load=allow_partial_load, **kwargs)
        self.allow_dtype_cast = allow_dtype_cast

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        missing = [k for k in self.state_dict if k not in self.metadata.state_dict_metadata]
        if missing and not self.allow_partial_load:
            raise LoadMismatchError(
                f"{len(missing)} key(s) of the state dict are not in the checkpoint, e.g. {missing[0]!r}; "
                "pass allow_partial_load=True to skip them"
            )
        for fqn, obj in self.state_dict.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if md is None:
                continue
            if isinstance(md, TensorStorageMetadata) != isinstance(obj, torch.Tensor):
                # Otherwise DCP would silently replace a tensor by a stored value, or fail obscurely.
                saved, asked = ("a tensor", "a non-tensor value") if isinstance(md, TensorStorageMetadata) \
                    else ("a non-tensor value", "a tensor")
                raise LoadMismatchError(f"key {fqn!r}: the checkpoint holds {saved} but the state dict has {asked} "
                                        f"({type(obj).__name__}) there")
            if isinstance(md, TensorStorageMetadata):
                self._check_tensor(fqn, md, obj)
        return super().create_local_plan()

    def _check_tensor(self, fqn: str, md: TensorStorageMetadata, obj: torch.Tensor) -> None:
        if tuple(md.size) != tuple(obj.size()):
            raise LoadMismatchError(
                f"tensor {fqn!r}: checkpoint shape {list(md.size)} does not match the state dict's {list(obj.size())}"
            )
        saved, dest = md.properties.dtype, obj.dtype
        if saved != dest and not _lossless(saved, dest) and not self.allow_dtype_cast:
            raise LoadMismatchError(
                f"tensor {fqn!r}: loading {saved} into {dest} would lose precision; "
                "pass allow_dtype_cast=True to allow it"
            )

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        obj = value.value if isinstance(value, DecodedValue) else torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
