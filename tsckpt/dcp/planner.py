"""DCP planners: what each rank saves and loads, and how it is described.

Planning is separate from storage (as in DCP): this module looks at DTensors,
ShardedTensors and plain values and turns them into write items annotated with
JSON-able placement records (:class:`~tsckpt.dcp.contract.PlannerNotes`); the
storage layer never sees a DTensor.

Save: DCP's default planning already yields one item per DTensor local shard,
per ShardedTensor shard and per plain value, and deduplicates replicas by
giving each duplicate to the rank with the fewest bytes so far; the writer
then balances them over all their replicas, cutting large ones into pieces
(:mod:`tsckpt.dcp.replica_writes`). On top of that tsckpt records each
tensor's mesh and placements, and stores plain values as readable JSON. Each
distributed tensor is described by one rank (the lowest of its mesh, or the
holder of its first shard), so what the coordinator gathers does not grow
with ranks x tensors. With DCP's own planner the plans carry no records and
tensors are saved without a placement; the writer still decodes plain values.

Load: DCP asks for each local shard's hyperslab in global coordinates (the
reader reports every tensor as one whole chunk); tsckpt's load planner adds
safe restoration of non-tensor values and refuses narrowing dtype casts.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from ..errors import LoadMismatchError, PlanError
from ..format import values
from .contract import GlobalPlans, NewOrders, PlannerNotes
from .torch_private import ShardedTensor, StridedShard, plan_caching_asked, set_element
from .values import DecodedValue, EncodedValue


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


class MeshRecords:
    """JSON records of the device meshes a state dict's DTensors live on, one per mesh object.

    A state dict has hundreds of DTensors on one or two meshes, and
    ``DeviceMesh.mesh`` rebuilds its rank tensor on every access (about 0.2 ms
    in torch 2.13): asking it once per mesh, not once per tensor, is most of
    what describing a small model's state costs. A shared record also pickles
    once.
    """

    def __init__(self) -> None:
        self._records: dict[int, tuple[dict[str, Any], int]] = {}

    def _get(self, mesh: Any) -> tuple[dict[str, Any], int]:
        known = self._records.get(id(mesh))
        if known is None:
            ranks = mesh.mesh.flatten().tolist()
            record = {
                "shape": list(mesh.shape),
                "dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
                "device_type": mesh.device_type,
                "ranks": ranks,
            }
            known = self._records[id(mesh)] = (record, min(ranks))
        return known

    def record(self, mesh: Any) -> dict[str, Any]:
        """The mesh's record: shape, dimension names, device type and ranks in row-major order."""
        return self._get(mesh)[0]

    def lowest_rank(self, mesh: Any) -> int:
        return self._get(mesh)[1]


def describe(obj: Any, meshes: MeshRecords | None = None) -> dict[str, Any] | None:
    """The JSON placement record of a state-dict value (None for non-tensors)."""
    if isinstance(obj, DTensor):
        mesh = (meshes or MeshRecords()).record(obj.device_mesh)
        return {"kind": "dtensor", "mesh": mesh, "placements": [_placement_record(p) for p in obj.placements]}
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


def describes(obj: Any, rank: int, meshes: MeshRecords | None = None) -> bool:
    """Whether ``rank`` is the one rank that describes ``obj``'s placement (every rank, for a plain tensor)."""
    if isinstance(obj, DTensor):
        return (meshes or MeshRecords()).lowest_rank(obj.device_mesh) == rank
    if isinstance(obj, ShardedTensor):
        shards = obj.metadata().shards_metadata
        return not shards or shards[0].placement is None or shards[0].placement.rank() == rank
    return True


def placement_records(planner: Any, rank: int) -> dict[str, dict[str, Any]]:
    """The placement records of the tensors ``rank`` describes, read from a planner's state dict.

    For DCP's own planner, whose plans carry no placements: it keeps the
    flattened state dict it plans from as ``planner.state_dict``, and the writer
    reports these records in the rank's summary (:mod:`tsckpt.dcp.contract`,
    step 4). One rank describes each tensor (:func:`describes`), so what the
    coordinator gathers does not grow with ranks x tensors. A planner without
    a state dict yields none, and those tensors are saved without a placement.
    """
    state = getattr(planner, "state_dict", None)
    if not isinstance(state, Mapping):
        return {}
    meshes = MeshRecords()
    out = {}
    for fqn, obj in state.items():  # not only what this rank writes: replicas are written by one rank
        if describes(obj, rank, meshes):
            record = describe(obj, meshes)
            if record is not None:
                out[fqn] = record
    return out


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planning plus placement records and JSON-readable values.

    Takes ``DefaultSavePlanner``'s arguments. With ``enable_plan_caching=True``,
    its global planning (on the coordinator) hands the writer every rank's full
    plan beside the ones DCP returns (:class:`~tsckpt.dcp.contract.GlobalPlans`),
    and each rank's ``finish_plan`` takes this save's orders into the plan DCP
    kept for it (:class:`~tsckpt.dcp.contract.NewOrders`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Whether DCP's plan cache is on for this planner (DCP keeps its own flag private).
        self.caches_plans = plan_caching_asked(*args, **kwargs)

    @property
    def cache_key(self) -> str:
        """Whose plans DCP's cache holds: one planner class's, as DCP keys its cache by class."""
        return f"{type(self).__module__}.{type(self).__qualname__}"

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        if not plan.usable:  # unchanged since DCP cached it
            return plan
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        plan = dataclasses.replace(plan, storage_data=PlannerNotes(placement_records(self, rank)))
        self.plan = plan
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = super().create_global_plan(all_plans)
        if self.caches_plans:
            # DCP returns only the plans that changed; it keeps every rank's full plan as ``global_plan``.
            full = GlobalPlans(self.global_plan, self.cache_key)
            plans = [dataclasses.replace(p, storage_data=full) for p in plans]
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        if not new_plan.usable and isinstance(new_plan.storage_data, NewOrders):
            # DCP's cache kept this rank's plan; the writer sent only this save's orders for it.
            updated = new_plan.storage_data.applied_to(plan)
            if updated is None:
                raise PlanError("the plan DCP cached on this rank carries no layout from tsckpt's writer; save once "
                                "with a planner that does not cache")
            self.plan = plan = updated
        return plan

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        if write_item.type != WriteItemType.BYTE_IO:
            return object
        encoding, payload = values.encode(object)
        if encoding == values.JSON:
            payload = json.dumps(payload, allow_nan=False).encode("utf-8")
        return EncodedValue(payload, encoding)


#: How many mismatched keys a load's error details; the others are counted.
MISMATCHES_SHOWN = 10

_ALLOWS = {"allow_partial_load": "pass allow_partial_load=True to skip keys the checkpoint does not have",
           "allow_dtype_cast": "pass allow_dtype_cast=True to allow casts that lose precision"}


class Mismatch(NamedTuple):
    """One way a state dict does not match the checkpoint."""

    key: str
    #: What is wrong, naming the key: "tensor 'model.w': checkpoint shape [4, 3] does not match ...".
    text: str
    #: The argument of ``tsckpt.load`` that allows it, or "".
    allowed_by: str = ""


def mismatch_message(problems: list[Mismatch]) -> str:
    """The error for every way a state dict does not match the checkpoint.

    One problem is one line. Several start with a line that names the keys
    (the first :data:`MISMATCHES_SHOWN` of them), then say what is wrong
    with each, one per line, so the first line is the one to read even
    inside DCP's exception, where it follows a rank's traceback.
    """
    allows = "; ".join(_ALLOWS[a] for a in dict.fromkeys(p.allowed_by for p in problems) if a)
    if len(problems) == 1:
        return problems[0].text + (f"; {allows}" if allows else "")
    shown, more = problems[:MISMATCHES_SHOWN], len(problems) - MISMATCHES_SHOWN
    first = (f"{len(problems)} keys of the state dict do not match the checkpoint: "
             + ", ".join(repr(p.key) for p in shown) + (f" and {more} more" if more > 0 else "")
             + (f"; {allows}" if allows else ""))
    return "\n".join([first] + [f"  {p.text}" for p in shown] + ([f"  and {more} more"] if more > 0 else []))


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
        problems: list[Mismatch] = []
        for fqn, obj in self.state_dict.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if md is None:
                if not self.allow_partial_load:
                    problems.append(Mismatch(fqn, f"key {fqn!r} of the state dict is not in the checkpoint",
                                             "allow_partial_load"))
                continue
            if isinstance(md, TensorStorageMetadata) != isinstance(obj, torch.Tensor):
                # Otherwise DCP would silently replace a tensor by a stored value, or fail obscurely.
                saved, asked = ("a tensor", "a non-tensor value") if isinstance(md, TensorStorageMetadata) \
                    else ("a non-tensor value", "a tensor")
                problems.append(Mismatch(fqn, f"key {fqn!r}: the checkpoint holds {saved} but the state dict has "
                                              f"{asked} ({type(obj).__name__}) there"))
            elif isinstance(md, TensorStorageMetadata):
                problems += self._check_tensor(fqn, md, obj)
        if problems:
            raise LoadMismatchError(mismatch_message(problems))
        return super().create_local_plan()

    def _check_tensor(self, fqn: str, md: TensorStorageMetadata, obj: torch.Tensor) -> list[Mismatch]:
        if tuple(md.size) != tuple(obj.size()):
            return [Mismatch(fqn, f"tensor {fqn!r}: checkpoint shape {list(md.size)} does not match the state "
                                  f"dict's {list(obj.size())}")]
        saved, dest = md.properties.dtype, obj.dtype
        if saved != dest and not _lossless(saved, dest) and not self.allow_dtype_cast:
            return [Mismatch(fqn, f"tensor {fqn!r}: loading {saved} into {dest} would lose precision",
                             "allow_dtype_cast")]
        return []

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        obj = value.value if isinstance(value, DecodedValue) else torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
