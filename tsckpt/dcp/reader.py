"""DCP storage reader: ``TensorStoreReader`` loads a tsckpt checkpoint with ``dcp.load``, in any topology."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..errors import OptionError, TsckptError
from ..format import dtypes, object_values
from ..commit import protocol as commit
from ..storage.box_reader import BoxReader
from ..storage.planned_box import PlannedBox, by_arrival
from ..storage.chunk_source import ChunkSource
from ..format.metadata import CheckpointMetadata
from ..storage.store import read_error
from ..storage.context import DEFAULT_IO_CONCURRENCY
from ..storage.location import LocationLike
from . import collector
from .copy_window import DEFAULT_COPY_AHEAD, CopyWindow, Scratch, check_copy_ahead
from .replica_reads import MIN_SHARED_BYTES, RankNote, Region, ReplicaShare, schedule
from .shared_reads import ReplicaTransfers, SharedReads, guarded, readable_in_place, stripes_along
from .load_planner import DecodedValue
from .planner import whole_tensor
from .io import TensorStoreIO, done, load_totals, log_transfer, logging_on


def to_dcp_metadata(md: CheckpointMetadata) -> Metadata:
    """DCP's view: each tensor as one whole chunk, so DCP asks for exact hyperslabs."""
    sd_md: dict[str, Any] = {fqn: whole_tensor(dtypes.to_torch_dtype(dtypes.from_zarr(t.dtype)), t.shape)
                             for fqn, t in md.tensors.items()}
    sd_md.update((fqn, BytesStorageMetadata()) for fqn in md.objects)
    key_paths = {k: tuple(e.key_path) for k, e in (*md.tensors.items(), *md.objects.items())}
    return Metadata(state_dict_metadata=sd_md, planner_data=key_paths)


#: With replica reads, a rank's own reads of at most this many bytes in all start before its shared regions.
EARLY_OWN_READS = 16 << 20


class TensorStoreReader(TensorStoreIO, StorageReader):
    """Read a tsckpt checkpoint with ``dcp.load``, in any topology; a drop-in for DCP's ``FileSystemReader``.

    Each local shard's hyperslab is read straight into the (detached) destination tensor. ``read_data`` and
    the set-up before it run on every rank, ``prepare_global_plan`` on the coordinator only.

    Args:
        path: checkpoint directory (or kvstore spec), or ``checkpoint_id=`` to ``dcp.load``.
        _extension_registry: accepted in ``FileSystemReader``'s position and unused: each array's
            ``zarr.json`` names its codecs, and TensorStore decodes them.
        allow_pickle: restore non-tensor values that need arbitrary unpickling (code from the checkpoint may
            run). Off by default.
        io_concurrency: TensorStore file I/O concurrency per rank.
        per_thread_copy_ahead: bytes of host buffers a rank reads ahead (for GPU destinations, dtype casts, and
            encoded inner chunks before they are checked); older reads complete before more start. Default
            1 GiB; 0 reads one tensor at a time; ``None`` reads everything first.
        replica_reads: when several ranks need the very same box of a tensor (DDP replicas, the replica
            dimension of an HSDP mesh, ``Replicate`` placements), one of them fetches and checks it and sends
            it to the others over the default process group, so storage serves one copy. ``None`` (default):
            on for object stores (S3, GCS), off for filesystems. If the rank fetching a region fails, every
            rank that needed it raises.
    """

    def __init__(self, path: LocationLike | None = None, _extension_registry: Any = None, *,
                 allow_pickle: bool = False, io_concurrency: int = DEFAULT_IO_CONCURRENCY,
                 per_thread_copy_ahead: int | None = DEFAULT_COPY_AHEAD, replica_reads: bool | None = None):
        super().__init__(path, io_concurrency)
        if replica_reads is not None and not isinstance(replica_reads, bool):
            raise OptionError(f"replica_reads={replica_reads!r}: expected True, False or None (by storage)")
        self.allow_pickle = allow_pickle
        self.per_thread_copy_ahead = check_copy_ahead(per_thread_copy_ahead)
        self.replica_reads = replica_reads
        self.metadata: CheckpointMetadata | None = None
        self.is_coordinator = False
        self._prefetched = False
        self._totals: tuple[int, int, int] | None = None
        self.load_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: LocationLike | None = None) -> None:
        self._started = time.perf_counter()
        self._totals = None
        self.load_id = uuid.uuid4().hex
        self._reset(checkpoint_id)
        if not (self._prefetched and checkpoint_id is None):
            self.metadata = None
        self._prefetched = False

    def prefetch_metadata(self) -> CheckpointMetadata:
        """Read the metadata now, raising tsckpt's own errors, and keep it for the next ``dcp.load`` only."""
        self.metadata = None
        self.read_metadata()
        self._prefetched = True
        assert self.metadata is not None
        return self.metadata

    def read_metadata(self, *args: Any) -> Metadata:
        self._reset(None)
        if self.metadata is None:
            self.metadata = commit.read_metadata(self.store.kvstore, self.store.url)
            self._store = self.store.for_checkpoint(self.metadata)
            self._source = None
        md = to_dcp_metadata(self.metadata)
        md.storage_meta = StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.metadata.extra.get("save_id"),
                                      load_id=self.load_id)
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        if self.metadata is None:
            self.read_metadata()

    def shares_replica_reads(self) -> bool:
        """Whether this rank offers to fetch regions for its replicas and take theirs (``replica_reads``)."""
        if self.replica_reads is not None:
            return self.replica_reads
        return self.location is not None and self.location.is_object_store

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        if (plan.storage_data is None and self.shares_replica_reads() and dist.is_available()
                and dist.is_initialized() and dist.get_world_size() > 1):
            return dataclasses.replace(plan, storage_data=RankNote(dist.get_rank()))
        return plan

    @collector.held_off()  # every rank's items, on the coordinator
    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        if logging_on() and self.metadata is not None:
            self._totals = (*load_totals(self.metadata, plans), len(plans))
        if any(isinstance(p.storage_data, RankNote) for p in plans):
            assert self.metadata is not None
            md = self.metadata
            shares = schedule(plans, lambda fqn: dtypes.from_zarr(md.tensors[fqn].dtype).itemsize,
                              lambda fqn: stripes_along(md.tensors[fqn].grid),
                              # As many ranks as saved (a job resuming): rank k most likely reads file k anyway.
                              functools.partial(_writer, md) if md.world_size == len(plans) else None)
            plans = [dataclasses.replace(p, storage_data=share) if share is not None or isinstance(
                p.storage_data, RankNote) else p for p, share in zip(plans, shares)]
        return plans

    @property
    def source(self) -> ChunkSource:
        """Where this load's bytes come from (one per load: the index of a packed checkpoint is read once)."""
        assert self.metadata is not None
        if getattr(self, "_source", None) is None:
            self._source = ChunkSource.of(self.store, self.metadata)
        return self._source

    @collector.held_off()  # thousands of pieces: no full collection of the process's heap among them
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self.metadata is not None
        md = self.metadata
        wanted = {i.storage_index.fqn for i in plan.items if i.type != LoadItemType.BYTE_IO}
        readers = {fqn: BoxReader(self.source, md.tensors[fqn], f"tensor {fqn!r} in {self.checkpoint_id}")
                   for fqn in wanted}
        share = ReplicaShare.of(plan)
        transfers = share.transfers() if share is not None else []
        # Every chunk this rank reads, found at once (an index is read level by level for all of them); not what
        # other ranks fetch for it: that could read their chunk tables for nothing.
        received = {t.item for t in transfers if t.owner != share.rank} if share is not None else set()
        self.source.locator.prefetch(key for k, i in enumerate(plan.items) if i.type != LoadItemType.BYTE_IO
                                     and k not in received
                                     for key in readers[i.storage_index.fqn].keys(i.storage_offsets, i.lengths))
        buffers = CopyWindow(self.per_thread_copy_ahead)
        # With replicas waiting on this rank, a failure is kept until every transfer is done, then raised.
        failures: list[Exception] | None = None if share is None else []
        moving = None if share is None else ReplicaTransfers(share.rank, str(self.checkpoint_id), self._stored_dtype,
                                                              self.per_thread_copy_ahead)
        shared = {t.item for t in transfers}
        alone = [item for k, item in enumerate(plan.items) if k not in shared]
        started = share is None

        def share_regions() -> None:
            # The shared regions, in the global order every rank follows; once, whatever failed before.
            nonlocal started
            if not started and share is not None and moving is not None:
                started = True
                SharedReads(self, plan, planner, readers, moving, buffers, failures).run(transfers, share.rank)

        # A few small reads of this rank's own (step counts, norms) start first, placed after the shared regions:
        # their latency then overlaps the exchange.
        early = share is not None and (self._few_small(alone, readers) or self._few_small(
            [plan.items[t.item] for t in transfers if t.owner == share.rank], readers, MIN_SHARED_BYTES * 64))
        try:
            if not early:
                share_regions()
            guarded(failures, self._read_alone, alone, planner, readers, share_regions if early else None)
        finally:
            share_regions()
            relayed = None if moving is None else moving.finish()
            if relayed is not None and failures is not None:
                failures.append(relayed)
        if failures:
            raise failures[0]
        if self.is_coordinator and self._totals is not None:
            nbytes, files, ranks = self._totals
            log_transfer("loaded", str(self.checkpoint_id), nbytes=nbytes, files=files, ranks=ranks,
                         seconds=time.perf_counter() - self._started)
        return done(None)

    def _few_small(self, items: list[ReadItem], readers: dict[str, BoxReader], most: int = EARLY_OWN_READS) -> bool:
        """Whether ``items`` are at most ``most`` bytes of tensors and values held in the root."""
        assert self.metadata is not None
        nbytes = 0
        for item in items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                if self.metadata.objects[fqn].encoding != object_values.JSON:
                    return False
                continue
            nbytes += readers[fqn].held_bytes(item.lengths, out=False)
        return nbytes <= most

    def _read_alone(self, items: list[ReadItem], planner: LoadPlanner, readers: dict[str, BoxReader],
                    first: Callable[[], None] | None = None) -> None:
        """This rank's own items, in batches of ``per_thread_copy_ahead`` bytes; ``first`` once one has started."""
        batch = self.source.batch()
        pending: list[tuple[ReadItem, torch.Tensor, PlannedBox, bool]] = []
        held, limit = 0, self.per_thread_copy_ahead
        scratch = Scratch()  # where values bound for a GPU (or another dtype) wait, reused batch after batch

        def flush() -> None:
            nonlocal held, first
            batch.run()
            if first is not None:
                hook, first = first, None
                hook()
            try:
                # Each chunk placed as its bytes arrive; a tensor committed once its last chunk is in.
                for k, step, last in by_arrival([box for _, _, box, _ in pending]):
                    item, dest, box, copy = pending[k]

                    def place() -> np.ndarray:
                        step()
                        return box.out

                    self._result(item.storage_index.fqn, dest, place, copy and last)
                    if last:
                        planner.commit_tensor(item, dest)
            finally:
                pending.clear()
                held = 0
                scratch.reset()

        for item in items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, DecodedValue(self._read_object(fqn)))
                continue
            reader = readers[fqn]
            # Detached like DCP's own reader: a destination that requires grad is still filled in place.
            dest = planner.resolve_tensor(item).detach()
            in_place = readable_in_place(dest, reader.dtype)
            nbytes = reader.held_bytes(item.lengths, out=in_place)
            if pending and limit is not None and held + nbytes > limit:
                flush()
            out = dtypes.tensor_as_numpy(dest) if in_place else scratch.take(tuple(item.lengths), reader.dtype)
            with self._errors_of(fqn):
                finish = reader.plan(item.storage_offsets, item.lengths, batch, out)
            pending.append((item, dest, finish, not in_place))
            held += nbytes
        flush()

    def _stored_dtype(self, fqn: str) -> torch.dtype:
        assert self.metadata is not None
        return dtypes.to_torch_dtype(dtypes.from_zarr(self.metadata.tensors[fqn].dtype))

    def _result(self, fqn: str, dest: torch.Tensor, read: Callable[[], np.ndarray], copy: bool) -> np.ndarray:
        """The checked values of one read, also copied into ``dest`` unless read in place."""
        with self._errors_of(fqn):
            data = read()
            if copy:
                dest.copy_(dtypes.numpy_as_tensor(data))
        return data

    @contextlib.contextmanager
    def _errors_of(self, fqn: str) -> Iterator[None]:
        try:
            yield
        except TsckptError:
            raise
        except Exception as e:
            raise read_error(fqn, str(self.checkpoint_id), e) from e

    def _read_object(self, fqn: str) -> Any:
        assert self.metadata is not None
        entry = self.metadata.objects[fqn]
        if entry.encoding == object_values.JSON:
            return object_values.from_json(entry.value)
        assert entry.path is not None
        return object_values.load_torch_value(self.source.read_blob(fqn, entry.path), key=fqn,
                                              where=str(self.checkpoint_id), allow_pickle=self.allow_pickle)


def _writer(md: CheckpointMetadata, region: Region) -> int | None:
    """The one rank that saved every chunk of ``region`` (None: several, or the checkpoint does not say)."""
    fqn, offsets, lengths = region
    entry = md.tensors[fqn]
    if entry.writers is None:
        return None
    chunks = entry.grid.chunks_overlapping([slice(o, o + n) for o, n in zip(offsets, lengths)])
    ranks = {int(entry.writer_ranks(md.world_size, fqn)[entry.grid.flat_index(c)]) for c in chunks}
    return ranks.pop() if len(ranks) == 1 else None
