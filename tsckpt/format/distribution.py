"""Placements: how a tensor was distributed when saved (DTensor mesh and placements, ShardedTensor shards).
Informative: loads reshard from the global array (``docs/format.md``, section 3)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import MetadataError
from .fields import get_field, parse_ints, parse_shape


@dataclass(frozen=True)
class Mesh:
    """A DeviceMesh as it was at save time."""

    shape: tuple[int, ...]
    dim_names: tuple[str, ...] | None
    device_type: str
    ranks: tuple[int, ...]  # mesh.mesh flattened in row-major order

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dim_names": list(self.dim_names) if self.dim_names is not None else None,
                "device_type": self.device_type, "ranks": list(self.ranks)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], what: str = "mesh") -> Mesh:
        names = d.get("dim_names") if isinstance(d, Mapping) else None
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise MetadataError(f"{what}: dim_names must be a list of strings or null")
        mesh = cls(shape=parse_shape(get_field(d, "shape", what, list), what, "shape", minimum=1),
                   dim_names=tuple(names) if names is not None else None,
                   device_type=get_field(d, "device_type", what, str),
                   ranks=parse_ints(get_field(d, "ranks", what, list), what))
        if len(mesh.ranks) != math.prod(mesh.shape) or (mesh.dim_names is not None
                                                         and len(mesh.dim_names) != len(mesh.shape)):
            raise MetadataError(f"{what}: ranks or dim_names do not match shape {list(mesh.shape)}")
        if len(set(mesh.ranks)) != len(mesh.ranks):
            raise MetadataError(f"{what}: ranks {list(mesh.ranks)} name one rank twice")
        return mesh


@dataclass(frozen=True)
class DTensorPlacement:
    """A DTensor's mesh (an index into ``CheckpointMetadata.meshes``) and placements, each a small JSON object:
    ``{"type": "shard", "dim": 0}``, ``{"type": "replicate"}``, ``{"type": "strided_shard", "dim": 0,
    "split_factor": 2}`` or ``{"type": "partial", "reduce_op": "sum"}``."""

    kind: ClassVar[str] = "dtensor"
    mesh: int
    placements: tuple[Mapping[str, Any], ...]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "mesh": self.mesh, "placements": [dict(p) for p in self.placements]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], what: str) -> DTensorPlacement:
        placements = get_field(d, "placements", what, list)
        if not all(isinstance(p, Mapping) and isinstance(p.get("type"), str) for p in placements):
            raise MetadataError(f"{what}: each placement must be an object with a 'type'")
        return cls(mesh=get_field(d, "mesh", what, int), placements=tuple(placements))


@dataclass(frozen=True)
class ShardedTensorPlacement:
    """A ShardedTensor's shards: where each one sits and on which rank/device."""

    kind: ClassVar[str] = "sharded_tensor"
    shards: tuple[tuple[tuple[int, ...], tuple[int, ...], str], ...]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind,
                "shards": [{"offsets": list(o), "sizes": list(s), "placement": p} for o, s, p in self.shards]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], what: str) -> ShardedTensorPlacement:
        return cls(shards=tuple((parse_ints(get_field(s, "offsets", what, list), what),
                                 parse_ints(get_field(s, "sizes", what, list), what),
                                 get_field(s, "placement", what, str)) for s in get_field(d, "shards", what, list)))


@dataclass(frozen=True)
class ReplicatedPlacement:
    """A plain tensor: every rank held all of it (written once, by one of them)."""

    kind: ClassVar[str] = "replicated"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], what: str) -> ReplicatedPlacement:
        return cls()


Placement = DTensorPlacement | ShardedTensorPlacement | ReplicatedPlacement
PLACEMENTS: dict[str, type[DTensorPlacement] | type[ShardedTensorPlacement] | type[ReplicatedPlacement]] = {
    cls.kind: cls for cls in (DTensorPlacement, ShardedTensorPlacement, ReplicatedPlacement)
}


def placement_from_dict(d: Any, what: str) -> Placement | None:
    if d is None:
        return None
    kind = get_field(d, "kind", what, str)
    if kind not in PLACEMENTS:
        raise MetadataError(f"{what}: unknown placement kind {kind!r}; expected one of {sorted(PLACEMENTS)}")
    return PLACEMENTS[kind].from_dict(d, what)


def intern_placement(record: Mapping[str, Any] | None, meshes: list[Mesh], what: str,
                     seen: dict[int, int]) -> Placement | None:
    """A planner's placement record (mesh inline) as a Placement with a mesh index. ``seen``: mesh record (by
    identity) -> index, kept across records, so a mesh record the planner shares among tensors is parsed once."""
    if record is None:
        return None
    if record.get("kind") == DTensorPlacement.kind:
        raw = record.get("mesh")
        index = seen.get(id(raw))
        if index is None:
            mesh = Mesh.from_dict(raw, what)
            if mesh not in meshes:
                meshes.append(mesh)
            index = seen[id(raw)] = meshes.index(mesh)
        return DTensorPlacement(mesh=index, placements=tuple(record.get("placements", ())))
    return placement_from_dict(record, what)
