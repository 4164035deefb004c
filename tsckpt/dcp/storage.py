"""DCP storage writer: ``TensorStoreWriter`` moves a state dict's bytes into Zarr v3 arrays.

It knows regions, dtypes and paths, never DTensors: placements arrive as JSON
records from tsckpt's planner (:mod:`tsckpt.dcp.protocol`) or, with DCP's own
planner, from :func:`tsckpt.dcp.planner.placement_records` as each rank writes.
Chunk grids come from :mod:`tsckpt.format.plan`, array specs from
:mod:`tsckpt.format.spec`, and the commit from
:func:`tsckpt.format.commit.commit_checkpoint`. The constructor takes
``FileSystemWriter``'s arguments too (:mod:`tsckpt.dcp.compat`). See
``docs/format.md`` for what ends up on disk.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..errors import PlanError, TsckptError, UnsupportedDtypeError
from ..format import checksums, commit, dtypes, values, zarr_json
from ..format.metadata import ArrayOptions, ObjectEntry, TensorEntry, intern_placement
from ..format.names import zarr_path
from ..format.plan import DEFAULT_INNER_CHUNK_BYTES, check_unique_paths, plan_tensor
from ..format.batch import RankBatch
from ..format.region_writer import RegionWriter
from ..format.spec import Store
from ..format.target import SaveTarget, begin_save
from ..location import Location, LocationLike
from . import compat, logs, plan_cache
from .copy_window import DEFAULT_COPY_AHEAD, CopyWindow, check_copy_ahead
from .planner import placement_records
from .exchange import RankPlan, RankSummary
from .io import TensorStoreIO, done
from .protocol import Placements, encode_bytes
from .staging import Stager


class TensorStoreWriter(TensorStoreIO, StorageWriter, Stager):
    """Write a DCP checkpoint as a Zarr v3 hierarchy, one array per global tensor.

    A drop-in for DCP's ``FileSystemWriter``: it takes the same arguments in
    the same positions (torch 2.13-2.15), each with a meaning here, and like
    ``FileSystemWriter`` it is an ``AsyncStager`` (:class:`~tsckpt.dcp.staging.Stager`),
    so ``dcp.async_save(..., storage_writer=TensorStoreWriter(path))`` stages with it.

    Args:
        path: checkpoint directory (or a kvstore spec); may instead be given as
            ``checkpoint_id=`` to ``dcp.save``.
        single_file_per_rank: ``True`` asks for the ``"packed"`` layout (a
            few files per rank, like DCP's default), ``False`` for the plain
            layout (one file per chunk); ``None`` (the default here) leaves the
            choice to ``layout``.
        sync_files: ``False`` skips every fsync (chunks, nodes, root document,
            and the filesystem sync before the commit) and records
            ``"synced": false`` in the metadata's ``extra``: faster, but a power
            loss may leave a committed checkpoint whose files are not on disk.
        thread_count: concurrent file operations per rank (TensorStore's I/O
            concurrency); the same as ``io_concurrency``.
        per_thread_copy_ahead: bytes of device (GPU) tensors a rank copies to
            host memory ahead of their writes; it waits for older writes before
            copying more, so a rank's extra host memory stays near this plus
            a few times its largest tensor. Default 1 GiB (DCP's is 10 MB per thread);
            0 copies one tensor at a time; ``None`` copies everything before
            waiting for any write (host memory grows with the state). CPU
            tensors are written in place.
        cache_staged_state_dict: with ``dcp.async_save``, keep the staged CPU
            copies and refill them on the next save instead of allocating new
            ones (:class:`~tsckpt.dcp.staging.Stager`).
        overwrite: replace a checkpoint, or data tsckpt did not write, already
            at ``path`` (the default, as in DCP); ``False`` refuses with
            :class:`~tsckpt.errors.CheckpointExistsError` ("Checkpoint already
            exists ...") or :class:`~tsckpt.errors.ForeignContentError`, before
            any data is written. On a local filesystem the old checkpoint stays
            loadable until the new one is complete, and is swapped out in one
            atomic step. On object stores and ``memory://`` the old checkpoint
            is un-committed before the new data is written: a save that dies
            there leaves no loadable checkpoint (docs/format.md, section 8).
        _extensions: ``[ZStandard()]`` (``torch.distributed.checkpoint._extension``)
            compresses chunks with Zarr's ``zstd`` codec, like ``compression="zstd"``;
            other extensions are refused.
        serialization_format: DCP's default (``TORCH_SAVE``) is accepted, since
            tensors are never pickled here anyway; ``SAFETENSORS`` is refused.
        layout: the storage layout, ``"plain"`` (one file or object per chunk;
            any Zarr reader opens it) or ``"packed"`` (per-rank OCDBT databases
            joined at commit; read through :func:`tsckpt.zarr_store`). ``None``:
            ``$TSCKPT_LAYOUT`` if set, else plain. Only the coordinator's choice
            counts in a multi-rank save.
        inner_chunk_bytes: the smallest inner chunk (Zarr's sharding codec) a
            save cuts outer chunks into, default 16 KiB; inner chunks are chosen
            so that loads into 2, 3, 4 or 8 ranks along any dimension fetch little
            more than they need (``docs/format.md``, section 5). 0 disables them.
        io_concurrency: TensorStore file I/O concurrency per rank.
        checksums: record a crc32c of every inner chunk in the metadata
            (hardware crc32c, computed while the chunk is being written); every
            read checks every inner chunk it touches, whole, before returning any
            of it, so flipped bits fail the read instead of loading silently. On
            by default. Missing and truncated chunks are detected either way.
        crc32c_codec: also store Zarr's own ``crc32c`` codec with every chunk,
            so readers other than tsckpt check data by themselves, partial
            reads included (TensorStore's software crc32c, about 2 GB/s per core).
        compression: ``None`` (default), ``"zstd"`` or ``"blosc"``; model
            weights rarely compress enough to pay for it.

    ``dcp.save(..., use_collectives=False)`` is refused on more than one rank:
    a checkpoint is committed once, after every rank's data is written, which
    needs the ranks to coordinate.
    """

    def __init__(
        self,
        path: LocationLike | None = None,
        single_file_per_rank: bool | None = None,
        sync_files: bool = True,
        thread_count: int | None = None,
        per_thread_copy_ahead: int | None = DEFAULT_COPY_AHEAD,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Sequence[Any] | None = None,
        serialization_format: Any = None,
        *,
        layout: str | None = None,
        inner_chunk_bytes: int = DEFAULT_INNER_CHUNK_BYTES,
        io_concurrency: int | None = None,
        checksums: bool = True,
        crc32c_codec: bool = False,
        compression: str | None = None,
    ):
        super().__init__(path, compat.resolve_io_concurrency(thread_count, io_concurrency))
        Stager.__init__(self, cache_staged_state_dict)
        compat.check_serialization_format(serialization_format)
        compression = compat.resolve_compression(_extensions, compression)
        if not isinstance(checksums, bool):
            raise TsckptError(f"checksums must be True or False, not {checksums!r}")
        self.array_options = ArrayOptions(crc32c_codec=crc32c_codec, compression=compression)
        self.layout = compat.resolve_layout(single_file_per_rank, layout)
        self.sync_files = bool(sync_files)
        self.per_thread_copy_ahead = check_copy_ahead(per_thread_copy_ahead)
        self.overwrite = overwrite
        self.inner_chunk_bytes = inner_chunk_bytes
        self.checksums = checksums
        self.is_coordinator = False
        self.rank = 0
        self.save_id = uuid.uuid4().hex
        self._target: SaveTarget | None = None
        self._data_store: Store | None = None
        self._entries: dict[str, TensorEntry] = {}
        self._placements: dict[str, Any] = {}
        self._key_paths: dict[str, tuple[Any, ...]] = {}
        self._full_plans: list[SavePlan] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**TensorStoreIO.__getstate__(self), "_staged": None}  # never the staged copies

    def _open_store(self, location: Location) -> Store:
        if not self.sync_files:
            # One context for every file of the save, so chunks, nodes and root all skip fsync
            # (and the filesystem flush before the commit, see location.unsynced_nodes).
            location = dataclasses.replace(location, context={**location.context, "file_io_sync": False})
        return Store.open(location, io_concurrency=self.io_concurrency, layout=self.layout)

    def reset(self, checkpoint_id: LocationLike | None = None) -> None:
        # DCP asks for storage_meta() before set_up_storage_writer: the id must exist by then.
        self._reset(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._reset(None)
        compat.refuse_rank_local_saves(kwargs.get("use_collectives", True), str(self.checkpoint_id))
        self._started = time.perf_counter()
        self.is_coordinator = is_coordinator
        # The packed layout gives each rank its own database, so the rank must be right.
        self.rank = int(kwargs["rank"] if "rank" in kwargs else dist.get_rank() if dist.is_initialized() else 0)
        self._target, self._data_store = None, None
        if is_coordinator:
            # Refuses before any rank writes; on local filesystems, picks this save's staging directory.
            assert self.location is not None
            self._target = begin_save(self.location, save_id=self.save_id, overwrite=self.overwrite)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Choose every array's path and chunk grid from all ranks' regions."""
        plans = self._full_plans = plan_cache.expand(plans, str(self.checkpoint_id))
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
            self._entries[fqn] = plan_tensor(fqn, self._key_path(fqn), td.size, dtype,
                                             np.array(flat, dtype=np.int64).reshape(count, 2, len(td.size)),
                                             inner_chunk_bytes=self.inner_chunk_bytes)
        check_unique_paths([e.path for e in self._entries.values()] + list(blobs.values()),
                           str(self.checkpoint_id))
        # Every rank gets the same layouts (O(tensors), one object): a rank of
        # an FSDP job writes part of nearly every tensor anyway.
        if self._target is None:
            raise TsckptError(f"saving to {self.checkpoint_id}: the global plan was made on a rank that is not "
                              f"the coordinator (use_collectives=False is not supported)")
        told = {describe: RankPlan(arrays=self._entries, objects=blobs, describe=describe,
                                    location=self._target.data_location, storage_layout=self.layout)
                for describe in (False, True)}
        return [dataclasses.replace(p, storage_data=told[not Placements.of(p)]) for p in plans]

    def _key_path(self, fqn: str) -> tuple[Any, ...]:
        return self._key_paths.get(fqn, (fqn,))

    def data_store(self, location: Location | None) -> Store:
        """This save's store: where the coordinator said to write (its staging directory, or in place)."""
        if location is None or location == self.location:
            return self.store
        if self._data_store is None or self._data_store.location.spec != location.spec:
            self._data_store = self._open_store(location)
        return self._data_store

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self.is_coordinator:
            plan_cache.remember(self._full_plans, planner)
            self._full_plans = None
        rank_plan: RankPlan = plan.storage_data or RankPlan({}, {}, storage_layout=self.layout)
        if rank_plan.storage_layout != self.layout:
            # The coordinator's layout is the one its metadata will record.
            self.layout, self._store, self._data_store = rank_plan.storage_layout, None, None
        records = placement_records(planner, rank_plan.arrays) if rank_plan.describe else {}
        store = self.data_store(rank_plan.location)
        pending, results, keep_alive = [], [], []
        batch = RankBatch(store.layout, lambda: self._drain(pending), self.rank, str(self.checkpoint_id))
        writer = RegionWriter(store, rank_plan.arrays, self.array_options, self.rank, batch)
        summary = RankSummary(self.rank, list(rank_plan.arrays), placements=records)
        copies = CopyWindow(self.per_thread_copy_ahead)
        later = []
        for item in plan.items:
            fqn = item.index.fqn
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                summary.objects[fqn], fut = self._write_object(store, fqn, rank_plan.objects[fqn], data, batch)
                results.append(WriteResult(index=item.index, size_in_bytes=len(data.getbuffer()), storage_data=None))
                if fut is not None:
                    pending.append((fqn, fut))
                continue
            chunk = item.tensor_data.chunk
            tensor = data.detach()
            nbytes = tensor.numel() * tensor.element_size()
            on_device = tensor.device.type != "cpu"
            encoded = writer.formats[fqn] is not None
            if on_device or encoded:
                copies.admit(nbytes)  # a host copy, or the encoded chunks, of this size until written
            if on_device:
                tensor = tensor.cpu()
            results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=None))
            if not tensor.numel():
                continue
            source = dtypes.tensor_as_numpy(tensor)
            entry = rank_plan.arrays[fqn]
            summary.wrote(fqn, entry, chunk.offsets, source.shape)
            written = writer.write(fqn, chunk.offsets, source)
            pending += [(fqn, fut) for fut in written.futures]
            batch.wrote(fqn, nbytes)
            finish = functools.partial(self._wait_all, fqn, written.futures)
            if written.crcs is not None:
                if self.checksums:
                    summary.checksummed(fqn, written.pieces, written.crcs)
                copies.add(nbytes, finish)  # the futures hold the encoded chunks; the source is free
            elif on_device:
                # Checksum the host copy now: the copy window may release it once written.
                if self.checksums:
                    summary.checksummed(fqn, *checksums.region_checksums(source, entry.checksum_grid, chunk.offsets))
                copies.add(nbytes, finish, hold=tensor)
            else:
                keep_alive.append(tensor)
                later.append((fqn, chunk.offsets, source))
        # TensorStore's threads write meanwhile: the checksums cost CPU, not wall time.
        if self.checksums:
            for fqn, offsets, source in later:
                summary.checksummed(fqn, *checksums.region_checksums(source, rank_plan.arrays[fqn].checksum_grid,
                                                                     offsets))
        copies.drain()
        self._drain(pending)
        batch.commit()
        if results:
            # One record per rank rather than per item: the coordinator's finish then
            # handles ranks, not ranks x tensors.
            results[0] = dataclasses.replace(results[0], storage_data=summary.packed())
        return done(results)

    def _drain(self, pending: list[tuple[str, Any]]) -> None:
        for fqn, fut in pending:
            self._wait(fqn, fut)
        pending.clear()

    def _wait_all(self, fqn: str, futures: Sequence[Any]) -> None:
        for fut in futures:
            self._wait(fqn, fut)

    def _wait(self, fqn: str, fut: Any) -> None:
        try:
            fut.result()
        except Exception as e:
            raise TsckptError(f"writing {fqn!r} to {self.checkpoint_id} failed: {e}") from e

    def _write_object(self, store: Store, fqn: str, path: str, data: Any, batch: RankBatch) -> tuple[dict[str, Any], Any]:
        encoding, payload = encode_bytes(data)
        if encoding == values.JSON:
            return {"encoding": values.JSON, "value": payload}, None
        blob = np.frombuffer(payload, dtype=np.uint8)
        arr = batch.bind(store.create(path, zarr_json.blob_metadata(blob.size), self.rank).result())
        batch.wrote(fqn, blob.size)
        return {"encoding": values.TORCH, "nbytes": int(blob.size)}, arr.write(blob)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator, after all data is durable: gather each tensor's checksums, then commit and publish."""
        summaries = [rank_results[0].storage_data for rank_results in results if rank_results]
        objs: dict[str, ObjectEntry] = {}
        blob_sizes: dict[str, int] = {}
        placements = dict(self._placements)
        for summary in summaries:
            for fqn, record in summary["placements"].items():
                placements.setdefault(fqn, record)
            for fqn, info in summary["objects"].items():
                if info["encoding"] == values.JSON:
                    objs[fqn] = ObjectEntry(self._key_path(fqn), values.JSON, value=info["value"])
                else:
                    objs[fqn] = ObjectEntry(self._key_path(fqn), values.TORCH, path=zarr_path(self._key_path(fqn)))
                    blob_sizes[fqn] = info["nbytes"]
        chunks = RankSummary.merge(summaries, list(self._entries))
        self._check_against(metadata, {fqn for fqn, c in chunks.items() if len(c[0])})
        meshes: list = []
        tensors, writers = {}, {}
        for fqn, planned in self._entries.items():
            indices, ranks, pieces, crcs = chunks[fqn]
            by_chunk = np.full(planned.grid.nchunks, -1, dtype=np.int64)
            by_chunk[indices] = ranks
            writers[fqn] = by_chunk.tolist()
            table = None
            if self.checksums:
                try:
                    table = checksums.encode_table(planned.checksum_grid, pieces, crcs)
                except TsckptError as e:
                    raise PlanError(f"tensor {fqn!r} in {self.checkpoint_id}: {e}") from None
            tensors[fqn] = dataclasses.replace(
                planned, placement=intern_placement(placements.get(fqn), meshes, f"tensor {fqn!r}"),
                checksums=table)
        extra: dict[str, Any] = {"save_id": self.save_id}
        if not self.sync_files:
            extra["synced"] = False
        assert self._target is not None, "finish runs on the coordinator, after set-up"
        commit.commit_checkpoint(
            self.data_store(self._target.data_location), world_size=len(results), tensors=tensors,
            objects=objs, blob_sizes=blob_sizes, meshes=meshes, extra=extra, options=self.array_options,
            writers=writers, target=self._target)
        if logs.enabled():
            logs.log_save(str(self.checkpoint_id), tensors, [objs[k].path for k in blob_sizes], blob_sizes.values(),
                          seconds=time.perf_counter() - self._started, ranks=len(results))

    def _check_against(self, metadata: Metadata, writes: dict[str, Any]) -> None:
        """Refuse to commit arrays that are not the tensors DCP planned (e.g. a stale cached plan)."""
        planned = set(self._entries)
        expected = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        odd = sorted((planned ^ expected) | (set(writes) - planned))
        if odd:
            raise PlanError(f"saving {self.checkpoint_id}: tensor {odd[0]!r} is not in both DCP's plan and the "
                            f"planned arrays ({len(odd)} such keys); nothing was committed")
