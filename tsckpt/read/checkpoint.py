"""Read a checkpoint in any plain process: no process group, no DCP, no torch needed.

``tsckpt.open(path)`` reads the root metadata document and nothing else. Each tensor is a lazy
:class:`TensorHandle`: metadata is free, and a slice reads only the chunks it overlaps. ``handle.numpy()``
never imports torch. ``ck.close()`` or a ``with`` block releases the TensorStore objects read data holds."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..commit import protocol as commit
from ..errors import IncompleteCheckpointError, NotACheckpointError, OptionError, TsckptError
from ..format import dtypes, object_values
from ..format.grid import ChunkGrid
from ..format.metadata import (CheckpointMetadata, DTensorPlacement, Mesh, ObjectEntry, Placement,
                               ReplicatedPlacement, ShardedTensorPlacement, TensorEntry)
from ..format.names import nest
from ..storage.box_reader import BoxReader
from ..storage.chunk_source import ChunkSource
from ..storage.context import DEFAULT_IO_CONCURRENCY
from ..storage.location import LocationLike
from ..storage.planned_box import PendingBox
from ..storage.store import Store, read_error
from .index import Index, bounding_box, normalize_index

if TYPE_CHECKING:
    import torch


class KeyNotFoundError(TsckptError, KeyError):
    """A key that is not in the checkpoint (also a ``KeyError``, as mappings raise)."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


def _placement_text(p: Mapping[str, Any]) -> str:
    texts = {"shard": f"Shard({p.get('dim')})", "partial": f"Partial({p.get('reduce_op', 'sum')})",
             "strided_shard": f"StridedShard({p.get('dim')}, sf={p.get('split_factor')})", "replicate": "Replicate()"}
    return texts.get(p.get("type"), str(p.get("type")))


@dataclass(frozen=True)
class PendingRead:
    """A read in flight: the box being read (checked as it completes), and what to select from it."""

    box: PendingBox
    rest: tuple[int | slice, ...]


class TensorHandle:
    """One stored tensor. Metadata is free; data is read on indexing, chunk by chunk."""

    def __init__(self, checkpoint: Checkpoint, key: str, entry: TensorEntry):
        self._ck, self.key, self.entry = checkpoint, key, entry
        self._box_reader: BoxReader | None = None
        self._lock = threading.Lock()

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
        return self.entry.grid

    def writers(self) -> dict[tuple[int, ...], int]:
        """Which rank saved each outer chunk, from the ranks' digest tables; empty when the save did not record it."""
        saved = self._ck.source.writers(self.entry)
        return {index: saved[flat] for flat, index in enumerate(self.chunks.indices()) if flat in saved}

    def close(self) -> None:
        """Release this tensor's open array (TensorStore handles and buffers); a later read opens it again."""
        with self._lock:
            self._box_reader = None

    def __enter__(self) -> TensorHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        if not self.entry.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.entry.shape[0]

    def __repr__(self) -> str:
        return (f"TensorHandle({self.key!r}, shape={list(self.shape)}, dtype={self.zarr_dtype}, "
                f"placement={self.placement_text})")

    def _reader(self) -> BoxReader:
        source = self._ck.source  # raises once the checkpoint is closed
        with self._lock:
            if self._box_reader is None:
                self._box_reader = BoxReader(source, self.entry, f"tensor {self.key!r} in {self._ck.url}")
            return self._box_reader

    def numpy(self, slice: Index | None = None) -> np.ndarray:  # noqa: A002 - mirrors handle[...]
        """The whole tensor, or ``slice`` of it, as numpy; reads only the chunks it overlaps."""
        return self.result(self.read_async(slice))

    def read_async(self, slice: Index | None = None) -> PendingRead:  # noqa: A002
        """Start reading; :meth:`result` of what it returns is the numpy array (lets many reads overlap)."""
        index = normalize_index(slice if slice is not None else (), self.entry.shape, self.key)
        box, rest = bounding_box(index, self.entry.shape)
        # The reader reads whole checksummed pieces and checks them, so every value returned is checked.
        return PendingRead(self._reader().start([b.start for b in box], [b.stop - b.start for b in box]), rest)

    def result(self, pending: PendingRead) -> np.ndarray:
        """Wait for a :meth:`read_async` read; a missing or damaged chunk raises naming the chunk."""
        try:
            data = pending.box.result()
        except ValueError as e:
            raise read_error(self.key, self._ck.url, e) from None
        return np.asarray(data[pending.rest])  # a 0-d result stays an array, as TensorStore gives it

    def __getitem__(self, index: Index) -> torch.Tensor:
        return dtypes.numpy_as_tensor(self.numpy(index))

    def torch(self) -> torch.Tensor:
        """The whole tensor as a CPU torch tensor."""
        return dtypes.numpy_as_tensor(self.numpy())


class Checkpoint(Mapping[str, Any]):
    """A committed checkpoint, opened for reading (by :func:`open`). Keys are DCP's flat keys: ``ck[key]`` is a
    :class:`TensorHandle` for tensors and the decoded value for everything else. :meth:`close` (or a ``with``
    block) releases its TensorStore objects."""

    def __init__(self, store: Store, metadata: CheckpointMetadata, *, allow_pickle: bool = False):
        self._store: Store | None = store
        self._source: ChunkSource | None = None
        self.location, self.metadata, self.allow_pickle = store.location, metadata, allow_pickle
        self._handles = {k: TensorHandle(self, k, e) for k, e in metadata.tensors.items()}

    @property
    def url(self) -> str:
        return self.location.url

    @property
    def store(self) -> Store:
        """The opened location: its TensorStore context and root kvstore."""
        if self._store is None:
            raise OptionError(f"checkpoint {self.url} is closed: open it again with tsckpt.open to read its data")
        return self._store

    @property
    def source(self) -> ChunkSource:
        """Where the tensors' bytes are read from (made on first use: a packed checkpoint's index is read then)."""
        if self._source is None:
            self._source = ChunkSource.of(self.store, self.metadata)
        return self._source

    @property
    def closed(self) -> bool:
        return self._store is None

    def close(self) -> None:
        """Release the checkpoint's TensorStore objects: its context, open arrays, a packed index. The metadata
        (keys, shapes, placements, plain values) stays; reading tensor data or a ``torch.save``'d value
        afterwards raises :class:`~tsckpt.errors.OptionError`. Idempotent."""
        for handle in self._handles.values():
            handle.close()
        self._source = None
        self._store = None

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
                f"{len(self.metadata.objects)} values, world_size={self.world_size}"
                + (", closed)" if self.closed else ")"))

    def to_state_dict(self) -> dict[str, Any]:
        """Everything as a nested dict of plain CPU tensors and values (reads all tensor data), nested by each
        entry's key path; integer path elements become list positions, as in DCP's own unflattening."""
        pending = [(h, h.read_async()) for h in self._handles.values()]  # all reads in flight at once
        flat = {h.entry.key_path: dtypes.numpy_as_tensor(h.result(read)) for h, read in pending}
        return nest(flat | {entry.key_path: self[key] for key, entry in self.metadata.objects.items()})

    def storage_stats(self) -> tuple[int, int | None]:
        """(number of stored files or objects, their total bytes; None where the store cannot tell)."""
        if self.location.driver == "file":
            root = str(self.location.spec["path"])
            sizes = [os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files]
            return len(sizes), sum(sizes)
        return len(self.store.kvstore.list().result()), None

    def _decode(self, key: str, entry: ObjectEntry) -> Any:
        if entry.encoding == object_values.JSON:
            return object_values.from_json(entry.value)
        assert entry.path is not None
        return object_values.load_torch_value(self.source.read_blob(key, entry.path), key=key, where=self.url,
                                              allow_pickle=self.allow_pickle)


def _suggest(key: str, keys: list[str]) -> str:
    import difflib
    close = difflib.get_close_matches(key, keys, n=3)
    return f"; did you mean {', '.join(map(repr, close))}?" if close else ""


def open(location: LocationLike, *, allow_pickle: bool = False,  # noqa: A001 - like zarr.open, tensorstore.open
         io_concurrency: int = DEFAULT_IO_CONCURRENCY) -> Checkpoint:
    """Open a committed checkpoint for reading, in any process (no process group needed).

    Reads only the root metadata document; arrays are opened when their data
    is first read. ``with tsckpt.open(path) as ck:`` (or ``ck.close()``)
    releases its TensorStore objects when you are done. Raises :class:`~tsckpt.errors.CheckpointNotFoundError` or
    :class:`~tsckpt.errors.IncompleteCheckpointError` like ``tsckpt.load``.

    Args:
        location: a path, URL or TensorStore kvstore spec.
        allow_pickle: decode non-tensor values that need arbitrary unpickling
            (code from the checkpoint may run). Off by default.
        io_concurrency: TensorStore file I/O concurrency for all reads.
    """
    try:
        store, md = commit.open_committed(location, io_concurrency=io_concurrency)
    except (IncompleteCheckpointError, NotACheckpointError) as e:
        from ..steps import run_directory_error

        raise run_directory_error(location, e) from None
    return Checkpoint(store, md, allow_pickle=allow_pickle)
