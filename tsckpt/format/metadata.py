"""The checkpoint's metadata document: frozen dataclasses that round-trip JSON.

The document lives in the root group's ``zarr.json`` under
``attributes["tsckpt"]``; writing it is the commit of a save. ``from_dict``
validates everything a hostile or broken file could get wrong, so code past it
can trust shapes, dtypes, paths and regions. Torch-free on purpose: inspecting a
checkpoint needs only numpy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from . import dtypes, values, zarr_json
from ..errors import MetadataError
from .grid import ChunkGrid
from .names import check_relative_path, parent_groups, zarr_path

FORMAT = "tsckpt"
FORMAT_VERSION = 2
#: Checkpoints of version 1 recorded every rank's region; version 2 records one
#: checksum table per tensor instead, so the document grows with tensors, not ranks.


def _ints(value: Any, what: str, *, minimum: int = 0) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= minimum for v in value
    ):
        raise MetadataError(f"{what}: expected a list of integers >= {minimum}, got {value!r}")
    return tuple(value)


def _get(d: Mapping[str, Any], key: str, what: str, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(d, Mapping):
        raise MetadataError(f"{what}: expected a JSON object, got {type(d).__name__}")
    if key not in d:
        raise MetadataError(f"{what}: missing field {key!r}")
    value = d[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise MetadataError(f"{what}: field {key!r} has the wrong type ({type(value).__name__})")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _dtype(name: str, what: str) -> str:
    if name not in dtypes.BY_ZARR:
        raise MetadataError(f"{what}: unknown data type {name!r}; expected one of {sorted(dtypes.BY_ZARR)}")
    return name


def _key_path(value: Any, what: str) -> tuple[str | int, ...]:
    if not isinstance(value, list) or not value or not all(
        isinstance(p, (str, int)) and not isinstance(p, bool) for p in value
    ):
        raise MetadataError(f"{what}: key_path must be a non-empty list of strings and integers")
    return tuple(value)


@dataclass(frozen=True)
class Region:
    """A box of the global tensor, and the rank that wrote it."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    rank: int

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "offsets": list(self.offsets), "sizes": list(self.sizes)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], what: str = "region") -> Region:
        return cls(
            offsets=_ints(_get(d, "offsets", what, list), what),
            sizes=_ints(_get(d, "sizes", what, list), what),
            rank=_get(d, "rank", what, int),
        )

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class Mesh:
    """A DeviceMesh as it was at save time."""

    shape: tuple[int, ...]
    dim_names: tuple[str, ...] | None
    device_type: str
    ranks: tuple[int, ...]  # mesh.mesh flattened in row-major order

    def to_dict(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "dim_names": list(self.dim_names) if self.dim_names is not None else None,
            "device_type": self.device_type,
            "ranks": list(self.ranks),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], what: str = "mesh") -> Mesh:
        names = d.get("dim_names") if isinstance(d, Mapping) else None
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise MetadataError(f"{what}: dim_names must be a list of strings or null")
        mesh = cls(
            shape=_ints(_get(d, "shape", what, list), what, minimum=1),
            dim_names=tuple(names) if names is not None else None,
            device_type=_get(d, "device_type", what, str),
            ranks=_ints(_get(d, "ranks", what, list), what),
        )
        if len(mesh.ranks) != math.prod(mesh.shape) or (
            mesh.dim_names is not None and len(mesh.dim_names) != len(mesh.shape)
        ):
            raise MetadataError(f"{what}: ranks or dim_names do not match shape {list(mesh.shape)}")
        return mesh


@dataclass(frozen=True)
class DTensorPlacement:
    """A DTensor's mesh (an index into ``CheckpointMetadata.meshes``) and placements.

    Each placement is a small JSON object: ``{"type": "shard", "dim": 0}``,
    ``{"type": "replicate"}``, ``{"type": "strided_shard", "dim": 0, "split_factor": 2}``
    or ``{"type": "partial", "reduce_op": "sum"}``.
    """

    kind: ClassVar[str] = "dtensor"
    mesh: int
    placements: tuple[Mapping[str, Any], ...]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "mesh": self.mesh, "placements": [dict(p) for p in self.placements]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], what: str) -> DTensorPlacement:
        placements = _get(d, "placements", what, list)
        if not all(isinstance(p, Mapping) and isinstance(p.get("type"), str) for p in placements):
            raise MetadataError(f"{what}: each placement must be an object with a 'type'")
        return cls(mesh=_get(d, "mesh", what, int), placements=tuple(placements))


@dataclass(frozen=True)
class ShardedTensorPlacement:
    """A ShardedTensor's shards: where each one sits and on which rank/device."""

    kind: ClassVar[str] = "sharded_tensor"
    shards: tuple[tuple[tuple[int, ...], tuple[int, ...], str], ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "shards": [{"offsets": list(o), "sizes": list(s), "placement": p} for o, s, p in self.shards],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], what: str) -> ShardedTensorPlacement:
        shards = tuple(
            (
                _ints(_get(s, "offsets", what, list), what),
                _ints(_get(s, "sizes", what, list), what),
                _get(s, "placement", what, str),
            )
            for s in _get(d, "shards", what, list)
        )
        return cls(shards=shards)


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
    kind = _get(d, "kind", what, str)
    if kind not in PLACEMENTS:
        raise MetadataError(f"{what}: unknown placement kind {kind!r}; expected one of {sorted(PLACEMENTS)}")
    return PLACEMENTS[kind].from_dict(d, what)


def _optional(d: Mapping[str, Any], key: str, what: str, kind: type) -> Any:
    return _get(d, key, what, kind) if d.get(key) is not None else None


@dataclass(frozen=True)
class ArrayOptions:
    """The codec choices shared by every tensor array of a checkpoint.

    Recorded in the root document so readers can open each array from the
    document alone, without reading (or trusting) its ``zarr.json``.
    """

    crc32c_codec: bool = False
    compression: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.crc32c_codec, bool):
            raise MetadataError(f"crc32c_codec must be True or False, not {self.crc32c_codec!r}")
        if self.compression is not None and self.compression not in zarr_json.COMPRESSORS:
            raise MetadataError(f"unknown compression {self.compression!r}: expected None or one of {sorted(zarr_json.COMPRESSORS)}")

    def to_dict(self) -> dict[str, Any]:
        return {"crc32c_codec": self.crc32c_codec, "compression": self.compression}

    @classmethod
    def from_dict(cls, d: Any, what: str = "array_options") -> ArrayOptions:
        return cls(crc32c_codec=_get(d, "crc32c_codec", what, bool),
                   compression=_optional(d, "compression", what, str))


@dataclass(frozen=True)
class TensorEntry:
    """One global tensor, stored as one Zarr v3 array at ``path``."""

    key_path: tuple[str | int, ...]
    path: str
    shape: tuple[int, ...]
    dtype: str  # Zarr data type name
    chunk_shape: tuple[int, ...]
    inner_chunk_shape: tuple[int, ...] | None
    placement: Placement | None
    #: base64 crc32c table, one value per outer chunk (``tsckpt.format.checksums``); None in version 1.
    checksums: str | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.from_zarr(self.dtype).itemsize

    @property
    def grid(self) -> ChunkGrid:
        return ChunkGrid(self.shape, self.chunk_shape, self.inner_chunk_shape)

    def to_dict(self) -> dict[str, Any]:
        return {
            "key_path": list(self.key_path),
            "path": self.path,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "chunk_shape": list(self.chunk_shape),
            "inner_chunk_shape": list(self.inner_chunk_shape) if self.inner_chunk_shape is not None else None,
            "placement": self.placement.to_dict() if self.placement else None,
            "checksums": self.checksums,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], what: str) -> TensorEntry:
        inner = d.get("inner_chunk_shape") if isinstance(d, Mapping) else None
        entry = cls(
            key_path=_key_path(_get(d, "key_path", what, list), what),
            path=check_relative_path(_get(d, "path", what, str), what=what),
            shape=_ints(_get(d, "shape", what, list), what),
            dtype=_dtype(_get(d, "dtype", what, str), what),
            chunk_shape=_ints(_get(d, "chunk_shape", what, list), what, minimum=1),
            inner_chunk_shape=_ints(inner, what, minimum=1) if inner is not None else None,
            placement=placement_from_dict(d.get("placement"), what),
            checksums=_optional(d, "checksums", what, str),
        )
        entry.validate(what)
        return entry

    def validate(self, what: str) -> None:
        if self.path != zarr_path(self.key_path):
            raise MetadataError(f"{what}: path {self.path!r} does not match key path {list(self.key_path)}")
        ndim = len(self.shape)
        if len(self.chunk_shape) != ndim:
            raise MetadataError(f"{what}: chunk_shape {list(self.chunk_shape)} has the wrong rank for shape {list(self.shape)}")
        if self.inner_chunk_shape is not None and (
            len(self.inner_chunk_shape) != ndim
            or any(c % i for c, i in zip(self.chunk_shape, self.inner_chunk_shape))
        ):
            raise MetadataError(f"{what}: inner_chunk_shape must divide chunk_shape {list(self.chunk_shape)}")
        if any(c > max(n, 1) for c, n in zip(self.chunk_shape, self.shape)):
            raise MetadataError(f"{what}: chunk_shape {list(self.chunk_shape)} is larger than shape {list(self.shape)}")
        # base64 of 4 bytes per chunk; decoding waits until a read needs it.
        if self.checksums is not None and len(self.checksums) != 4 * -(-4 * self.grid.nchunks // 3):
            raise MetadataError(f"{what}: the checksum table does not have one entry per chunk of "
                                f"shape {list(self.shape)} in chunks of {list(self.chunk_shape)}")


@dataclass(frozen=True)
class ObjectEntry:
    """A non-tensor value: inline JSON, or a torch-serialized blob array at ``path``."""

    key_path: tuple[str | int, ...]
    encoding: str
    value: Any = None  # the tagged JSON value, for encoding "json"
    path: str | None = None  # the uint8 array, for encoding "torch"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key_path": list(self.key_path), "encoding": self.encoding}
        if self.encoding == values.JSON:
            out["value"] = self.value
        else:
            out["path"] = self.path
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], what: str) -> ObjectEntry:
        key_path = _key_path(_get(d, "key_path", what, list), what)
        encoding = _get(d, "encoding", what, str)
        if encoding == values.JSON:
            return cls(key_path, encoding, value=d.get("value"))
        if encoding == values.TORCH:
            path = check_relative_path(_get(d, "path", what, str), what=what)
            if path != zarr_path(key_path):
                raise MetadataError(f"{what}: path {path!r} does not match key path {list(key_path)}")
            return cls(key_path, encoding, path=path)
        raise MetadataError(f"{what}: unknown encoding {encoding!r}; expected one of {list(values.ENCODINGS)}")


@dataclass(frozen=True)
class CheckpointMetadata:
    """Everything known about a checkpoint without reading any tensor data."""

    world_size: int
    tensors: Mapping[str, TensorEntry]
    objects: Mapping[str, ObjectEntry]
    meshes: tuple[Mesh, ...] = ()
    torch_version: str = ""
    tsckpt_version: str = ""
    created: str = ""
    version: int = FORMAT_VERSION
    extra: Mapping[str, Any] = field(default_factory=dict)
    #: The codecs every tensor array was written with; None in version 1 (read from each zarr.json).
    array_options: ArrayOptions | None = None
    #: How the arrays' keys are stored (``tsckpt.format.spec.LAYOUTS``): "plain" or "packed".
    layout: str = "plain"

    def to_dict(self) -> dict[str, Any]:
        # A plain checkpoint's document stays as before the packed layout existed.
        layout = {} if self.layout == "plain" else {"layout": self.layout}
        return {
            "format": FORMAT,
            "version": self.version,
            "tsckpt_version": self.tsckpt_version,
            "torch_version": self.torch_version,
            "created": self.created,
            "world_size": self.world_size,
            "meshes": [m.to_dict() for m in self.meshes],
            "tensors": {k: t.to_dict() for k, t in self.tensors.items()},
            "objects": {k: o.to_dict() for k, o in self.objects.items()},
            "extra": dict(self.extra),
            "array_options": self.array_options.to_dict() if self.array_options else None,
            **layout,
        }

    @classmethod
    def from_dict(cls, d: Any) -> CheckpointMetadata:
        what = "checkpoint metadata"
        if _get(d, "format", what, str) != FORMAT:
            raise MetadataError(f"{what}: 'format' is {d['format']!r}, expected {FORMAT!r}")
        version = _get(d, "version", what, int)
        if version > FORMAT_VERSION or version < 1:
            raise MetadataError(
                f"{what}: format version {version} is not supported by this tsckpt (reads 1..{FORMAT_VERSION})"
            )
        meshes = tuple(Mesh.from_dict(m, f"mesh {i}") for i, m in enumerate(_get(d, "meshes", what, list)))
        tensors = {
            k: TensorEntry.from_dict(v, f"tensor {k!r}") for k, v in _get(d, "tensors", what, dict).items()
        }
        objs = {k: ObjectEntry.from_dict(v, f"object {k!r}") for k, v in _get(d, "objects", what, dict).items()}
        for key, t in tensors.items():
            if isinstance(t.placement, DTensorPlacement) and not 0 <= t.placement.mesh < len(meshes):
                raise MetadataError(f"tensor {key!r}: mesh index {t.placement.mesh} out of range")
        paths = [t.path for t in tensors.values()] + [o.path for o in objs.values() if o.path]
        if len(set(paths)) != len(paths):
            raise MetadataError(f"{what}: two entries share one array path")
        clash = set(paths) & set(parent_groups(paths))
        if clash:
            raise MetadataError(f"{what}: {sorted(clash)[0]!r} is both an array and a group")
        extra = d.get("extra") or {}
        layout = d.get("layout", "plain")
        if not isinstance(layout, str):
            raise MetadataError(f"{what}: 'layout' must be a string, not {type(layout).__name__}")
        return cls(
            world_size=_get(d, "world_size", what, int),
            tensors=tensors,
            objects=objs,
            meshes=meshes,
            torch_version=str(d.get("torch_version", "")),
            tsckpt_version=str(d.get("tsckpt_version", "")),
            created=str(d.get("created", "")),
            version=version,
            extra=extra if isinstance(extra, dict) else {},
            array_options=ArrayOptions.from_dict(d["array_options"]) if d.get("array_options") is not None else None,
            layout=layout,
        )


def intern_placement(record: Mapping[str, Any] | None, meshes: list[Mesh], what: str) -> Placement | None:
    """A planner's placement record (mesh inline) as a Placement with a mesh index."""
    if record is None:
        return None
    if record.get("kind") == DTensorPlacement.kind:
        mesh = Mesh.from_dict(record.get("mesh"), what)
        if mesh not in meshes:
            meshes.append(mesh)
        return DTensorPlacement(mesh=meshes.index(mesh), placements=tuple(record.get("placements", ())))
    return placement_from_dict(record, what)
