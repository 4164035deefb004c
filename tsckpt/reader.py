"""Read a checkpoint in any plain process: no process group, no DCP, no torch needed.

``tsckpt.open(path)`` reads the root metadata document and nothing else. Each
tensor is a lazy :class:`TensorHandle`: its shape, dtype, placements and chunk
grid come from the metadata; its array is opened on first data access (one
shared TensorStore context for all of them) and a slice reads only the chunks
it overlaps. ``handle.numpy()`` never imports torch; ``handle[...]`` and
``handle.dtype`` do, on first use.
"""

from __future__ import annotations

import math
import os
import re
import itertools
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import EllipsisType
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorstore as ts

from . import dtypes, hierarchy, objects
from .errors import TsckptError
from .kvstore import DEFAULT_IO_CONCURRENCY, Location, LocationLike, make_context, open_kvstore, parse_location
from .metadata import (
    CheckpointMetadata,
    DTensorPlacement,
    Mesh,
    ObjectEntry,
    Placement,
    ReplicatedPlacement,
    ShardedTensorPlacement,
    TensorEntry,
)

if TYPE_CHECKING:
    import torch

Index = int | slice | EllipsisType | tuple[int | slice | EllipsisType, ...]


class KeyNotFoundError(TsckptError, KeyError):
    """A key that is not in the checkpoint (also a ``KeyError``, as mappings raise)."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class SelectionError(TsckptError, IndexError):
    """A slice that does not fit the tensor's shape (also an ``IndexError``)."""


@dataclass(frozen=True)
class ChunkGrid:
    """How a tensor's array is cut into files (chunks) and, inside them, inner chunks."""

    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    inner_chunk_shape: tuple[int, ...] | None = None

    @property
    def grid_shape(self) -> tuple[int, ...]:
        """Number of chunks along each dimension."""
        return tuple(math.ceil(n / c) if n else 0 for n, c in zip(self.shape, self.chunk_shape))

    @property
    def nchunks(self) -> int:
        return math.prod(self.grid_shape)

    @property
    def read_unit(self) -> tuple[int, ...]:
        """The smallest box a read fetches: the inner chunk when there is one."""
        return self.inner_chunk_shape or self.chunk_shape

    def chunk_region(self, index: tuple[int, ...]) -> tuple[slice, ...]:
        """The box of the tensor held by chunk ``index`` (clipped at the edges)."""
        return tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(index, self.chunk_shape, self.shape))

    def chunks_overlapping(self, region: tuple[slice, ...]) -> list[tuple[int, ...]]:
        """Indices of the chunks that a box of unit-step slices touches."""
        ranges = [range(s.start // c, (s.stop - 1) // c + 1) if s.stop > s.start else range(0)
                  for s, c in zip(region, self.chunk_shape)]
        return list(itertools.product(*ranges))

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "chunk_shape": list(self.chunk_shape),
                "inner_chunk_shape": list(self.inner_chunk_shape) if self.inner_chunk_shape else None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ChunkGrid:
        inner = d.get("inner_chunk_shape")
        return cls(tuple(d["shape"]), tuple(d["chunk_shape"]), tuple(inner) if inner else None)


def _placement_text(p: Mapping[str, Any]) -> str:
    kind = p.get("type")
    if kind == "shard":
        return f"Shard({p.get('dim')})"
    if kind == "strided_shard":
        return f"StridedShard({p.get('dim')}, sf={p.get('split_factor')})"
    if kind == "partial":
        return f"Partial({p.get('reduce_op', 'sum')})"
    return "Replicate()" if kind == "replicate" else str(kind)


class TensorHandle:
    """One stored tensor. Metadata is free; data is read on indexing, chunk by chunk."""

    def __init__(self, checkpoint: Checkpoint, key: str, entry: TensorEntry):
        self._ck = checkpoint
        self.key = key
        self.entry = entry
        self._store: ts.TensorStore | None = None
        self._lock = threading.Lock()

    # --- metadata only -----------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.shape

    @property
    def ndim(self) -> int:
        return len(self.entry.shape)

    @property
    def zarr_dtype(self) -> str:
        """The Zarr data type name, e.g. ``"bfloat16"``."""
        return self.entry.dtype

    @property
    def numpy_dtype(self) -> np.dtype:
        """The numpy dtype of :meth:`numpy` results (ml_dtypes for bf16 and float8)."""
        return dtypes.from_zarr(self.entry.dtype).numpy

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype (imports torch)."""
        return dtypes.to_torch_dtype(dtypes.from_zarr(self.entry.dtype))

    @property
    def nbytes(self) -> int:
        return self.entry.nbytes

    @property
    def numel(self) -> int:
        return math.prod(self.entry.shape)

    @property
    def placements(self) -> Placement | None:
        """How the tensor was distributed at save time, from the metadata."""
        return self.entry.placement

    @property
    def mesh(self) -> Mesh | None:
        """The DeviceMesh of a DTensor, else None."""
        p = self.entry.placement
        return self._ck.meshes[p.mesh] if isinstance(p, DTensorPlacement) else None

    @property
    def placement_text(self) -> str:
        """A one-line summary: ``[Shard(0), Shard(1)] on (dp=2, tp=2)``, ``ShardedTensor(5 shards)``..."""
        p = self.entry.placement
        if isinstance(p, DTensorPlacement):
            mesh = self._ck.meshes[p.mesh]
            dims = (f"{n}={s}" for n, s in zip(mesh.dim_names, mesh.shape)) if mesh.dim_names else map(str, mesh.shape)
            return f"[{', '.join(_placement_text(x) for x in p.placements)}] on mesh({', '.join(dims)})"
        if isinstance(p, ShardedTensorPlacement):
            return f"ShardedTensor({len(p.shards)} shards)"
        if isinstance(p, ReplicatedPlacement):
            return "replicated"
        return "-"

    @property
    def chunks(self) -> ChunkGrid:
        return ChunkGrid(self.entry.shape, self.entry.chunk_shape, self.entry.inner_chunk_shape)

    @property
    def writes(self) -> tuple[Any, ...]:
        """Which rank wrote which box (metadata ``writes``)."""
        return self.entry.writes

    def __len__(self) -> int:
        if not self.entry.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.entry.shape[0]

    def __repr__(self) -> str:
        return (f"TensorHandle({self.key!r}, shape={list(self.shape)}, dtype={self.zarr_dtype}, "
                f"placement={self.placement_text})")

    # --- data --------------------------------------------------------------
    def _array(self) -> ts.TensorStore:
        with self._lock:
            if self._store is None:
                self._store = self._ck._open_array(self.key, self.entry.path, self.entry.dtype, self.entry.shape)
            return self._store

    def numpy(self, slice: Index | None = None) -> np.ndarray:  # noqa: A002 - mirrors handle[...]
        """The whole tensor, or ``slice`` of it, as numpy; reads only the chunks it overlaps."""
        index = normalize_index(slice if slice is not None else (), self.entry.shape, self.key)
        try:
            return np.asarray(self._array()[index].read().result())
        except ValueError as e:
            raise TsckptError(f"reading tensor {self.key!r} from {self._ck.url} failed: {e}") from None

    def read_async(self, slice: Index | None = None) -> ts.Future:  # noqa: A002
        """Start reading; the future's result is the numpy array (lets many reads overlap)."""
        index = normalize_index(slice if slice is not None else (), self.entry.shape, self.key)
        return self._array()[index].read()

    def __getitem__(self, index: Index) -> torch.Tensor:
        return dtypes.numpy_as_tensor(self.numpy(index))

    def torch(self) -> torch.Tensor:
        """The whole tensor as a CPU torch tensor."""
        return dtypes.numpy_as_tensor(self.numpy())


def normalize_index(index: Index, shape: tuple[int, ...], key: str = "") -> tuple[int | slice, ...]:
    """numpy-style ``index`` as non-negative, in-range ints and slices for TensorStore.

    TensorStore reads negative coordinates literally (its domains may start
    below zero), so numpy's "count from the end" must be resolved here.
    """
    items = index if isinstance(index, tuple) else (index,)
    if sum(i is Ellipsis for i in items) > 1:
        raise SelectionError(f"tensor {key!r}: an index can only have one '...'")
    if Ellipsis in items:
        at = next(n for n, i in enumerate(items) if i is Ellipsis)
        fill = len(shape) - (len(items) - 1)
        items = items[:at] + (slice(None),) * max(fill, 0) + items[at + 1:]
    if len(items) > len(shape):
        raise SelectionError(f"tensor {key!r}: {len(items)} indices for a tensor of shape {list(shape)}")
    out: list[int | slice] = []
    for dim, (item, n) in enumerate(zip(items, shape)):
        if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            i = int(item) + n if item < 0 else int(item)
            if not 0 <= i < n:
                raise SelectionError(f"tensor {key!r}: index {item} is out of range for dim {dim} of size {n}")
            out.append(i)
        elif isinstance(item, slice):
            start, stop, step = item.indices(n)
            if step <= 0:
                raise SelectionError(f"tensor {key!r}: slice steps must be positive (dim {dim}), as in torch")
            out.append(slice(start, max(start, stop), step))
        else:
            raise SelectionError(f"tensor {key!r}: unsupported index {item!r} (ints, slices and ... only)")
    return tuple(out)


def parse_index(text: str) -> tuple[int | slice, ...]:
    """``"0:4,2"`` -> ``(slice(0, 4), 2)``; the command-line form of an index."""
    out: list[Any] = []
    for part in (p.strip() for p in text.split(",")):
        if part in ("...", "…"):
            out.append(Ellipsis)
        elif ":" in part:
            bits = part.split(":")
            if len(bits) > 3 or not all(re.fullmatch(r"-?\d*", b.strip()) for b in bits):
                raise SelectionError(f"cannot parse {part!r} in index {text!r}: expected start:stop[:step]")
            out.append(slice(*(int(b) if b.strip() else None for b in bits)))
        elif re.fullmatch(r"-?\d+", part):
            out.append(int(part))
        else:
            raise SelectionError(f"cannot parse {part!r} in index {text!r}: expected an integer or start:stop")
    return tuple(out)


class Checkpoint(Mapping[str, Any]):
    """A committed checkpoint, opened for reading. Keys are DCP's flat keys.

    ``ck[key]`` is a :class:`TensorHandle` for tensors and the decoded value
    for everything else. Created by :func:`open`.
    """

    def __init__(self, location: Location, metadata: CheckpointMetadata, kvstore: ts.KvStore,
                 context: ts.Context, *, allow_pickle: bool = False):
        self.location = location
        self.metadata = metadata
        self.allow_pickle = allow_pickle
        self._kv = kvstore
        self._context = context
        self._handles = {k: TensorHandle(self, k, e) for k, e in metadata.tensors.items()}

    @property
    def url(self) -> str:
        return self.location.url

    @property
    def world_size(self) -> int:
        return self.metadata.world_size

    @property
    def meshes(self) -> tuple[Mesh, ...]:
        return self.metadata.meshes

    @property
    def mesh(self) -> Mesh | None:
        """The first DeviceMesh of the save (most checkpoints have exactly one), or None."""
        return self.metadata.meshes[0] if self.metadata.meshes else None

    @property
    def tensors(self) -> Mapping[str, TensorHandle]:
        return self._handles

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (what a full load would read, before chunk overheads)."""
        return sum(t.nbytes for t in self.metadata.tensors.values())

    def __iter__(self) -> Iterator[str]:
        yield from self.metadata.tensors
        yield from self.metadata.objects

    def __len__(self) -> int:
        return len(self.metadata.tensors) + len(self.metadata.objects)

    def __contains__(self, key: object) -> bool:
        return key in self.metadata.tensors or key in self.metadata.objects

    def __getitem__(self, key: str) -> Any:
        if key in self._handles:
            return self._handles[key]
        if key in self.metadata.objects:
            return self._decode(key, self.metadata.objects[key])
        raise KeyNotFoundError(f"no key {key!r} in checkpoint {self.url}{_suggest(key, list(self))}")

    def __repr__(self) -> str:
        return (f"Checkpoint({self.url!r}, {len(self.metadata.tensors)} tensors, "
                f"{len(self.metadata.objects)} values, world_size={self.world_size})")

    def to_state_dict(self) -> dict[str, Any]:
        """Everything as a nested dict of plain CPU tensors and values (reads all tensor data).

        Nesting follows each entry's key path; integer path elements become
        list positions, as DCP's own unflattening does.
        """
        pending = {k: h.read_async() for k, h in self._handles.items()}
        flat: dict[tuple[Any, ...], Any] = {}
        for key, fut in pending.items():
            try:
                flat[self.metadata.tensors[key].key_path] = dtypes.numpy_as_tensor(np.asarray(fut.result()))
            except ValueError as e:
                raise TsckptError(f"reading tensor {key!r} from {self.url} failed: {e}") from None
        for key, entry in self.metadata.objects.items():
            flat[entry.key_path] = self[key]
        return _nest(flat)

    def storage_stats(self) -> tuple[int, int | None]:
        """(number of stored files or objects, their total bytes; None where the store cannot tell)."""
        if self.location.driver == "file":
            root = str(self.location.spec["path"])
            count = size = 0
            for dirpath, _, files in os.walk(root):
                for f in files:
                    count += 1
                    size += os.path.getsize(os.path.join(dirpath, f))
            return count, size
        return len(self._kv.list().result()), None

    # --- internals ---------------------------------------------------------
    def _open_array(self, key: str, path: str, zarr_dtype: str, shape: tuple[int, ...] | None) -> ts.TensorStore:
        # dtype and shape are checked against the array's zarr.json as it opens.
        spec = {"driver": "zarr3", "kvstore": self.location.child(path)}
        try:
            return ts.open(spec, context=self._context, open=True, read=True,
                           dtype=dtypes.from_zarr(zarr_dtype).numpy, shape=shape).result()
        except ValueError as e:
            raise TsckptError(
                f"cannot open the array of tensor {key!r} at {self.url}/{path} "
                f"(expected {zarr_dtype} {list(shape)}): {e}") from None

    def _decode(self, key: str, entry: ObjectEntry) -> Any:
        if entry.encoding == objects.JSON:
            return objects.from_json(entry.value)
        assert entry.path is not None
        blob = self._open_array(key, entry.path, "uint8", None).read().result()
        return objects.load_torch_value(blob.tobytes(), key=key, where=self.url, allow_pickle=self.allow_pickle)


def _suggest(key: str, keys: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(key, keys, n=3)
    return f"; did you mean {', '.join(map(repr, close))}?" if close else ""


def _nest(flat: dict[tuple[Any, ...], Any]) -> dict[str, Any]:
    root: dict[Any, Any] = {}
    for path, value in flat.items():
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return _lists(root)


def _lists(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    out = {k: _lists(v) for k, v in node.items()}
    keys = list(out)
    if keys and all(isinstance(k, int) for k in keys) and sorted(keys) == list(range(len(keys))):
        return [out[i] for i in range(len(keys))]
    return out


def open(  # noqa: A001 - tsckpt.open, like zarr.open / tensorstore.open
    location: LocationLike,
    *,
    allow_pickle: bool = False,
    io_concurrency: int = DEFAULT_IO_CONCURRENCY,
) -> Checkpoint:
    """Open a committed checkpoint for reading, in any process (no process group needed).

    Reads only the root metadata document; arrays are opened when their data
    is first read. Raises :class:`~tsckpt.errors.CheckpointNotFoundError` or
    :class:`~tsckpt.errors.IncompleteCheckpointError` like ``tsckpt.load``.

    Args:
        location: a path, URL or TensorStore kvstore spec.
        allow_pickle: decode non-tensor values that need arbitrary unpickling
            (code from the checkpoint may run). Off by default.
        io_concurrency: TensorStore file I/O concurrency for all reads.
    """
    loc = parse_location(location)
    context = make_context(io_concurrency, loc)
    kv = open_kvstore(loc, context)
    md = hierarchy.read_metadata(kv, loc.url)
    return Checkpoint(loc, md, kv, context, allow_pickle=allow_pickle)
