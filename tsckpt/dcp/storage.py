"""DCP storage writer: ``TensorStoreWriter`` moves a state dict's bytes into Zarr v3 arrays.

It knows regions, dtypes and paths, never DTensors: placements arrive as JSON
records from the planner (:mod:`tsckpt.dcp.protocol`). Chunk grids come from
:mod:`tsckpt.format.plan`, array specs from :mod:`tsckpt.format.spec`, and the
commit from :func:`tsckpt.format.commit.commit_checkpoint`. See
``docs/format.md`` for what ends up on disk.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import uuid
from typing import Any

import numpy as np
import tensorstore as ts
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..errors import PlanError, TsckptError, UnsupportedDtypeError
from ..format import checksums, commit, dtypes, values, zarr_json
from ..format.metadata import ArrayOptions, ObjectEntry, TensorEntry, intern_placement
from ..format.names import zarr_path
from ..format.plan import DEFAULT_INNER_CHUNK_BYTES, check_unique_paths, plan_tensor
from ..format.spec import Store
from ..location import DEFAULT_IO_CONCURRENCY, Location, LocationLike, parse_location
from .protocol import Placements, encoding_of


def done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


def region(offsets: Any, sizes: Any) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes))


@dataclasses.dataclass(frozen=True)
class _RankPlan:
    """What the coordinator tells one rank: its arrays' layout and its values' paths."""

    arrays: dict[str, TensorEntry]
    objects: dict[str, str]


class TensorStoreIO:
    """What the writer and reader share: a location and, made on first use, its :class:`Store`."""

    def __init__(self, path: LocationLike | None, io_concurrency: int):
        self.location: Location | None = parse_location(path) if path is not None else None
        self.io_concurrency = io_concurrency
        self._store: Store | None = None

    @property
    def checkpoint_id(self) -> str | None:
        return self.location.url if self.location else None

    def _reset(self, checkpoint_id: LocationLike | None) -> None:
        if checkpoint_id is not None:
            location = parse_location(checkpoint_id)
            if location != self.location:
                self.location, self._store = location, None
        if self.location is None:
            raise TsckptError("no checkpoint location: pass a path to the constructor or checkpoint_id=")

    @property
    def store(self) -> Store:
        if self._store is None:
            assert self.location is not None
            self._store = Store.open(self.location, io_concurrency=self.io_concurrency)
        return self._store

    @property
    def context(self) -> ts.Context:
        return self.store.context

    def __getstate__(self) -> dict[str, Any]:
        # TensorStore handles do not pickle; async_save's process mode pickles the writer.
        return {**self.__dict__, "_store": None}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: LocationLike) -> bool:
        try:
            parse_location(checkpoint_id)
        except TsckptError:
            return False
        return True


class TensorStoreWriter(TensorStoreIO, StorageWriter):
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
        checksums: record a crc32c of every outer chunk in the metadata
            (hardware crc32c, computed while the chunk is being written), checked
            by every read that covers a chunk whole and by ``verify``, so flipped
            bits fail the load instead of loading silently. On by default.
            Missing and truncated chunks are detected either way.
        crc32c_codec: also store Zarr's own ``crc32c`` codec with every chunk,
            so readers other than tsckpt check data by themselves, partial
            reads included (TensorStore's software crc32c, about 2 GB/s per core).
        compression: ``None`` (default), ``"zstd"`` or ``"blosc"``; model
            weights rarely compress enough to pay for it.
    """

    def __init__(
        self,
        path: LocationLike | None = None,
        *,
        overwrite: bool = False,
        inner_chunk_bytes: int = DEFAULT_INNER_CHUNK_BYTES,
        io_concurrency: int = DEFAULT_IO_CONCURRENCY,
        checksums: bool = True,
        crc32c_codec: bool = False,
        compression: str | None = None,
    ):
        super().__init__(path, io_concurrency)
        if not isinstance(checksums, bool):
            raise TsckptError(f"checksums must be True or False, not {checksums!r}")
        self.array_options = ArrayOptions(crc32c_codec=crc32c_codec, compression=compression)
        self.overwrite = overwrite
        self.inner_chunk_bytes = inner_chunk_bytes
        self.checksums = checksums
        self.is_coordinator = False
        self.rank = 0
        self.save_id = ""
        self._entries: dict[str, TensorEntry] = {}
        self._placements: dict[str, Any] = {}
        self._key_paths: dict[str, tuple[Any, ...]] = {}

    def reset(self, checkpoint_id: LocationLike | None = None) -> None:
        self._reset(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._reset(None)
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0))
        if is_coordinator:
            commit.prepare_target(self.store.kvstore, self.store.url, overwrite=self.overwrite)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Choose every array's path and chunk grid from all ranks' regions."""
        self._placements, self._key_paths = {}, {}
        for p in plans:
            self._placements |= Placements.of(p)
            self._key_paths |= {k: tuple(v) for k, v in (p.planner_data or {}).items()}
        # One pass over every rank's items, flat lists per tensor: at 1000 ranks x
        # 2000 tensors this loop is most of the coordinator's planning time.
        boxes: dict[str, list[Any]] = {}  # fqn -> [tensor write data, flat offsets+sizes, item count]
        blobs: dict[str, str] = {}
        for p in plans:
            for item in p.items:
                td = item.tensor_data
                fqn = item.index.fqn
                if td is None:  # BYTE_IO
                    blobs[fqn] = zarr_path(self._key_path(fqn))
                    continue
                found = boxes.get(fqn)
                if found is None:
                    boxes[fqn] = found = [td, [], 0]
                found[1].extend((*td.chunk.offsets, *td.chunk.sizes))
                found[2] += 1
        self._entries = {}
        for fqn, (td, flat, count) in boxes.items():
            try:
                dtype = dtypes.from_torch(td.properties.dtype).zarr
            except UnsupportedDtypeError as e:
                raise UnsupportedDtypeError(f"tensor {fqn!r} in {self.checkpoint_id}: {e}") from None
            ndim = len(td.size)
            self._entries[fqn] = plan_tensor(fqn, self._key_path(fqn), td.size, dtype,
                                             np.array(flat, dtype=np.int64).reshape(count, 2, ndim),
                                             inner_chunk_bytes=self.inner_chunk_bytes)
        check_unique_paths([e.path for e in self._entries.values()] + list(blobs.values()),
                           str(self.checkpoint_id))
        # Every rank gets the same layouts (O(tensors), one object): a rank of
        # an FSDP job writes part of nearly every tensor anyway.
        rank_plan = _RankPlan(arrays=self._entries, objects=blobs)
        return [dataclasses.replace(p, storage_data=rank_plan) for p in plans]

    def _key_path(self, fqn: str) -> tuple[Any, ...]:
        return self._key_paths.get(fqn, (fqn,))

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rank_plan: _RankPlan = plan.storage_data or _RankPlan({}, {})
        opened = {fqn: self.store.create(e.path, zarr_json.tensor_metadata(e, self.array_options))
                  for fqn, e in rank_plan.arrays.items()}
        pending, results, written = [], [], []
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
            source = dtypes.tensor_as_numpy(tensor) if tensor.numel() else None
            if source is not None:
                arr = opened[fqn].result()
                pending.append((fqn, arr[region(chunk.offsets, chunk.sizes)].write(
                    source, can_reference_source_data_indefinitely=True)))
            info: dict[str, Any] = {"rank": self.rank, "chunks": [], "crcs": []}
            written.append((rank_plan.arrays[fqn], chunk, source, tensor, info))
            results.append(WriteResult(index=item.index, size_in_bytes=tensor.numel() * tensor.element_size(),
                                       storage_data=info))
        # TensorStore's threads write meanwhile: the checksums cost CPU, not wall time.
        for entry, chunk, source, _, info in written:
            if source is None:
                continue
            if self.checksums:
                info["chunks"], info["crcs"] = checksums.region_checksums(source, entry.grid, chunk.offsets)
            else:
                info["chunks"] = [entry.grid.flat_index(i) for i, _ in entry.grid.chunks_within(
                    chunk.offsets, chunk.sizes)]
        for fqn, fut in pending:
            try:
                fut.result()
            except Exception as e:
                raise TsckptError(f"writing {fqn!r} to {self.checkpoint_id} failed: {e}") from e
        return done(results)

    def _write_object(self, path: str, data: Any) -> tuple[dict[str, Any], Any]:
        encoding = encoding_of(data)
        if encoding == values.JSON:
            return {"encoding": values.JSON, "value": json.loads(data.getvalue())}, None
        blob = np.frombuffer(data.getvalue(), dtype=np.uint8)
        arr = self.store.create(path, zarr_json.blob_metadata(blob.size)).result()
        return {"encoding": values.TORCH, "nbytes": int(blob.size)}, arr.write(blob)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator, after all data is durable: gather each tensor's checksums, then commit."""
        written: dict[str, list[dict[str, Any]]] = {}
        objs: dict[str, ObjectEntry] = {}
        blob_sizes: dict[str, int] = {}
        for rank_results in results:
            for r in rank_results:
                fqn, info = r.index.fqn, r.storage_data
                if "encoding" not in info:
                    found = written.get(fqn)
                    if found is None:
                        written[fqn] = found = []
                    found.append(info)
                elif info["encoding"] == values.JSON:
                    objs[fqn] = ObjectEntry(self._key_path(fqn), values.JSON, value=info["value"])
                else:
                    objs[fqn] = ObjectEntry(self._key_path(fqn), values.TORCH, path=zarr_path(self._key_path(fqn)))
                    blob_sizes[fqn] = info["nbytes"]
        meshes: list = []
        tensors, writers = {}, {}
        for fqn, planned in self._entries.items():
            infos = written.get(fqn, [])
            chunks = np.fromiter(itertools.chain.from_iterable(i["chunks"] for i in infos), dtype=np.int64)
            ranks = np.full(planned.grid.nchunks, -1, dtype=np.int64)
            ranks[chunks] = np.repeat([i["rank"] for i in infos], [len(i["chunks"]) for i in infos])
            writers[fqn] = ranks.tolist()
            table = None
            if self.checksums:
                crcs = np.fromiter(itertools.chain.from_iterable(i["crcs"] for i in infos), dtype=np.int64)
                try:
                    table = checksums.encode_table(planned.grid, chunks, crcs)
                except TsckptError as e:
                    raise PlanError(f"tensor {fqn!r} in {self.checkpoint_id}: {e}") from None
            tensors[fqn] = dataclasses.replace(
                planned, placement=intern_placement(self._placements.get(fqn), meshes, f"tensor {fqn!r}"),
                checksums=table)
        commit.commit_checkpoint(
            self.store, world_size=len(results), tensors=tensors, objects=objs, blob_sizes=blob_sizes,
            meshes=meshes, extra={"save_id": self.save_id}, options=self.array_options, writers=writers)
