"""Regions a rank shares with its replicas: fetched once by their owner and sent, or received.

With replica reads on (:mod:`tsckpt.dcp.replica_reads` decides who fetches
what), every rank of a load walks the same list of shared regions, in one
global order: a region's owner plans its checked read into a batch (the
regions of one round are fetched together, their ranges merged per file) and
sends it once the batch has run; the others post its receive (where gloo
carries it, as soon as it is planned, and wait for it once their round's sends
are out). Runs inside
:meth:`TensorStoreReader.read_data <tsckpt.dcp.reader.TensorStoreReader.read_data>`
on every rank, before the regions a rank reads alone (a few small ones of those
are fetched meanwhile, and placed after). A failure on one rank never leaves a
transfer undone: it is kept, and raised once every transfer is. A receiver
learns whether its owner's reads succeeded only from the status that follows
them all (:mod:`~tsckpt.dcp.replica_transfers`), so a region whose read failed
may already sit in its destination when the load raises, as the regions read
before any failure do.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from ..format import band_order, dtypes
from ..format.grid import ChunkGrid
from ..storage.box_reader import BoxReader
from ..storage.byte_reads import RangeBatch
from .copy_window import CopyWindow
from .replica_reads import Transfer
from .replica_transfers import ReplicaTransfers

T = TypeVar("T")


class SharedReads:
    """One rank's part in the shared regions of one load: ``reader`` is the rank's
    :class:`~tsckpt.dcp.reader.TensorStoreReader` (its source, dtypes, checks and copy-ahead bound)."""

    def __init__(self, reader: Any, plan: LoadPlan, planner: LoadPlanner, readers: dict[str, BoxReader],
                 moving: ReplicaTransfers, buffers: CopyWindow, failures: list[Exception]):
        self.reader, self.plan, self.planner, self.readers = reader, plan, planner, readers
        self.moving, self.buffers, self.failures = moving, buffers, failures

    def run(self, transfers: list[Transfer], rank: int) -> None:
        """Fetch and send, or receive, every region of ``transfers``, in order; the regions this rank fetches
        are read in rounds of one batch each."""
        targets = _Targets(transfers)
        items = self.plan.items
        # A receive posted when planned (gloo) is waited for after every send of its round (last of all if it
        # goes straight into its destination and holds no buffer), so this rank sends what it owns as soon as
        # it has it. Waited for in the global order, each region would be a round trip between its ranks: on
        # the S3 benchmark's small state (1200 stripes), 1.4 s of a 2.6 s replicated load.
        waits: list[Callable[[], None]] = []
        for round_ in self._rounds(transfers, self.plan, self.readers, rank):
            batch = self.reader.source.batch()

            def share(t: Transfer) -> tuple[int, Callable[[], None], bool] | None:
                return guarded(self.failures, self._share, items[t.item], t, self.planner,
                               self.readers[items[t.item].storage_index.fqn], self.moving, self.buffers, batch,
                               targets)

            # This rank's fetches start before it posts its receives (on the S3 benchmark's small state, 900
            # receives took 0.1-0.2 s to post), then every step is taken in the global order.
            fetched = {k: share(t) for k, t in enumerate(round_) if t.owner == rank}
            batch.run()
            steps = [fetched[k] if k in fetched else share(t) for k, t in enumerate(round_)]
            received: list[tuple[int, Callable[[], None]]] = []
            for step in steps:
                if step is None:
                    continue
                nbytes, complete, posted = step
                finish = functools.partial(guarded, self.failures, complete)
                if posted and not nbytes:
                    waits.append(finish)
                elif posted:
                    received.append((nbytes, finish))
                else:
                    self.buffers.add(nbytes, finish)
            for nbytes, finish in received:
                self.buffers.add(nbytes, finish)
        self.buffers.drain()
        for wait in waits:
            wait()

    def _rounds(self, transfers: list[Transfer], plan: LoadPlan, readers: dict[str, BoxReader],
                rank: int) -> Iterator[list[Transfer]]:
        """``transfers`` in order, cut into rounds whose regions fetched by ``rank`` hold at most
        ``per_thread_copy_ahead`` bytes (or one region, if larger)."""
        limit, held, round_ = self.reader.per_thread_copy_ahead, 0, []
        for t in transfers:
            item = plan.items[t.item]
            _, lengths = t.box(item.storage_offsets, item.lengths)
            nbytes = readers[item.storage_index.fqn].held_bytes(lengths, out=False) if t.owner == rank else 0
            if round_ and limit is not None and held + nbytes > limit:
                yield round_
                round_, held = [], 0
            round_.append(t)
            held += nbytes
        if round_:
            yield round_

    def _share(self, item: ReadItem, transfer: Transfer, planner: LoadPlanner, reader: BoxReader,
               moving: ReplicaTransfers, buffers: CopyWindow, batch: RangeBatch,
               targets: _Targets) -> tuple[int, Callable[[], None], bool]:
        """Take part in one shared region (an item, or a stripe of it): plan its fetch into ``batch`` (its
        owner), or its receive.

        Returns the bytes it holds, the step that completes it (send or
        receive; the item is committed once its last stripe is in), which the
        caller queues in ``buffers`` once ``batch`` runs, in the global order,
        and whether it is a receive already posted.
        The step never leaves a transfer undone: a failure is raised after it
        (and kept by the caller).
        """
        dest, error = targets.resolve(transfer.item, item, planner, self.reader._stored_dtype)
        offsets, lengths = transfer.box(item.storage_offsets, item.lengths)
        part = dest
        if transfer.part is not None:
            d, start, stop = transfer.part
            part = dest.narrow(d, start, stop - start)
        box = _Box(item.storage_index.fqn, offsets, lengths)
        posted = False
        if transfer.owner == moving.rank:
            nbytes, step = self._fetch_and_send(box, transfer, part, error, reader, moving, buffers, batch)
        else:
            nbytes, step, posted = self._receive(box, transfer, part, error, moving, buffers)

        def complete() -> None:
            try:
                step()
            finally:
                last = targets.done(transfer.item)
            if last and error is None:
                planner.commit_tensor(item, dest)

        return nbytes, complete, posted

    def _receive(self, item: _Box, transfer: Transfer, dest: torch.Tensor, error: Exception | None,
                 moving: ReplicaTransfers, buffers: CopyWindow) -> tuple[int, Callable[[], None], bool]:
        """Admit the buffer a received region needs (none when ``dest`` takes it): its bytes, the receive,
        and whether it is posted already (see :mod:`~tsckpt.dcp.replica_transfers`)."""
        fqn = item.fqn
        direct = moving.direct(dest, fqn)
        stored = self.reader._stored_dtype(fqn)
        nbytes = 0 if direct else math.prod(item.lengths) * stored.itemsize
        buffers.admit(nbytes)
        wire = moving.wire_device(dest)
        into = dest if direct else torch.empty(tuple(item.lengths), dtype=stored, device=wire)
        early = moving.posts_early(wire)
        posted = moving.receive(transfer, into) if early else None

        def receive() -> None:
            (posted or moving.receive(transfer, into))()
            if error is not None:
                raise error
            if not direct:
                dest.copy_(into)

        return nbytes, receive, early

    def _fetch_and_send(self, item: _Box, transfer: Transfer, dest: torch.Tensor, error: Exception | None,
                        reader: BoxReader, moving: ReplicaTransfers, buffers: CopyWindow,
                        batch: RangeBatch) -> tuple[int, Callable[[], None]]:
        """Plan the checked read of a region this rank owns into ``batch``: its held bytes, and the step that
        sends it (after ``batch`` runs).

        The step sends even when the read failed (the receivers are told),
        then raises the failure.
        """
        in_place = readable_in_place(dest, reader.dtype)
        nbytes = reader.held_bytes(item.lengths, out=in_place)
        buffers.admit(nbytes)
        read: Callable[[], np.ndarray] | None = None
        try:
            if error is None:
                read = reader.plan(item.offsets, item.lengths, batch,
                                   out=dtypes.tensor_as_numpy(dest) if in_place else None)
        except Exception as e:  # noqa: BLE001 - the receivers are told, then it is raised
            error = e

        def send() -> None:
            failed, data = error, None
            if read is not None:
                try:
                    data = self.reader._result(item.fqn, dest, read, not in_place)
                except Exception as e:  # noqa: BLE001 - as above
                    failed = e
            wire = moving.wire_device(dest)
            if moving.direct(dest, item.fqn):
                payload = dest
            elif data is not None:
                payload = dtypes.numpy_as_tensor(np.ascontiguousarray(data)).to(wire)
            else:
                payload = torch.empty(tuple(item.lengths), dtype=self.reader._stored_dtype(item.fqn), device=wire)
            moving.send(transfer, payload, failed, copy=payload is not dest)
            if failed is not None:
                raise failed

        return nbytes, send


def guarded(failures: list[Exception] | None, step: Callable[..., T], *args: Any) -> T | None:
    """Run ``step``; with ``failures`` (replicas depend on this rank), keep its error there instead of
    raising (and give None)."""
    if failures is None:
        return step(*args)
    try:
        return step(*args)
    except Exception as e:  # noqa: BLE001 - raised once every transfer is done
        failures.append(e)
        return None



def stripes_along(grid: ChunkGrid) -> tuple[tuple[int, int, int], ...]:
    """Where replicas may cut a tensor's shared regions, best first: the dimension, its outer chunk and its
    extent."""
    return tuple((d, grid.chunk_shape[d], grid.shape[d]) for d in band_order.stripe_dims(grid))


def readable_in_place(dest: torch.Tensor, stored: np.dtype) -> bool:
    """Whether a box can be read straight into ``dest``, with no host buffer."""
    return dest.device.type == "cpu" and dtypes.from_torch(dest.dtype).numpy == stored


@dataclasses.dataclass(frozen=True)
class _Box:
    """What one transfer moves: a box of tensor ``fqn``, as stored."""

    fqn: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]


class _Targets:
    """The destination of each shared item, resolved once, and how many of its transfers are still to come."""

    def __init__(self, transfers: list[Transfer]):
        self.left: dict[int, int] = {}
        for t in transfers:
            self.left[t.item] = self.left.get(t.item, 0) + 1
        self._dests: dict[int, tuple[torch.Tensor, Exception | None]] = {}

    def resolve(self, index: int, item: ReadItem, planner: LoadPlanner,
                stored: Callable[[str], torch.dtype]) -> tuple[torch.Tensor, Exception | None]:
        """The item's destination (or, if the planner fails to give one, a scratch tensor and why)."""
        if index not in self._dests:
            try:
                self._dests[index] = planner.resolve_tensor(item).detach(), None
            except Exception as e:  # noqa: BLE001 - the transfers still happen, through a scratch tensor
                self._dests[index] = torch.empty(tuple(item.lengths), dtype=stored(item.storage_index.fqn)), e
        return self._dests[index]

    def done(self, index: int) -> bool:
        """One transfer of item ``index`` is complete; whether it was its last."""
        self.left[index] -= 1
        if self.left[index]:
            return False
        self._dests.pop(index, None)
        return True
