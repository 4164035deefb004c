"""What a rank writes in a DCP save (contract, step 4): each item of its plan, as its :class:`RankPlan` says.

Tensors go into the chunks of the arrays the coordinator laid out, through a
:class:`~tsckpt.rank_writer.RankWriter` made with the save's orders; other
values are stored as JSON in the rank's summary, or as blobs. What the rank
wrote is its summary (:class:`RankWrites`), for the coordinator's commit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType

from ..base_chunks import BaseChunks
from ..errors import PlanError
from ..format import dtypes, object_values
from ..rank_writer import RankWriter
from ..storage.location import Location
from ..storage.store import Store
from .byte_io_values import encode_bytes
from .contract import RankPlan, RankWrites, SummaryBuilder, WriteConfig
from .failure import CTRL_C
from .planner import SavePlanner as TsckptSavePlanner
from .planner import placement_records
from .replica_writes import piece_of


def write_items(plan: SavePlan, planner: SavePlanner, writers: list[RankWriter], *, rank: int, where: str,
                data_store: Callable[[Location, WriteConfig], Store], window: int | None) -> RankWrites:
    """Write rank ``rank``'s items as its :class:`RankPlan` says, through a :class:`RankWriter` it adds to
    ``writers`` (so that the caller can abandon it); ``data_store`` opens where the coordinator said to write,
    ``window`` is the host-copy window (``per_thread_copy_ahead``)."""
    rank_plan = plan.storage_data
    if not isinstance(rank_plan, RankPlan):
        raise PlanError(f"saving {where}: rank {rank}'s plan carries no layout from the coordinator "
                        f"(was the global plan made by another storage writer?)")
    orders = rank_plan.orders.value
    config = orders.config
    store = data_store(orders.location, config)
    tensors = [item.index.fqn for item in plan.items if item.tensor_data is not None]
    arrays = rank_plan.entries(list(dict.fromkeys(tensors)), where)
    base = orders.base
    writer = RankWriter(store, rank, orders.save_id, "", options=config.array_options,
                        checksums=config.checksums, window=window, sync=config.sync_files,
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
