"""DCP storage writer: ``TensorStoreWriter`` writes a state dict into Zarr v3 arrays as
:mod:`tsckpt.dcp.contract` describes; it knows regions, dtypes and paths, never DTensors."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..base_chunks import BaseChoice, BaseChunks, choose_base, reuse_outcome
from ..commit import protocol as commit
from ..commit.protocol import begin_save
from ..commit.target import SaveTarget
from ..errors import OptionError, PlanError
from ..format import content_hashes, dtypes, object_values
from ..format.data_files import RankFiles
from ..format.metadata import ArrayOptions, ObjectEntry, intern_placement
from ..format.plan import DEFAULT_INNER_CHUNK_BYTES
from ..rank_writer import RankWriter
from ..storage.layouts import PACKED, get_layout
from ..storage.location import Location, LocationLike
from ..storage.store import Store
from .contract import NewOrders, Prepickled, RankPlan, RankSummary, RankWrites, SaveOrders, SummaryBuilder, WriteConfig
from .failure import CTRL_C, RankFailure, commit_or_clean_up, failed_summary
from .copy_window import DEFAULT_COPY_AHEAD, check_copy_ahead
from .global_layout import GlobalLayout
from .merged_chunks import MergedChunks, once_each, stored_values
from .io import (TensorStoreIO, check_serialization_format, done, log_save, logging_on, refuse_rank_local_saves,
                 resolve_compression, resolve_io_concurrency, resolve_layout)
from .plan_cache import CACHE
from .planner import SavePlanner as TsckptSavePlanner
from .planner import encode_bytes, placement_records
from .replica_writes import Holdings, piece_of, spread
from .staging import Stager


class TensorStoreWriter(TensorStoreIO, StorageWriter, Stager):
    """Write a DCP checkpoint as a Zarr v3 hierarchy, one array per global tensor.

    A drop-in for DCP's ``FileSystemWriter``: the same arguments in the same
    positions (torch 2.13-2.15, :mod:`tsckpt.dcp.io`), and an ``AsyncStager``
    (:class:`~tsckpt.dcp.staging.Stager`) for ``dcp.async_save``.
    Which method runs on which rank, in what order: :mod:`tsckpt.dcp.contract`.

    Args:
        path: checkpoint directory (or a kvstore spec), or ``checkpoint_id=`` to ``dcp.save``.
        single_file_per_rank: ``True`` means ``layout="packed"``, ``False`` ``"plain"``;
            ``None`` (the default here) leaves the choice to ``layout``.
        sync_files: ``False`` skips every fsync and records ``"synced": false`` in the metadata's ``extra``:
            faster, but a power loss may leave a committed checkpoint whose files are not on disk.
        thread_count: concurrent file operations per rank (TensorStore's I/O concurrency); the same as
            ``io_concurrency``.
        per_thread_copy_ahead: bytes of device (GPU) tensors a rank copies to host memory ahead of their writes
            (older writes finish before more are copied). Default 1 GiB; 0 copies one tensor at a time;
            ``None`` copies everything first. CPU tensors are written in place.
        cache_staged_state_dict: with ``dcp.async_save``, refill the staged CPU copies on the next save
            (:class:`~tsckpt.dcp.staging.Stager`).
        overwrite: replace a tsckpt checkpoint already at ``path`` (the default, as in DCP); ``False`` refuses
            with :class:`~tsckpt.errors.CheckpointExistsError` ("Checkpoint already exists ..."), before any
            data is written. Other files there are kept; Zarr data tsckpt did not write is refused either way
            (:class:`~tsckpt.errors.ForeignContentError`). On a local filesystem the old checkpoint stays
            loadable until the new one is complete; on object stores and ``memory://`` it is un-committed
            before the new data is written (docs/publication.md).
        _extensions: ``[ZStandard()]`` means ``compression="zstd"``; other extensions are refused.
        serialization_format: DCP's default (``TORCH_SAVE``) is accepted; ``SAFETENSORS`` is refused.
        layout: the storage layout, ``"plain"`` (one file or object per chunk; any Zarr reader opens it) or
            ``"packed"`` (one data file per rank and an OCDBT index of every key, written at commit; read
            through :func:`tsckpt.zarr_store`). ``None``: ``$TSCKPT_LAYOUT`` if set, else packed. Only the
            coordinator's choice counts in a multi-rank save.
        inner_chunk_bytes: the smallest inner chunk (Zarr's sharding codec) a save cuts outer chunks into,
            default 16 KiB (``docs/format.md``, section 5); 0 disables them.
        io_concurrency: TensorStore file I/O concurrency per rank.
        checksums: store a crc32c after every inner chunk (Zarr's ``crc32c`` codec) and a content hash of every
            outer chunk; every read checks each inner chunk it touches before returning any of it. On by
            default. Missing and truncated chunks are detected either way.
        crc32c_codec: store Zarr's ``crc32c`` codec with every chunk even with ``checksums=False``, for other
            readers to check data by.
        compression: ``None`` (default), ``"zstd"`` or ``"blosc"``.
        base: make this save incremental against a committed checkpoint (a path, URL, kvstore spec, or what
            :func:`tsckpt.latest` returns): every chunk equal to the base's is linked instead of written
            (:mod:`tsckpt.base_chunks`); deleting the base later changes nothing.
        incremental: ``True`` takes as base the newest committed checkpoint beside ``path`` (the previous save
            of a training loop), if any.

    In a multi-rank save the coordinator's options decide how every rank writes; other ranks' writers give only
    ``thread_count``/``io_concurrency`` and ``per_thread_copy_ahead``. ``dcp.save(..., use_collectives=False)``
    is refused on more than one rank.
    """

    def __init__(self, path: LocationLike | None = None, single_file_per_rank: bool | None = None,
                 sync_files: bool = True, thread_count: int | None = None,
                 per_thread_copy_ahead: int | None = DEFAULT_COPY_AHEAD, cache_staged_state_dict: bool = False,
                 overwrite: bool = True, _extensions: Sequence[Any] | None = None, serialization_format: Any = None,
                 *, layout: str | None = None, inner_chunk_bytes: int = DEFAULT_INNER_CHUNK_BYTES,
                 io_concurrency: int | None = None, checksums: bool = True, crc32c_codec: bool = False,
                 compression: str | None = None, base: LocationLike | None = None, incremental: bool = False):
        super().__init__(path, resolve_io_concurrency(thread_count, io_concurrency))
        Stager.__init__(self, cache_staged_state_dict)
        check_serialization_format(serialization_format)
        compression = resolve_compression(_extensions, compression)
        if not isinstance(checksums, bool):
            raise OptionError(f"checksums must be True or False, not {checksums!r}")
        self.array_options = ArrayOptions(crc32c_codec=checksums or crc32c_codec, compression=compression)
        self.layout = resolve_layout(single_file_per_rank, layout)
        self.sync_files = bool(sync_files)
        self.per_thread_copy_ahead = check_copy_ahead(per_thread_copy_ahead)
        self.overwrite = overwrite
        self.inner_chunk_bytes = inner_chunk_bytes
        self.checksums = checksums
        self.base, self.incremental = base, bool(incremental)
        self.is_coordinator = False
        self.rank = 0
        self.save_id = uuid.uuid4().hex
        self._target: SaveTarget | None = None
        self._data_store: tuple[tuple[Any, ...], Store] | None = None
        self._layout: GlobalLayout | None = None
        self._base: BaseChoice | None = None

    @property
    def config(self) -> WriteConfig:
        """How this writer would have every rank write, if it is the coordinator."""
        return WriteConfig(layout=self.layout, array_options=self.array_options, checksums=self.checksums,
                           inner_chunk_bytes=self.inner_chunk_bytes, sync_files=self.sync_files)

    def __getstate__(self) -> dict[str, Any]:
        return {**TensorStoreIO.__getstate__(self), "_staged": None, "_layout": None}

    def _open_store(self, location: Location, config: WriteConfig | None = None) -> Store:
        config = config or self.config
        return Store.open(location, io_concurrency=self.io_concurrency, layout=config.layout, sync=config.sync_files)

    def data_store(self, location: Location, config: WriteConfig) -> Store:
        """This save's store: where and how the coordinator said to write (its staging directory, or in place)."""
        key = (location, config.layout, config.sync_files)
        if self._data_store is None or self._data_store[0] != key:
            self._data_store = (key, self._open_store(location, config))
        return self._data_store[1]

    def reset(self, checkpoint_id: LocationLike | None = None) -> None:
        # DCP asks for storage_meta() before set_up_storage_writer: the id must exist by then.
        self._reset(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._reset(None)
        refuse_rank_local_saves(kwargs.get("use_collectives", True), str(self.checkpoint_id))
        self._started = time.perf_counter()
        self.is_coordinator = is_coordinator
        # The packed layout gives each rank its own database, so the rank must be right.
        self.rank = int(kwargs["rank"] if "rank" in kwargs else dist.get_rank() if dist.is_initialized() else 0)
        self._target, self._data_store, self._layout, self._base = None, None, None, None
        self._orders_save_id = None
        if is_coordinator:
            assert self.location is not None
            self._base = choose_base(self.location, self.base, incremental=self.incremental, layout=self.layout,
                                     options=self.array_options, checksums_on=self.checksums)

    def _begin(self) -> SaveTarget:
        """Coordinator, once every rank has planned (a rank stopped while planning leaves nothing begun):
        refuse, or claim the location; Ctrl-C once it is claimed removes it."""
        assert self.location is not None
        with CTRL_C.watched():
            target = None
            try:
                with CTRL_C.step():
                    target = begin_save(self.location, save_id=self.save_id, overwrite=self.overwrite,
                                        writes=get_layout(self.config.layout).prefixes_before_planning(self.save_id))
            except KeyboardInterrupt:
                if target is not None:
                    target.abort()
                raise
        return target

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Attach what this rank holds (:class:`Holdings`), so that the coordinator finds its replicas (step 2)."""
        if not plan.usable:  # DCP's cache kept it: the coordinator has the holdings from the first time
            return plan
        return dataclasses.replace(plan, storage_data=Holdings.of(plan))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Lay out every array from all ranks' regions; give each rank its :class:`RankPlan` (contract, step 3)."""
        where = str(self.checkpoint_id)
        if not self.is_coordinator:
            raise OptionError(f"saving {where}: the global plan was made on a rank that is not "
                              f"the coordinator (use_collectives=False is not supported)")
        self._target = self._begin()
        try:
            return self._global_plan(plans, where)
        except BaseException:  # DCP then never calls finish: nothing of this save may stay
            self._target.abort()
            raise

    def _global_plan(self, plans: list[SavePlan], where: str) -> list[SavePlan]:
        assert self._target is not None
        full, key = CACHE.full_plans(plans, where)
        bands = get_layout(self.config.layout).bands(self._target.data_location)
        kept = CACHE.layout(key, full, self.inner_chunk_bytes, bands)
        if kept is not None:
            layout, sent = kept
        else:
            sent = spread(full)  # replicated tensors written by all their replicas
            layout = GlobalLayout.plan(sent, self.inner_chunk_bytes, where, bands=bands)
        self._layout = layout
        self._target.record_writes(get_layout(self.config.layout).rank_prefixes(
            [e.path for e in layout.entries.values()] + list(layout.blobs.values()), self.save_id))
        orders = Prepickled(SaveOrders(self.config, self._target.data_location, self.save_id, self._base))
        if kept is not None and CACHE.ranks_keep_their_plans(plans):
            # Every rank still holds the plan it was sent with this layout: this save's orders are all it needs.
            return [SavePlan([], storage_data=NewOrders(orders), usable=False)] * len(plans)
        rank_plans = [RankPlan(orders, table, objects, layout.placed)
                      for table, objects in zip(layout.tables, layout.objects)]
        if key is None:
            return [dataclasses.replace(p, storage_data=rp) for p, rp in zip(sent, rank_plans)]
        return CACHE.send(key, full, sent, layout, rank_plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items as its :class:`RankPlan` says (contract, step 4). A failure, or Ctrl-C, is
        reported in the summary, not raised, once every write this rank started has ended
        (:mod:`tsckpt.dcp.failure`): only the coordinator's ``finish`` can remove what the save staged."""
        writers: list[RankWriter] = []
        if self.is_coordinator and not isinstance(planner, TsckptSavePlanner):
            CACHE.note(planner)  # its full plans, for the next save DCP's plan cache finds unchanged
        orders = getattr(plan.storage_data, "orders", None)
        save_id = orders.value.save_id if orders is not None else self.save_id
        self._orders_save_id = save_id
        with CTRL_C.watched():
            try:
                return done(write_items(plan, planner, writers, rank=self.rank, where=str(self.checkpoint_id),
                                        data_store=self.data_store, window=self.per_thread_copy_ahead))
            except Exception as e:
                failure = RankFailure.of(self.rank, e)
            except KeyboardInterrupt:
                failure = RankFailure.ctrl_c(self.rank)
            except BaseException:
                for writer in writers:
                    writer.abandon()
                raise
            # The first Ctrl-C waits with this step (cut short, writes would land after the clean-up); a second
            # stops it and reaches tsckpt.save, whose clean-up waits for the writes to land (failure.interrupted).
            waited = False
            try:
                with CTRL_C.step():
                    for writer in writers:
                        writer.abandon()
                    waited = True
            except KeyboardInterrupt:
                if not waited:
                    raise
                failure = RankFailure.ctrl_c(self.rank)
        return done(RankWrites([], failed_summary(self.rank, save_id, failure)))

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator, after every rank wrote or failed: commit (contract, step 5), or remove what was staged
        and raise :class:`~tsckpt.errors.SaveFailedError` (:mod:`tsckpt.dcp.failure`)."""
        where = str(self.checkpoint_id)
        assert self._target is not None, "finish runs on the coordinator, after planning"
        commit_or_clean_up(self._target, self.rank,
                           lambda: [RankWrites.summary_of(results_of, self.save_id, where) for results_of in results],
                           lambda summaries: self._commit(metadata, summaries))

    def _commit(self, metadata: Metadata, summaries: list[RankSummary]) -> None:
        where = str(self.checkpoint_id)
        layout = self._layout
        assert layout is not None and self._target is not None, "finish runs on the coordinator, after planning"
        objs: dict[str, ObjectEntry] = {}
        blob_sizes: dict[str, int] = {}
        blob_refs: dict[str, tuple[str, list[int]]] = {}
        placements = dict(layout.placements)
        for summary in summaries:
            for fqn, record in summary.placements.items():
                placements.setdefault(fqn, record)
            for fqn, info in summary.objects.items():
                if info["encoding"] == object_values.JSON:
                    objs[fqn] = ObjectEntry(layout.key_path(fqn), object_values.JSON, value=info["value"])
                else:
                    objs[fqn] = ObjectEntry(layout.key_path(fqn), object_values.TORCH, path=layout.blobs[fqn],
                                            writer=summary.rank)
                    blob_sizes[fqn] = info["nbytes"]
                    if "ref" in info:
                        blob_refs[fqn] = (summary.files[info["ref"][0]], info["ref"][1:])
        layout.check_planned(metadata, self.checkpoint_id)
        written = MergedChunks.merge(summaries, layout.nchunks, list(layout.entries), where)
        meshes: list = []
        seen: dict[int, int] = {}  # the placement records stay alive here, so their ids do too
        tensors, reused = {}, {}
        for number, (fqn, planned) in enumerate(layout.entries.items()):
            reused[fqn] = written.reused[written.rows_of(number)]
            tensors[fqn] = dataclasses.replace(
                planned, placement=intern_placement(placements.get(fqn), meshes, f"tensor {fqn!r}", seen))
        tensors = written.writers(tensors)
        stored = None
        if self.config.layout == PACKED:
            stored = stored_values(tensors, written, {objs[f].path: r for f, r in blob_refs.items()})
        reuse = reuse_outcome(self._base, tensors, reused, sum(blob_sizes.values()))
        extra: dict[str, Any] = {"save_id": self.save_id, **({} if self.sync_files else {"synced": False})}
        ranks = once_each([s.stored if s.stored is not None else RankFiles() for s in summaries])
        commit.commit_checkpoint(
            self.data_store(self._target.data_location, self.config), save_id=self.save_id,
            world_size=len(summaries), tensors=tensors, objects=objs, blob_sizes=blob_sizes, ranks=ranks,
            stored=stored, meshes=meshes, extra=extra, options=self.array_options, target=self._target,
            content_hash=content_hashes.STORED_ALGORITHM if self.checksums else None, reuse=reuse)
        if logging_on():
            log_save(where, tensors, [objs[k].path for k in blob_sizes], blob_sizes.values(),
                     seconds=time.perf_counter() - self._started, ranks=len(summaries), reuse=reuse)


def write_items(plan: SavePlan, planner: SavePlanner, writers: list[RankWriter], *, rank: int, where: str,
                data_store: Callable[[Location, WriteConfig], Store], window: int | None) -> RankWrites:
    """Write rank ``rank``'s items as its :class:`RankPlan` says, through a ``RankWriter`` added to ``writers``."""
    rank_plan = plan.storage_data
    if not isinstance(rank_plan, RankPlan):
        raise PlanError(f"saving {where}: rank {rank}'s plan carries no layout from the coordinator "
                        f"(was the global plan made by another storage writer?)")
    orders = rank_plan.orders.value
    config, base = orders.config, orders.base
    store = data_store(orders.location, config)
    tensors = dict.fromkeys(item.index.fqn for item in plan.items if item.tensor_data is not None)
    arrays = rank_plan.entries(list(tensors), where)
    writer = RankWriter(store, rank, orders.save_id, "", options=config.array_options, checksums=config.checksums,
                        window=window, sync=config.sync_files,
                        base=BaseChunks(base, store) if base is not None and base.mode else None)
    writers.append(writer)
    writer.open({fqn: entry for fqn, (_, entry) in arrays.items()})
    summary = SummaryBuilder(rank, orders.save_id)
    if not isinstance(planner, TsckptSavePlanner):
        # DCP's own planner puts no placements in the plans: this rank describes its share here.
        summary.placements.update(placement_records(planner, rank))
    for item in plan.items:
        fqn = item.index.fqn
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            _write_object(writer, fqn, rank_plan.objects[fqn], data, summary)
            continue
        entry = arrays[fqn][1]
        if dtypes.from_torch(data.dtype).zarr != entry.dtype:
            raise PlanError(f"saving {where}: tensor {fqn!r} is {data.dtype} on rank {rank}, but its "
                            f"array was laid out as {entry.dtype}")
        chunk = item.tensor_data.chunk
        if tuple(chunk.sizes) != tuple(data.shape):  # a piece of a replicated tensor (replica_writes)
            data = piece_of(data, item, where)
        with CTRL_C.step():
            writer.write(fqn, chunk.offsets, data)
    with CTRL_C.step():
        stored = writer.finish()
    for fqn, chunks in writer.written.items():
        summary.add(arrays[fqn][0], chunks)
    for fqn, ref in writer.blobs.items():
        summary.place_object(fqn, ref)
    # No WriteResult per item: DCP only hands the gathered results to ``finish``, which reads the summary.
    return RankWrites([], summary.done(stored))


def _write_object(writer: RankWriter, fqn: str, path: str, data: Any, summary: SummaryBuilder) -> None:
    encoding, payload = encode_bytes(data)
    if encoding == object_values.JSON:
        summary.add_object(fqn, encoding, payload, 0)
        return
    with CTRL_C.step():  # not the pickling above: that may run for long, and starts no write
        writer.write_blob(fqn, path, payload)
    summary.add_object(fqn, encoding, None, len(payload))
