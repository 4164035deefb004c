"""Write a tsckpt checkpoint from one process, one tensor at a time.

:class:`CheckpointBuilder` produces exactly what a single-process
``tsckpt.save`` of a state dict of plain tensors and values would: the same
array specs (:mod:`tsckpt.format.spec`), the same chunk grid and inner chunks
(:func:`tsckpt.format.plan.plan_tensor`), and the same metadata assembly and
commit (:func:`tsckpt.format.commit.commit_checkpoint`).
It exists for producers that never hold the whole state dict, such as format
converters: each tensor is written as soon as it is added and only a bounded
number of bytes (``max_inflight_bytes``) is waiting on TensorStore at any time,
so memory stays at about that budget plus the tensor being added.

Like a DCP save, nothing at the location changes until :meth:`CheckpointBuilder.commit`
writes the array, group and root documents and publishes them
(:mod:`tsckpt.format.target`): on a local filesystem the builder writes into
a staging directory beside the target and renames it into place, so a
builder abandoned half-way leaves the location as it was.
"""

from __future__ import annotations

import collections
import dataclasses
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import PlanError, TsckptError, UnsupportedDtypeError
from ..format import checksums, commit, dtypes, values, zarr_json
from ..format.metadata import ArrayOptions, CheckpointMetadata, ObjectEntry, ReplicatedPlacement, TensorEntry
from ..format.names import KeyPath, flat_key, parent_groups, zarr_path
from ..format.plan import DEFAULT_INNER_CHUNK_BYTES, plan_tensor
from ..format.batch import RankBatch
from ..format.region_writer import RegionWriter
from ..format.layouts import default_layout
from ..format.spec import Store
from ..format.target import begin_save
from ..location import DEFAULT_IO_CONCURRENCY, LocationLike

if TYPE_CHECKING:
    import torch

DEFAULT_MAX_INFLIGHT_BYTES = 512 << 20


def as_key_path(key: str | Sequence[str | int]) -> KeyPath:
    """A state-dict key (``"model.w"`` stays one element) or a key path, as a tuple."""
    if isinstance(key, str):
        return (key,)
    path = tuple(key)
    if not path or not all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in path):
        raise TsckptError(f"key path {key!r} must be a non-empty sequence of strings and integers")
    return path


class CheckpointBuilder:
    """Stream tensors and values into a new tsckpt checkpoint, then commit it.

    Example::

        with CheckpointBuilder("ckpt") as b:
            for name, t in tensors():
                b.add_tensor(("model", name), t)
            b.add_object(("step",), 1000)
        # committed on a clean exit from the block, never after an exception

    Args:
        location: checkpoint directory, ``file://`` URL or TensorStore kvstore spec.
        overwrite: replace a complete checkpoint (or data tsckpt did not write) already
            there; as in :class:`tsckpt.TensorStoreWriter`, the old one stays loadable
            until the new one is published on local filesystems.
        inner_chunk_bytes: the smallest inner chunk (Zarr sharding codec) a tensor
            is cut into, as in :class:`tsckpt.TensorStoreWriter`; 0 disables them.
        max_inflight_bytes: tensor bytes that may wait on TensorStore before
            :meth:`add_tensor` blocks; the caller must not modify a tensor it added
            until :meth:`commit` returns.
        extra: JSON-able values recorded in the metadata's ``extra``.
        checksums: record a crc32c of every tensor chunk, as in :class:`tsckpt.TensorStoreWriter`.
        crc32c_codec: also store Zarr's ``crc32c`` codec with every chunk.
        layout: ``"plain"`` (one file per chunk) or ``"packed"`` (an OCDBT
            database of a few large files), as in :class:`tsckpt.TensorStoreWriter`;
            ``None``: ``$TSCKPT_LAYOUT``, else plain.
    """

    def __init__(
        self,
        location: LocationLike,
        *,
        overwrite: bool = False,
        inner_chunk_bytes: int = DEFAULT_INNER_CHUNK_BYTES,
        max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
        io_concurrency: int = DEFAULT_IO_CONCURRENCY,
        extra: Mapping[str, Any] | None = None,
        checksums: bool = True,
        crc32c_codec: bool = False,
        layout: str | None = None,
    ):
        self.checksums = checksums
        self.array_options = ArrayOptions(crc32c_codec=crc32c_codec)
        self.save_id = uuid.uuid4().hex
        self.target = begin_save(location, save_id=self.save_id, overwrite=overwrite)
        self.location = self.target.location
        self.store = Store.open(self.target.data_location, io_concurrency=io_concurrency, layout=layout or default_layout())
        self._batch = RankBatch(self.store.layout, self.flush, 0, self.url)
        self.inner_chunk_bytes = inner_chunk_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.extra = dict(extra or {})
        self._tensors: dict[str, TensorEntry] = {}
        self._objects: dict[str, ObjectEntry] = {}
        self._blob_sizes: dict[str, int] = {}
        self._paths: set[str] = set()
        self._groups: set[str] = set()
        self._pending: collections.deque[tuple[str, Any, Any, int]] = collections.deque()
        self._inflight = 0
        self._committed = False

    def __enter__(self) -> CheckpointBuilder:
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is None:
            if not self._committed:
                self.commit()
            return
        # Not committed: wait for started writes, so no I/O outlives the tensors
        # they read, then drop the staged data (in place: only the claim goes).
        for _, fut, _, _ in self._pending:
            try:
                fut.result()
            except Exception:
                pass
        self._pending.clear()
        if not self._committed:
            self.target.abort()

    @property
    def url(self) -> str:
        return self.location.url

    def _claim(self, key_path: KeyPath) -> tuple[str, str]:
        """Reserve the flat key and array path of a new entry, refusing collisions."""
        if self._committed:
            raise TsckptError(f"checkpoint {self.url} is already committed; nothing more can be added")
        fqn, path = flat_key(key_path), zarr_path(key_path)
        if fqn in self._tensors or fqn in self._objects:
            raise PlanError(f"key {fqn!r} was added twice to {self.url}")
        parents = [g for g in parent_groups([path]) if g]
        if path in self._paths or path in self._groups or any(g in self._paths for g in parents):
            raise PlanError(f"key path {list(key_path)} of {fqn!r} collides with another entry's "
                            f"array or group {path!r} in {self.url}")
        self._paths.add(path)
        self._groups.update(parents)
        return fqn, path

    def add_tensor(self, key: str | Sequence[str | int], tensor: torch.Tensor | np.ndarray) -> TensorEntry:
        """Start writing one whole tensor (CPU torch tensor or numpy array) as its own array."""
        key_path = as_key_path(key)
        source = self._as_numpy(key_path, tensor)
        try:
            dt = dtypes.BY_ZARR[source.dtype.name]
        except KeyError:
            raise UnsupportedDtypeError(f"tensor {flat_key(key_path)!r} for {self.url}: dtype "
                                        f"{source.dtype} cannot be stored") from None
        fqn, path = self._claim(key_path)
        shape = tuple(int(n) for n in source.shape)
        # A DCP save records no write for an empty tensor; match it.
        whole = [((0,) * len(shape), shape)] if source.size else []
        entry = plan_tensor(fqn, key_path, shape, dt.zarr, whole, inner_chunk_bytes=self.inner_chunk_bytes,
                            placement=ReplicatedPlacement())
        written = None
        if source.size:
            writer = RegionWriter(self.store, {fqn: entry}, self.array_options, 0, self._batch)
            written = writer.write(fqn, (0,) * len(shape), source)
            # Chunks encoded here hold their own bytes; TensorStore's writes read the source itself.
            keep = (tensor, source) if written.crcs is None else None
            for i, fut in enumerate(written.futures):
                self._track(fqn, fut, keep, source.nbytes if i == 0 else 0)
            self._batch.wrote(fqn, source.nbytes)
        if self.checksums:
            units = entry.checksum_grid
            if written is not None and written.crcs is not None:
                found = (written.pieces, written.crcs)
            else:
                found = checksums.region_checksums(source, units, (0,) * len(shape)) if source.size else ([], [])
            entry = dataclasses.replace(entry, checksums=checksums.encode_table(units, *found))
        self._tensors[fqn] = entry
        return entry

    @staticmethod
    def _as_numpy(key_path: KeyPath, tensor: Any) -> np.ndarray:
        if isinstance(tensor, np.ndarray):
            return tensor
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise TsckptError(f"{flat_key(key_path)!r}: add_tensor takes a torch.Tensor or numpy array, "
                              f"got {type(tensor).__name__}; use add_object for other values")
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        try:
            return dtypes.tensor_as_numpy(t)
        except UnsupportedDtypeError as e:
            raise UnsupportedDtypeError(f"tensor {flat_key(key_path)!r}: {e}") from None

    def add_object(self, key: str | Sequence[str | int], value: Any) -> ObjectEntry:
        """Store a non-tensor value: inline JSON when it is plain data, else a torch.save blob."""
        key_path = as_key_path(key)
        fqn, path = self._claim(key_path)
        encoding, payload = values.encode(value)
        if encoding == values.JSON:
            entry = ObjectEntry(key_path, values.JSON, value=payload)
        else:
            blob = np.frombuffer(payload, dtype=np.uint8)
            arr = self._batch.bind(self.store.create(path, zarr_json.blob_metadata(blob.size)).result())
            self._track(fqn, arr.write(blob), blob, blob.size)
            self._batch.wrote(fqn, blob.size)
            self._blob_sizes[fqn] = int(blob.size)
            entry = ObjectEntry(key_path, values.TORCH, path=path)
        self._objects[fqn] = entry
        return entry

    def _track(self, fqn: str, fut: Any, keep_alive: Any, nbytes: int) -> None:
        self._pending.append((fqn, fut, keep_alive, nbytes))
        self._inflight += nbytes
        while self._pending and self._inflight > self.max_inflight_bytes:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        fqn, fut, _, nbytes = self._pending.popleft()
        self._inflight -= nbytes
        try:
            fut.result()
        except Exception as e:
            raise TsckptError(f"writing {fqn!r} to {self.url} failed: {e}") from e

    def flush(self) -> None:
        """Wait until every tensor added so far is written."""
        while self._pending:
            self._wait_oldest()

    def commit(self) -> CheckpointMetadata:
        """Wait for all data, then write array, group and root documents (the commit)."""
        self._batch.commit()
        self.flush()
        md = commit.commit_checkpoint(
            self.store, world_size=1, tensors=self._tensors, objects=self._objects, blob_sizes=self._blob_sizes,
            extra={**self.extra, "save_id": self.save_id}, options=self.array_options, target=self.target,
            writers={fqn: [0] * e.grid.nchunks for fqn, e in self._tensors.items()})
        self._committed = True
        return md

    @property
    def nbytes(self) -> int:
        """Tensor bytes added so far."""
        return sum(e.nbytes for e in self._tensors.values())
