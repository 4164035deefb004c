"""Regions a rank shares with its replicas (:mod:`tsckpt.dcp.replica_reads`), fetched once by their owner and
sent or received in one global order. A failure never leaves a transfer undone: it is kept, and raised once
every transfer is (a region whose read failed may already sit in its destination).
"""

from __future__ import annotations

import collections
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
    """One rank's part in the shared regions of one load (``reader``: its ``TensorStoreReader``)."""

    def __init__(self, reader: Any, plan: LoadPlan, planner: LoadPlanner, readers: dict[str, BoxReader],
                 moving: ReplicaTransfers, buffers: CopyWindow, failures: list[Exception]):
        self.reader, self.plan, self.planner, self.readers = reader, plan, planner, readers
        self.moving, self.buffers, self.failures = moving, buffers, failures

    def run(self, transfers: list[Transfer], rank: int) -> None:
        """Fetch and send, or receive, every region of ``transfers`` in order, in rounds of one batch each."""
        targets = _Targets(transfers)
        items = self.plan.items
        # A receive posted when planned (gloo) is waited for after every send of its round (last of all if it
        # holds no buffer): waited for in the global order, each region would be a round trip between ranks.
        waits: list[Callable[[], None]] = []
        for round_ in self._rounds(transfers, rank):
            batch = self.reader.source.batch()

            def share(t: Transfer) -> tuple[int, Callable[[], None], bool] | None:
                return guarded(self.failures, self._share, items[t.item], t, batch, targets)

            # This rank's fetches start before it posts its receives, then every step is taken in global order.
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

    def _rounds(self, transfers: list[Transfer], rank: int) -> Iterator[list[Transfer]]:
        """``transfers`` in rounds whose regions fetched by ``rank`` hold at most ``per_thread_copy_ahead`` bytes
        (or one region, if larger)."""
        limit, held, round_ = self.reader.per_thread_copy_ahead, 0, []
        for t in transfers:
            item = self.plan.items[t.item]
            _, lengths = t.box(item.storage_offsets, item.lengths)
            nbytes = self.readers[item.storage_index.fqn].held_bytes(lengths, out=False) if t.owner == rank else 0
            if round_ and limit is not None and held + nbytes > limit:
                yield round_
                round_, held = [], 0
            round_.append(t)
            held += nbytes
        if round_:
            yield round_

    def _share(self, item: ReadItem, transfer: Transfer, batch: RangeBatch,
               targets: _Targets) -> tuple[int, Callable[[], None], bool]:
        """Plan one shared region's fetch into ``batch`` (its owner) or its receive: the bytes it holds, the
        step that sends or receives it (committing the item after its last stripe), and whether it is a
        receive already posted."""
        dest, error = targets.resolve(transfer.item, item, self.planner, self.reader._stored_dtype)
        offsets, lengths = transfer.box(item.storage_offsets, item.lengths)
        part = dest
        if transfer.part is not None:
            d, start, stop = transfer.part
            part = dest.narrow(d, start, stop - start)
        box = _Box(item.storage_index.fqn, offsets, lengths)
        posted = False
        if transfer.owner == self.moving.rank:
            nbytes, step = self._fetch_and_send(box, transfer, part, error, batch)
        else:
            nbytes, step, posted = self._receive(box, transfer, part, error)

        def complete() -> None:
            try:
                step()
            finally:
                last = targets.done(transfer.item)
            if last and error is None:
                self.planner.commit_tensor(item, dest)

        return nbytes, complete, posted

    def _receive(self, item: _Box, transfer: Transfer, dest: torch.Tensor,
                 error: Exception | None) -> tuple[int, Callable[[], None], bool]:
        """Admit the buffer a received region needs (none when ``dest`` takes it): its bytes, the receive,
        and whether it is posted already."""
        fqn, moving = item.fqn, self.moving
        direct = moving.direct(dest, fqn)
        stored = self.reader._stored_dtype(fqn)
        nbytes = 0 if direct else math.prod(item.lengths) * stored.itemsize
        self.buffers.admit(nbytes)
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
                        batch: RangeBatch) -> tuple[int, Callable[[], None]]:
        """Plan the checked read of a region this rank owns into ``batch``: its held bytes, and the step that
        sends it after ``batch`` runs (even when the read failed, then raising)."""
        reader, moving = self.readers[item.fqn], self.moving
        in_place = readable_in_place(dest, reader.dtype)
        nbytes = reader.held_bytes(item.lengths, out=in_place)
        self.buffers.admit(nbytes)
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
    """Run ``step``; with ``failures`` (replicas depend on this rank), keep its error there and give None."""
    if failures is None:
        return step(*args)
    try:
        return step(*args)
    except Exception as e:  # noqa: BLE001 - raised once every transfer is done
        failures.append(e)
        return None


def stripes_along(grid: ChunkGrid) -> tuple[tuple[int, int, int], ...]:
    """Where replicas may cut a tensor's shared regions, best first: (dimension, outer chunk, extent)."""
    return tuple((d, grid.chunk_shape[d], grid.shape[d]) for d in band_order.stripe_dims(grid))


def readable_in_place(dest: torch.Tensor, stored: np.dtype) -> bool:
    return dest.device.type == "cpu" and dtypes.from_torch(dest.dtype).numpy == stored


@dataclasses.dataclass(frozen=True)
class _Box:
    fqn: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]


class _Targets:
    """The destination of each shared item, resolved once, and how many of its transfers are still to come."""

    def __init__(self, transfers: list[Transfer]):
        self.left = collections.Counter(t.item for t in transfers)
        self._dests: dict[int, tuple[torch.Tensor, Exception | None]] = {}

    def resolve(self, index: int, item: ReadItem, planner: LoadPlanner,
                stored: Callable[[str], torch.dtype]) -> tuple[torch.Tensor, Exception | None]:
        """The item's destination (or, if the planner gives none, a scratch tensor and why)."""
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
