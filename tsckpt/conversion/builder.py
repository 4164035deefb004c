"""Write a tsckpt checkpoint from one process, one tensor at a time, for producers that never hold the whole
state dict (format converters): what a one-process ``tsckpt.save`` would write, through the same planning, rank
writer and commit."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import OptionError, PlanError, UnsupportedDtypeError
from ..format import content_hashes, dtypes, object_values
from ..commit import protocol as commit
from ..format.metadata import ArrayOptions, CheckpointMetadata, ObjectEntry, ReplicatedPlacement, TensorEntry
from ..format.names import KeyPath, flat_key, parent_groups, zarr_path
from ..format.plan import DEFAULT_INNER_CHUNK_BYTES, plan_tensor
from ..storage.layouts import PACKED, default_layout
from ..storage.store import Store
from ..commit.protocol import begin_save
from ..storage.context import DEFAULT_IO_CONCURRENCY
from ..storage.location import LocationLike
from ..dcp.merged_chunks import MergedChunks, stored_values
from ..dcp.summary import SummaryBuilder
from ..rank_writer import RankWriter, WrittenChunks

if TYPE_CHECKING:
    import torch

DEFAULT_MAX_INFLIGHT_BYTES = 512 << 20


def as_key_path(key: str | Sequence[str | int]) -> KeyPath:
    """A state-dict key (``"model.w"`` stays one element) or a key path, as a tuple."""
    if isinstance(key, str):
        return (key,)
    path = tuple(key)
    if not path or not all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in path):
        raise OptionError(f"key path {key!r} must be a non-empty sequence of strings and integers")
    return path


class CheckpointBuilder:
    """Stream tensors and values into a new tsckpt checkpoint, then commit it.

    Each tensor is written as soon as it is added, with at most ``max_inflight_bytes`` waiting, so memory
    stays at about that budget plus the tensor being added. Nothing at the location changes before
    :meth:`commit`; a builder abandoned half-way leaves it as it was. Example::

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
        max_inflight_bytes: tensor bytes that may wait to be written before
            :meth:`add_tensor` blocks; the caller must not modify a tensor it added
            until :meth:`commit` returns.
        extra: JSON-able values recorded in the metadata's ``extra``.
        checksums: record a crc32c of every tensor chunk, as in :class:`tsckpt.TensorStoreWriter`.
        crc32c_codec: also store Zarr's ``crc32c`` codec with every chunk.
        layout: ``"plain"`` (one file per chunk) or ``"packed"`` (one data file
            and an OCDBT index), as in :class:`tsckpt.TensorStoreWriter`;
            ``None``: ``$TSCKPT_LAYOUT``, else packed.
    """

    def __init__(self, location: LocationLike, *, overwrite: bool = False,
                 inner_chunk_bytes: int = DEFAULT_INNER_CHUNK_BYTES,
                 max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES, io_concurrency: int = DEFAULT_IO_CONCURRENCY,
                 extra: Mapping[str, Any] | None = None, checksums: bool = True, crc32c_codec: bool = False,
                 layout: str | None = None):
        self.checksums = checksums
        self.array_options = ArrayOptions(crc32c_codec=checksums or crc32c_codec)
        self.save_id = uuid.uuid4().hex
        self.target = begin_save(location, save_id=self.save_id, overwrite=overwrite)
        self.location = self.target.location
        self.store = Store.open(self.target.data_location, io_concurrency=io_concurrency, layout=layout or default_layout())
        self._writer = RankWriter(self.store, 0, self.save_id, self.url, options=self.array_options,
                                  checksums=checksums, window=max_inflight_bytes, bound_host_sources=True)
        self.inner_chunk_bytes = inner_chunk_bytes
        self.extra = dict(extra or {})
        self._tensors: dict[str, TensorEntry] = {}
        self._objects: dict[str, ObjectEntry] = {}
        self._blob_sizes: dict[str, int] = {}
        self._paths: set[str] = set()
        self._groups: set[str] = set()
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
        self._writer.abandon()
        if not self._committed:
            self.target.abort()

    @property
    def url(self) -> str:
        return self.location.url

    def _claim(self, key_path: KeyPath) -> tuple[str, str]:
        """Reserve the flat key and array path of a new entry, refusing collisions."""
        if self._committed:
            raise OptionError(f"checkpoint {self.url} is already committed; nothing more can be added")
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
        self._writer.open({fqn: entry})
        self._writer.write(fqn, (0,) * len(shape), source)
        self._tensors[fqn] = entry
        return entry  # its checksum tables are filled in by the commit, once every write is done

    @staticmethod
    def _as_numpy(key_path: KeyPath, tensor: Any) -> np.ndarray:
        if isinstance(tensor, np.ndarray):
            return tensor
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise OptionError(f"{flat_key(key_path)!r}: add_tensor takes a torch.Tensor or numpy array, "
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
        encoding, payload = object_values.encode(value)
        if encoding == object_values.JSON:
            entry = ObjectEntry(key_path, object_values.JSON, value=payload)
        else:
            self._writer.write_blob(fqn, path, payload)
            self._blob_sizes[fqn] = len(payload)
            entry = ObjectEntry(key_path, object_values.TORCH, path=path, writer=0)
        self._objects[fqn] = entry
        return entry

    def flush(self) -> None:
        """Wait until every tensor added so far is written."""
        self._writer.flush()

    def commit(self) -> CheckpointMetadata:
        """Wait for all data, then write array, group and root documents (the commit)."""
        stored = self._writer.finish()
        summary = SummaryBuilder(0, self.save_id)
        names = list(self._tensors)
        for number, fqn in enumerate(names):
            summary.add(number, self._writer.written.get(fqn) or WrittenChunks())
        for fqn in self._blob_sizes:
            summary.add_object(fqn, object_values.TORCH, None, self._blob_sizes[fqn])
            summary.place_object(fqn, self._writer.blobs.get(fqn))
        done = summary.done(stored)
        written = MergedChunks.merge([done], [e.grid.nchunks for e in self._tensors.values()], names, self.url)
        blobs = {self._objects[f].path: (done.files[info["ref"][0]], info["ref"][1:])
                 for f, info in done.objects.items() if "ref" in info}
        packed = self.store.layout.name == PACKED
        md = commit.commit_checkpoint(
            self.store, save_id=self.save_id, world_size=1, tensors=written.writers(self._tensors),
            objects=self._objects, blob_sizes=self._blob_sizes, ranks=[stored],
            stored=stored_values(self._tensors, written, blobs) if packed else None,
            extra={**self.extra, "save_id": self.save_id}, options=self.array_options, target=self.target,
            content_hash=content_hashes.STORED_ALGORITHM if self.checksums else None)
        self._committed = True
        return md

    @property
    def nbytes(self) -> int:
        """Tensor bytes added so far."""
        return sum(e.nbytes for e in self._tensors.values())
