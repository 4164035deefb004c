"""DCP storage layer: ``TensorStoreWriter`` and ``TensorStoreReader``.

Moves bytes between state-dict tensors and Zarr v3 arrays through TensorStore.
It knows regions, dtypes and paths, never DTensors: placements arrive as JSON
records from the planner. See ``docs/format.md`` for what ends up on disk.
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import json
import os
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorstore as ts
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from . import __version__, arrays, dtypes, grid, hierarchy, objects
from .errors import PlanError, TsckptError, UnsupportedDtypeError
from .kvstore import (
    DEFAULT_IO_CONCURRENCY,
    Location,
    make_context,
    open_kvstore,
    parse_location,
    unsynced_nodes,
)
from .layout import zarr_path
from .metadata import CheckpointMetadata, ObjectEntry, Region, TensorEntry, intern_placement
from .planner import DecodedValue

#: Outer chunks larger than this are split into inner chunks (sharding codec).
DEFAULT_INNER_CHUNK_BYTES = 16 << 20
PathLike = str | os.PathLike[str] | Mapping[str, Any]


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


def _region(offsets: Any, sizes: Any) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes))


@dataclasses.dataclass(frozen=True)
class _RankPlan:
    """What the coordinator tells one rank: its arrays' layout and its values' paths."""

    arrays: dict[str, TensorEntry]
    objects: dict[str, str]


class _TensorStoreIO:
    """What the writer and reader share: a location and one lazily made context."""

    def __init__(self, path: PathLike | None, io_concurrency: int):
        self.location: Location | None = parse_location(path) if path is not None else None
        self.io_concurrency = io_concurrency
        self._context: ts.Context | None = None

    @property
    def checkpoint_id(self) -> str | None:
        return self.location.url if self.location else None

    def _reset(self, checkpoint_id: PathLike | None) -> None:
        if checkpoint_id is not None:
            self.location = parse_location(checkpoint_id)
        if self.location is None:
            raise TsckptError("no checkpoint location: pass a path to the constructor or checkpoint_id=")

    @property
    def context(self) -> ts.Context:
        if self._context is None:
            self._context = make_context(self.io_concurrency, self.location)
        return self._context

    def _kvstore(self) -> ts.KvStore:
        assert self.location is not None
        return open_kvstore(self.location, self.context)

    def _array_spec(self, path: str, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
        assert self.location is not None
        # Every chunk is stored, even all-zero ones, and a missing chunk is an
        # error on read rather than silently read back as fill values.
        spec: dict[str, Any] = {"driver": "zarr3", "kvstore": self.location.child(path),
                                "store_data_equal_to_fill_value": True, "fill_missing_data_reads": False}
        if metadata is not None:
            spec |= {"metadata": metadata, "assume_metadata": True}
        return spec

    def __getstate__(self) -> dict[str, Any]:
        # TensorStore handles do not pickle; async_save's process mode pickles the writer.
        return {**self.__dict__, "_context": None}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: PathLike) -> bool:
        try:
            parse_location(checkpoint_id)
        except TsckptError:
            return False
        return True


class TensorStoreWriter(_TensorStoreIO, StorageWriter):
    """Write a DCP checkpoint as a Zarr v3 hierarchy, one array per global tensor.

    Args:
        path: checkpoint directory (or a kvstore spec); may instead be given as
            ``checkpoint_id=`` to ``dcp.save``.
        overwrite: replace a complete checkpoint already at ``path``; otherwise
            saving there raises :class:`~tsckpt.errors.CheckpointExistsError`.
        inner_chunk_bytes: outer chunks above this size are stored with Zarr's
            sharding codec and inner chunks of about this size, so later partial
            reads fetch only what they need. 0 disables it.
        io_concurrency: TensorStore file I/O concurrency per rank.
        checksums: store a crc32c with every tensor chunk, checked on every
            read, so flipped bits fail the load instead of loading silently. Off
            by default: TensorStore's crc32c runs at about 2 GB/s per core; it
            added 17% to a 4-rank save's CPU time and 36% to a one-process
            save's wall time on the benchmark machine (README).
            Missing and truncated chunks are detected either way.
        compression: ``None`` (default), ``"zstd"`` or ``"blosc"``; model
            weights rarely compress enough to pay for it.
    """

    def __init__(
        self,
        path: PathLike | None = None,
        *,
        overwrite: bool = False,
        inner_chunk_bytes: int = DEFAULT_INNER_CHUNK_BYTES,
        io_concurrency: int = DEFAULT_IO_CONCURRENCY,
        checksums: bool = False,
        compression: str | None = None,
    ):
        super().__init__(path, io_concurrency)
        arrays.check_options(checksums, compression)
        self.overwrite = overwrite
        self.inner_chunk_bytes = inner_chunk_bytes
        self.checksums = checksums
        self.compression = compression
        self.is_coordinator = False
        self.rank = 0
        self.save_id = ""
        self._entries: dict[str, TensorEntry] = {}
        self._placements: dict[str, Any] = {}
        self._key_paths: dict[str, tuple[Any, ...]] = {}

    def reset(self, checkpoint_id: PathLike | None = None) -> None:
        self._reset(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._reset(None)
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0))
        if is_coordinator:
            hierarchy.prepare_target(self._kvstore(), self.checkpoint_id or "", overwrite=self.overwrite)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Choose every array's path and chunk grid from all ranks' regions."""
        self._placements, self._key_paths = {}, {}
        for plan in plans:
            self._placements |= getattr(plan.planner_data, "placements", {})
            self._key_paths |= {k: tuple(v) for k, v in (plan.planner_data or {}).items()}
        boxes: dict[str, list[Region]] = {}
        first: dict[str, Any] = {}
        for rank, plan in enumerate(plans):
            for item in plan.items:
                fqn = item.index.fqn
                if item.type == WriteItemType.BYTE_IO:
                    continue
                td = item.tensor_data
                boxes.setdefault(fqn, []).append(Region(tuple(td.chunk.offsets), tuple(td.chunk.sizes), rank))
                first.setdefault(fqn, td)
        self._entries = {fqn: self._plan_array(fqn, first[fqn], regions) for fqn, regions in boxes.items()}
        # A rank needs each array's layout, not every rank's regions: leaving
        # them out keeps the scattered plans O(tensors) instead of O(tensors x ranks).
        layouts = {fqn: dataclasses.replace(e, writes=()) for fqn, e in self._entries.items()}
        paths = [e.path for e in self._entries.values()] + [
            self._path_of(i.index.fqn) for p in plans for i in p.items if i.type == WriteItemType.BYTE_IO
        ]
        if len(set(paths)) != len(paths):
            dup = next(p for p in paths if paths.count(p) > 1)
            raise PlanError(f"two state-dict keys map to the same array path {dup!r} in {self.checkpoint_id}")
        return [
            dataclasses.replace(plan, storage_data=_RankPlan(
                arrays={i.index.fqn: layouts[i.index.fqn] for i in plan.items if i.index.fqn in layouts},
                objects={i.index.fqn: self._path_of(i.index.fqn)
                         for i in plan.items if i.type == WriteItemType.BYTE_IO},
            ))
            for plan in plans
        ]

    def _path_of(self, fqn: str) -> str:
        return zarr_path(self._key_paths.get(fqn, (fqn,)))

    def _plan_array(self, fqn: str, td: Any, regions: list[Region]) -> TensorEntry:
        try:
            dt = dtypes.from_torch(td.properties.dtype)
        except UnsupportedDtypeError as e:
            raise UnsupportedDtypeError(f"tensor {fqn!r} in {self.checkpoint_id}: {e}") from None
        shape = tuple(td.size)
        grid.check_tiling(fqn, shape, [(r.offsets, r.sizes) for r in regions])
        chunk = grid.aligned_chunk_shape(shape, [(r.offsets, r.sizes) for r in regions])
        return TensorEntry(
            key_path=self._key_paths.get(fqn, (fqn,)),
            path=self._path_of(fqn),
            shape=shape,
            dtype=dt.zarr,
            chunk_shape=chunk,
            inner_chunk_shape=grid.inner_chunk_shape(chunk, dt.itemsize, self.inner_chunk_bytes),
            placement=None,
            writes=tuple(regions),
        )

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rank_plan: _RankPlan = plan.storage_data or _RankPlan({}, {})
        entries = rank_plan.arrays
        opened = {
            fqn: ts.open(self._array_spec(e.path, self._zarr_metadata(e)), context=self.context)
            for fqn, e in entries.items()
        }
        pending, results, keep_alive = [], [], []
        for item in plan.items:
            fqn = item.index.fqn
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                info, fut = self._write_object(rank_plan.objects[fqn], data)
                results.append(WriteResult(index=item.index, size_in_bytes=len(data.getbuffer()), storage_data=info))
                if fut is not None:
                    pending.append((fqn, fut))
                continue
            chunk = item.tensor_data.chunk
            tensor = data.detach()
            if tensor.device.type != "cpu":
                tensor = tensor.cpu()
            if tensor.numel():
                source = dtypes.tensor_as_numpy(tensor)
                keep_alive.append(tensor)
                arr = opened[fqn].result()
                pending.append((fqn, arr[_region(chunk.offsets, chunk.sizes)].write(
                    source, can_reference_source_data_indefinitely=True)))
            results.append(WriteResult(
                index=item.index,
                size_in_bytes=tensor.numel() * tensor.element_size(),
                storage_data={"rank": self.rank, "offsets": list(chunk.offsets), "sizes": list(chunk.sizes)},
            ))
        for fqn, fut in pending:
            try:
                fut.result()
            except Exception as e:
                raise TsckptError(f"writing {fqn!r} to {self.checkpoint_id} failed: {e}") from e
        return _done(results)

    def _zarr_metadata(self, e: TensorEntry, attributes: dict[str, Any] | None = None) -> dict[str, Any]:
        return arrays.array_metadata(e.shape, e.dtype, e.chunk_shape, e.inner_chunk_shape, attributes,
                                     checksums=self.checksums, compression=self.compression)

    def _write_object(self, path: str, data: io.BytesIO) -> tuple[dict[str, Any], Any]:
        encoding = getattr(data, "encoding", objects.TORCH)
        if encoding == objects.JSON:
            return {"encoding": objects.JSON, "value": json.loads(data.getvalue())}, None
        blob = np.frombuffer(data.getvalue(), dtype=np.uint8)
        md = arrays.array_metadata([blob.size], "uint8", [max(blob.size, 1)])
        arr = ts.open(self._array_spec(path, md), context=self.context).result()
        return {"encoding": objects.TORCH, "nbytes": int(blob.size)}, arr.write(blob)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator, after all data is durable: write nodes, then commit."""
        writes: dict[str, list[Region]] = {}
        objs: dict[str, ObjectEntry] = {}
        docs: dict[str, dict[str, Any]] = {}
        for rank_results in results:
            for r in rank_results:
                fqn, info = r.index.fqn, r.storage_data
                if "encoding" not in info:
                    region = Region(tuple(info["offsets"]), tuple(info["sizes"]), info["rank"])
                    if region.numel or not region.sizes:  # zero-size shards wrote nothing
                        writes.setdefault(fqn, []).append(region)
                    continue
                key_path = self._key_paths.get(fqn, (fqn,))
                if info["encoding"] == objects.JSON:
                    objs[fqn] = ObjectEntry(key_path, objects.JSON, value=info["value"])
                else:
                    objs[fqn] = ObjectEntry(key_path, objects.TORCH, path=zarr_path(key_path))
                    docs[objs[fqn].path] = arrays.array_metadata(
                        [info["nbytes"]], "uint8", [max(info["nbytes"], 1)],
                        attributes={hierarchy.ATTRIBUTE: {"kind": "object", "key": fqn, "encoding": objects.TORCH}})
        meshes: list = []
        tensors = {}
        for fqn, planned in self._entries.items():
            entry = dataclasses.replace(
                planned,
                placement=intern_placement(self._placements.get(fqn), meshes, f"tensor {fqn!r}"),
                writes=tuple(sorted(writes.get(fqn, []), key=lambda w: (w.offsets, w.rank))),
            )
            entry.validate(f"tensor {fqn!r}")
            tensors[fqn] = entry
            torch_dtype = str(dtypes.to_torch_dtype(dtypes.from_zarr(entry.dtype)))
            docs[entry.path] = self._zarr_metadata(entry, hierarchy.tensor_attributes(fqn, entry, torch_dtype))
        md = CheckpointMetadata(
            world_size=len(results),
            tensors=tensors,
            objects=objs,
            meshes=tuple(meshes),
            torch_version=torch.__version__,
            tsckpt_version=__version__,
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            extra={"save_id": self.save_id},
        )
        hierarchy.commit(self._kvstore(), md, docs, nodes=unsynced_nodes(self.location))


def to_dcp_metadata(md: CheckpointMetadata) -> Metadata:
    """DCP's view: each tensor as one whole chunk, so DCP asks for exact hyperslabs."""
    sd_md: dict[str, Any] = {}
    for fqn, t in md.tensors.items():
        size = torch.Size(t.shape)
        sd_md[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtypes.to_torch_dtype(dtypes.from_zarr(t.dtype))),
            size=size,
            chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)],
        )
    for fqn in md.objects:
        sd_md[fqn] = BytesStorageMetadata()
    key_paths = {k: tuple(e.key_path) for k, e in (*md.tensors.items(), *md.objects.items())}
    return Metadata(state_dict_metadata=sd_md, planner_data=key_paths)


class TensorStoreReader(_TensorStoreIO, StorageReader):
    """Read a tsckpt checkpoint with ``dcp.load``, in any topology.

    Each local shard's hyperslab is read straight into the destination tensor.

    Args:
        path: checkpoint directory (or kvstore spec), or ``checkpoint_id=`` to ``dcp.load``.
        allow_pickle: restore non-tensor values that need arbitrary unpickling
            (code from the checkpoint may run). Off by default.
        io_concurrency: TensorStore file I/O concurrency per rank.
    """

    def __init__(self, path: PathLike | None = None, *, allow_pickle: bool = False,
                 io_concurrency: int = DEFAULT_IO_CONCURRENCY):
        super().__init__(path, io_concurrency)
        self.allow_pickle = allow_pickle
        self.metadata: CheckpointMetadata | None = None
        self._prefetched = False

    def reset(self, checkpoint_id: PathLike | None = None) -> None:
        self._reset(checkpoint_id)
        if not (self._prefetched and checkpoint_id is None):
            self.metadata = None
        self._prefetched = False

    def prefetch_metadata(self) -> CheckpointMetadata:
        """Read the metadata now, raising tsckpt's own errors, and keep it for the next load.

        ``dcp.load`` starts with ``reset()`` and then reads the metadata on every
        rank; after this call that read costs nothing. Any later load reads afresh.
        """
        self.metadata = None
        self.read_metadata()
        self._prefetched = True
        assert self.metadata is not None
        return self.metadata

    def read_metadata(self, *args: Any) -> Metadata:
        self._reset(None)
        if self.metadata is None:
            self.metadata = hierarchy.read_metadata(self._kvstore(), self.checkpoint_id or "")
        return to_dcp_metadata(self.metadata)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.metadata is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self.metadata is not None
        md = self.metadata
        wanted = {i.storage_index.fqn for i in plan.items if i.type != LoadItemType.BYTE_IO}
        opened = {fqn: ts.open(self._array_spec(md.tensors[fqn].path), context=self.context,
                               dtype=dtypes.from_zarr(md.tensors[fqn].dtype).numpy,
                               shape=md.tensors[fqn].shape) for fqn in wanted}
        pending = []
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, DecodedValue(self._read_object(fqn)))
                continue
            try:
                arr = opened[fqn].result()
            except Exception as e:
                raise TsckptError(f"cannot open array of tensor {fqn!r} in {self.checkpoint_id}: {e}") from e
            dest = planner.resolve_tensor(item)
            source = arr[_region(item.storage_offsets, item.lengths)]
            pending.append((item, dest, _read_into(dest, source)))
        for item, dest, finish in pending:
            try:
                finish()
            except Exception as e:
                raise TsckptError(
                    f"reading tensor {item.storage_index.fqn!r} from {self.checkpoint_id} failed: {e}") from e
            planner.commit_tensor(item, dest)
        return _done(None)

    def _read_object(self, fqn: str) -> Any:
        assert self.metadata is not None
        entry = self.metadata.objects[fqn]
        if entry.encoding == objects.JSON:
            return objects.from_json(entry.value)
        assert entry.path is not None
        blob = ts.open(self._array_spec(entry.path), context=self.context).result().read().result()
        return objects.load_torch_value(blob.tobytes(), key=fqn, where=str(self.checkpoint_id),
                                        allow_pickle=self.allow_pickle)


def _read_into(dest: torch.Tensor, source: ts.TensorStore) -> Any:
    """Start reading ``source`` into ``dest``; returns a function that finishes it.

    A CPU destination of the stored dtype is filled in place (any strides);
    otherwise the slab is read, then copied and cast.
    """
    if dest.device.type == "cpu" and dtypes.from_torch(dest.dtype).numpy == source.dtype.numpy_dtype:
        fut = ts.array(dtypes.tensor_as_numpy(dest), copy=False, write=True).write(source)
        return fut.result
    fut = source.read()

    def finish() -> None:
        dest.copy_(dtypes.numpy_as_tensor(fut.result()))

    return finish
