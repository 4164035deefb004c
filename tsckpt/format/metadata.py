"""The checkpoint's metadata document (``attributes["tsckpt"]`` of the root ``zarr.json``): frozen dataclasses
that round-trip JSON. ``from_dict`` validates everything a hostile or broken file could get wrong, so code
past it can trust shapes, dtypes, paths and regions."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import MetadataError, TsckptError, UnsupportedVersionError
from . import content_hashes, dtypes, object_values, writers, zarr_json
from .data_files import DataFiles, RankFiles
from .fields import MAX_NDIM, MAX_TENSOR_BYTES, get_field, optional_field, parse_shape
from .grid import ChunkGrid
# Placements are part of the document; re-exported so callers import the whole document from here.
from .distribution import (DTensorPlacement, Mesh, Placement, ReplicatedPlacement,  # noqa: F401
                           ShardedTensorPlacement, intern_placement, placement_from_dict)
from .names import check_relative_path, parent_groups, zarr_path
from .reuse import Reuse
from .versions import FORMAT, FORMAT_VERSION, refusal


#: Largest root ``zarr.json`` a reader parses, checked before reading it whole (``docs/format.md``, section 10).
MAX_DOCUMENT_BYTES = 256 << 20


def _dtype(name: str, what: str) -> str:
    if name not in dtypes.BY_ZARR:
        raise MetadataError(f"{what}: unknown data type {name!r}; expected one of {sorted(dtypes.BY_ZARR)}")
    return name


def _key_path(value: Any, what: str) -> tuple[str | int, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(p, (str, int)) and not isinstance(p, bool)
                                                           for p in value):
        raise MetadataError(f"{what}: key_path must be a non-empty list of strings and integers")
    if any("\ud800" <= c <= "\udfff" for p in value if isinstance(p, str) for c in p):  # lone surrogates (JSON escapes)
        raise MetadataError(f"{what}: key_path holds a string that is not valid Unicode")
    return tuple(value)


def _content_hash(d: Mapping[str, Any], what: str) -> str | None:
    name = optional_field(d, "content_hash", what, str)
    if name is not None and name != content_hashes.STORED_ALGORITHM:
        raise MetadataError(f"{what}: unknown content_hash {name!r}; expected {content_hashes.STORED_ALGORITHM!r}")
    return name


@dataclass(frozen=True)
class ArrayOptions:
    """The codec choices shared by every tensor array, recorded so that readers open each array without reading
    (or trusting) its ``zarr.json``."""

    crc32c_codec: bool = False
    compression: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.crc32c_codec, bool):
            raise MetadataError(f"crc32c_codec must be True or False, not {self.crc32c_codec!r}")
        if self.compression is not None and self.compression not in zarr_json.COMPRESSORS:
            raise MetadataError(f"unknown compression {self.compression!r}: expected None or one of "
                                f"{sorted(zarr_json.COMPRESSORS)}")

    def to_dict(self) -> dict[str, Any]:
        return {"crc32c_codec": self.crc32c_codec, "compression": self.compression}

    @classmethod
    def from_dict(cls, d: Any, what: str = "array_options") -> ArrayOptions:
        return cls(crc32c_codec=get_field(d, "crc32c_codec", what, bool),
                   compression=optional_field(d, "compression", what, str))


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
    #: Which rank saved each outer chunk (:mod:`tsckpt.format.writers`); None until the save commits.
    writers: str | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.from_zarr(self.dtype).itemsize

    @functools.cached_property  # not a field: equality and to_dict ignore it
    def grid(self) -> ChunkGrid:
        return ChunkGrid(self.shape, self.chunk_shape, self.inner_chunk_shape)

    def zarr_json(self, options: ArrayOptions, attributes: dict[str, Any] | None = None) -> dict[str, Any]:
        """The ``zarr.json`` of this tensor's array. Dimensions are named ``<array name>_<i>``: xarray needs
        names, and names unique to each array keep the tensors of one group from sharing a dimension."""
        leaf = self.path.rsplit("/", 1)[-1]
        return zarr_json.array_metadata(self.shape, self.dtype, self.chunk_shape, self.inner_chunk_shape, attributes,
                                        checksums=options.crc32c_codec, compression=options.compression,
                                        dimension_names=[f"{leaf}_{i}" for i in range(len(self.shape))])

    def writer_ranks(self, world_size: int, what: str) -> np.ndarray:
        """The rank that saved each outer chunk, by flat index (decoded anew: it may be long)."""
        if self.writers is None:
            raise MetadataError(f"{what}: it does not say which rank saved each chunk")
        return writers.decode(self.writers, self.grid.nchunks, world_size, what)

    def to_dict(self) -> dict[str, Any]:
        inner = self.inner_chunk_shape
        return {"key_path": list(self.key_path), "path": self.path, "shape": list(self.shape), "dtype": self.dtype,
                "chunk_shape": list(self.chunk_shape), "inner_chunk_shape": list(inner) if inner is not None else None,
                "placement": self.placement.to_dict() if self.placement else None,
                **({"writers": self.writers} if self.writers is not None else {})}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], what: str) -> TensorEntry:
        inner = d.get("inner_chunk_shape") if isinstance(d, Mapping) else None
        entry = cls(
            key_path=_key_path(get_field(d, "key_path", what, list), what),
            path=check_relative_path(get_field(d, "path", what, str), what=what),
            shape=parse_shape(get_field(d, "shape", what, list), what, "shape"),
            dtype=_dtype(get_field(d, "dtype", what, str), what),
            chunk_shape=parse_shape(get_field(d, "chunk_shape", what, list), what, "chunk_shape", minimum=1),
            inner_chunk_shape=parse_shape(inner, what, "inner_chunk_shape", minimum=1) if inner is not None else None,
            placement=placement_from_dict(d.get("placement"), what),
            writers=get_field(d, "writers", what, str),
        )
        if d.get("checksums") is not None or d.get("content_hashes") is not None:
            raise MetadataError(f"{what}: holds per-chunk tables, as only format versions 2 and 3 did (each chunk "
                                f"carries its own crc32c)")
        entry.validate(what)
        return entry

    def validate(self, what: str) -> None:
        if self.path != zarr_path(self.key_path):
            raise MetadataError(f"{what}: path {self.path!r} does not match key path {list(self.key_path)}")
        ndim, shape, chunk, inner = len(self.shape), list(self.shape), list(self.chunk_shape), self.inner_chunk_shape
        if ndim > MAX_NDIM:
            raise MetadataError(f"{what}: shape has {ndim} dimensions; at most {MAX_NDIM} are supported")
        if self.nbytes > MAX_TENSOR_BYTES:
            raise MetadataError(f"{what}: shape {shape} holds more than 2**63 bytes")
        if len(chunk) != ndim:
            raise MetadataError(f"{what}: chunk_shape {chunk} has the wrong rank for shape {shape}")
        if inner is not None:
            if len(inner) != ndim:
                raise MetadataError(f"{what}: inner_chunk_shape {list(inner)} has the wrong rank for shape {shape}")
            if any(i > c for c, i in zip(chunk, inner)):
                raise MetadataError(f"{what}: inner_chunk_shape {list(inner)} is larger than chunk_shape {chunk}")
            if any(i > max(n, 1) for i, n in zip(inner, shape)):
                raise MetadataError(f"{what}: inner_chunk_shape {list(inner)} is larger than shape {shape}")
        # Writers make each chunk at most the tensor (1 along empty dimensions), rounded up to
        # whole inner chunks; a larger one only makes readers allocate for elements that do not exist.
        limit = [max(n, 1) if inner is None else -(-max(n, 1) // inner[d]) * inner[d] for d, n in enumerate(shape)]
        if any(c > m for c, m in zip(chunk, limit)):
            raise MetadataError(f"{what}: chunk_shape {chunk} is larger than shape {shape}")
        if inner is not None and any(c % i for c, i in zip(chunk, inner)):
            raise MetadataError(f"{what}: inner_chunk_shape {list(inner)} does not divide chunk_shape {chunk}")
        if isinstance(self.placement, ShardedTensorPlacement):
            for at, size, _ in self.placement.shards:
                if len(at) != ndim or len(size) != ndim or any(o + s > n for o, s, n in zip(at, size, shape)):
                    raise MetadataError(f"{what}: shard at {list(at)} of size {list(size)} lies outside shape {shape}")


@dataclass(frozen=True)
class ObjectEntry:
    """A non-tensor value: inline JSON, or a torch-serialized blob array at ``path``."""

    key_path: tuple[str | int, ...]
    encoding: str
    value: Any = None  # the tagged JSON value, for encoding "json"
    path: str | None = None  # the uint8 array, for encoding "torch"
    writer: int | None = None  # the rank that saved the blob, for encoding "torch" (None until the save commits)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key_path": list(self.key_path), "encoding": self.encoding}
        if self.encoding == object_values.JSON:
            return out | {"value": self.value}
        return out | {"path": self.path} | ({"writer": self.writer} if self.writer is not None else {})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], what: str) -> ObjectEntry:
        key_path = _key_path(get_field(d, "key_path", what, list), what)
        encoding = get_field(d, "encoding", what, str)
        if encoding == object_values.JSON:
            if "value" not in d:
                raise MetadataError(f"{what}: missing field 'value'")
            try:
                object_values.from_json(d["value"])
            except MetadataError as e:
                raise MetadataError(f"{what}: value is not valid tagged JSON: {e}") from None
            except RecursionError:
                raise MetadataError(f"{what}: value is nested too deeply") from None
            return cls(key_path, encoding, value=d["value"])
        if encoding == object_values.TORCH:
            path = check_relative_path(get_field(d, "path", what, str), what=what)
            if path != zarr_path(key_path):
                raise MetadataError(f"{what}: path {path!r} does not match key path {list(key_path)}")
            writer = get_field(d, "writer", what, int)
            if writer < 0:
                raise MetadataError(f"{what}: writer {writer} is not a rank")
            return cls(key_path, encoding, path=path, writer=writer)
        raise MetadataError(f"{what}: unknown encoding {encoding!r}; expected one of {list(object_values.ENCODINGS)}")


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
    #: The codecs every tensor array was written with.
    array_options: ArrayOptions = ArrayOptions()
    #: How the arrays' keys are stored (:data:`tsckpt.storage.layouts.LAYOUTS`): "plain" or "packed".
    layout: str = "plain"
    #: The algorithm of the content hashes in the ranks' chunk tables (None when there are none).
    content_hash: str | None = None
    #: What an incremental save took from its base (None for a save without a base).
    reuse: Reuse | None = None
    #: The data files and digest tables each rank wrote, and the packed layout's index.
    data_files: DataFiles | None = None

    @property
    def codec_checksums(self) -> bool:
        """Whether every chunk carries its own crc32c (Zarr's codec): saved with checksums on."""
        return self.array_options.crc32c_codec

    def writer_files(self, key: str, index: tuple[int, ...]) -> RankFiles | None:
        """The data files of the rank that wrote chunk ``index`` of tensor or stored value ``key`` (None where
        the checkpoint has no data files or its metadata cannot say)."""
        if self.data_files is None:
            return None
        try:
            entry = self.tensors.get(key)
            rank = (self.objects[key].writer if entry is None
                    else int(entry.writer_ranks(self.world_size, key)[entry.grid.flat_index(index)]))
            return self.data_files.ranks[rank] if rank is not None else None
        except (TsckptError, KeyError, ValueError, IndexError):
            return None

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": self.version, "tsckpt_version": self.tsckpt_version,
                "torch_version": self.torch_version, "created": self.created, "world_size": self.world_size,
                "meshes": [m.to_dict() for m in self.meshes],
                "tensors": {k: t.to_dict() for k, t in self.tensors.items()},
                "objects": {k: o.to_dict() for k, o in self.objects.items()}, "extra": dict(self.extra),
                "array_options": self.array_options.to_dict(), "layout": self.layout,
                "content_hash": self.content_hash, "reuse": self.reuse.to_dict() if self.reuse else None,
                **({"data_files": self.data_files.to_dict()} if self.data_files is not None else {})}

    @classmethod
    def from_dict(cls, d: Any) -> CheckpointMetadata:
        what = "checkpoint metadata"
        if get_field(d, "format", what, str) != FORMAT:
            raise MetadataError(f"{what}: 'format' is {d['format']!r}, expected {FORMAT!r}")
        version = get_field(d, "version", what, int)
        if version != FORMAT_VERSION:
            raise UnsupportedVersionError(refusal(version))
        meshes = tuple(Mesh.from_dict(m, f"mesh {i}") for i, m in enumerate(get_field(d, "meshes", what, list)))
        tensors = {k: TensorEntry.from_dict(v, f"tensor {k!r}") for k, v in get_field(d, "tensors", what, dict).items()}
        objs = {k: ObjectEntry.from_dict(v, f"object {k!r}") for k, v in get_field(d, "objects", what, dict).items()}
        for key, t in tensors.items():
            if isinstance(t.placement, DTensorPlacement):
                if not 0 <= t.placement.mesh < len(meshes):
                    raise MetadataError(f"tensor {key!r}: mesh index {t.placement.mesh} out of range")
                if len(t.placement.placements) != len(meshes[t.placement.mesh].shape):
                    raise MetadataError(f"tensor {key!r}: {len(t.placement.placements)} placements for a "
                                        f"{len(meshes[t.placement.mesh].shape)}-d mesh")
        paths = [t.path for t in tensors.values()] + [o.path for o in objs.values() if o.path]
        if len(set(paths)) != len(paths):
            raise MetadataError(f"{what}: two entries share one array path")
        clash = set(paths) & set(parent_groups(paths))
        if clash:
            raise MetadataError(f"{what}: {sorted(clash)[0]!r} is both an array and a group")
        extra = d.get("extra") or {}
        world_size = get_field(d, "world_size", what, int)
        if world_size < 1:
            raise MetadataError(f"{what}: world_size {world_size} is not a positive number of ranks")
        odd = next((k for k, o in objs.items() if o.writer is not None and o.writer >= world_size), None)
        if odd is not None:
            raise MetadataError(f"object {odd!r}: writer {objs[odd].writer} is not one of the {world_size} ranks")
        # Absent means plain (docs/format.md, section 2).
        layout = optional_field(d, "layout", what, str) or "plain"
        return cls(world_size=world_size, tensors=tensors, objects=objs, meshes=meshes,
                   torch_version=str(d.get("torch_version", "")), tsckpt_version=str(d.get("tsckpt_version", "")),
                   created=str(d.get("created", "")), version=version, extra=extra if isinstance(extra, dict) else {},
                   array_options=ArrayOptions.from_dict(get_field(d, "array_options", what, dict)), layout=layout,
                   content_hash=_content_hash(d, what),
                   reuse=Reuse.from_dict(d["reuse"], f"{what}: reuse") if d.get("reuse") is not None else None,
                   data_files=_data_files(d, world_size, layout, what))


def _data_files(d: Mapping[str, Any], world_size: int, layout: str, what: str) -> DataFiles:
    """``data_files``: one record per rank, each file listed once, an index exactly where the layout has one."""
    files = DataFiles.from_dict(get_field(d, "data_files", what, dict), f"{what}: data_files")
    if len(files.ranks) != world_size:
        raise MetadataError(f"{what}: data_files lists {len(files.ranks)} ranks, world_size is {world_size}")
    paths = [f.path for f in files.files]
    if len(set(paths)) != len(paths):
        raise MetadataError(f"{what}: data_files lists a file twice")
    if files.index is not None and layout == "plain":
        raise MetadataError(f"{what}: data_files names an index, but the layout is not packed")
    if files.index is None and layout != "plain" and (d.get("tensors") or any(
            isinstance(o, Mapping) and o.get("path") for o in (d.get("objects") or {}).values())):
        raise MetadataError(f"{what}: a packed checkpoint with arrays names no index")
    return files

