"""The rank side of replica reads (:mod:`tsckpt.dcp.replica_reads`): regions fetched once by their owner and
sent, or received, in one global order.

Point-to-point messages on the default process group, one per receiver (an owner whose read failed still
sends, so no receiver waits forever), then one status per receiver: success, or the first error, which the
receiver raises. Every rank posts in the schedule's global order, as NCCL needs (it ignores tags and runs a
pair's messages in posting order); receives gloo carries (matched by sender and tag) are posted when planned.
Bytes travel in the stored dtype, straight from and into the destination where the backend carries it. A
failure never leaves a transfer undone: it is kept, and raised once every transfer is (a region whose read
failed may already sit in its destination).
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
import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from ..errors import ChecksumError, StorageError, TsckptError
from ..format import band_order, dtypes
from ..format.grid import ChunkGrid
from ..storage.box_reader import BoxReader
from ..storage.byte_reads import RangeBatch
from .copy_window import CopyWindow
from .replica_reads import Transfer

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
        # A receive posted when planned (gloo) is waited for after its round's sends (last of all if it holds no
        # buffer): in the global order, each region would be a round trip between ranks.
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
        """``transfers`` in rounds of at most ``per_thread_copy_ahead`` bytes fetched by ``rank`` (or one region)."""
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
        """Admit a received region's buffer (none when ``dest`` takes it): its bytes, the receive, whether posted."""
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


#: Status codes an owner sends after the bytes: 0 for checked reads, else 1 + the class of the first error raised.
FAILURES: tuple[type[TsckptError], ...] = (ChecksumError, StorageError, TsckptError)
#: Bytes of a status message: a code, then the owner's error text (UTF-8, cut to fit, zero-padded).
STATUS_BYTES = 512
#: The tag of the status messages; a region's bytes go with tag ``2 * seq + 1``.
STATUS_TAG = 0


def _status(error: BaseException | None, device: torch.device) -> torch.Tensor:
    out = torch.zeros(STATUS_BYTES, dtype=torch.uint8)
    if error is not None:
        out[0] = next((k + 1 for k, cls in enumerate(FAILURES) if isinstance(error, cls)), len(FAILURES))
        text = str(error).encode("utf-8", "replace")[:STATUS_BYTES - 1]
        out[1:1 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return out.to(device)


def _relayed(status: torch.Tensor, owner: int, where: str) -> TsckptError | None:
    status = status.cpu()
    code = int(status[0])
    if not code:
        return None
    cls = FAILURES[min(code, len(FAILURES)) - 1]
    text = bytes(status[1:].numpy()).rstrip(b"\0").decode("utf-8", "replace")
    if not text:
        text = f"{where}: a region rank {owner} fetched could not be read"
    # relayed_from lets tsckpt.load show the owner's own error first.
    return cls(f"{text} (rank {owner} fetched it for this rank too)", relayed_from=owner)


def _backends(backend: str) -> dict[str, str] | None:
    """The backend of each device type the default group sends (None: unknown, assume the destination's)."""
    if ":" in backend:  # "cpu:gloo,cuda:nccl"
        return dict(part.split(":", 1) for part in backend.split(","))  # type: ignore[misc]
    device = {"gloo": "cpu", "nccl": "cuda", "mpi": "cpu"}.get(backend)
    return None if device is None else {device: backend}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


#: Bytes of sent copies a rank keeps while they leave before it waits for the oldest (each wait cost ~1 ms).
MAX_COPIES_LEAVING = 64 << 20


class ReplicaTransfers:
    """One rank's sends and receives of shared regions during one ``read_data``. ``stored(fqn)``: a tensor's
    stored torch dtype. Sends stay in flight until :meth:`finish`, which every rank must reach, whatever failed
    before, and which exchanges the statuses."""

    def __init__(self, rank: int, where: str, stored: Callable[[str], torch.dtype],
                 max_copies: int | None = MAX_COPIES_LEAVING):
        self.rank, self.where, self.stored = rank, where, stored
        self.backends = _backends(dist.get_backend())
        self.max_copies = MAX_COPIES_LEAVING if max_copies is None else min(max_copies, MAX_COPIES_LEAVING)
        self._sends: list[tuple[Any, torch.Tensor]] = []  # (work, what it sends: kept alive until sent)
        self._copies: collections.deque[tuple[list[tuple[Any, torch.Tensor]], int]] = collections.deque()
        self._copy_bytes = 0
        # receiver -> (first error of this rank's reads for it, wire device); owner -> wire device.
        self._told: dict[int, tuple[BaseException | None, torch.device]] = {}
        self._owners: dict[int, torch.device] = {}

    def wire_device(self, dest: torch.Tensor) -> torch.device:
        """The device a region for ``dest`` travels on: its own if the backend carries it."""
        if self.backends is None or dest.device.type in self.backends:
            return dest.device
        if "cpu" in self.backends:
            return torch.device("cpu")
        return torch.device(next(iter(self.backends)), torch.accelerator.current_device_index())

    def posts_early(self, wire: torch.device) -> bool:
        """Whether a receive on ``wire`` may be posted ahead of this rank's earlier sends (gloo only)."""
        return self.backends is not None and self.backends.get(wire.type) == "gloo"

    def direct(self, dest: torch.Tensor, fqn: str) -> bool:
        return self.wire_device(dest) == dest.device and dest.dtype == self.stored(fqn) and dest.is_contiguous()

    def send(self, transfer: Transfer, payload: torch.Tensor, error: BaseException | None, copy: bool) -> None:
        """Send ``payload`` (contiguous, stored dtype, on the wire) to the receivers; ``error`` goes in the status."""
        data = as_bytes(payload)
        sends = []
        for peer in transfer.receivers:
            sends.append((dist.isend(data, dst=peer, tag=2 * transfer.seq + 1), data))
            if peer not in self._told or (self._told[peer][0] is None and error is not None):
                self._told[peer] = error, payload.device
        if not copy:
            self._sends += sends
            return
        self._copies.append((sends, data.numel()))
        self._copy_bytes += data.numel()
        while self._copies and self._copy_bytes > self.max_copies:
            self._copy_bytes -= self._wait_oldest_copy()

    def _wait_oldest_copy(self) -> int:
        sends, nbytes = self._copies.popleft()
        for work, _ in sends:
            work.wait()
        return nbytes

    def receive(self, transfer: Transfer, into: torch.Tensor) -> Callable[[], None]:
        """Start receiving the region into ``into``; returns its wait (the owner's status comes at :meth:`finish`)."""
        work = dist.irecv(as_bytes(into), src=transfer.owner, tag=2 * transfer.seq + 1)
        self._owners.setdefault(transfer.owner, into.device)
        return work.wait

    def finish(self) -> TsckptError | None:
        """Exchange the statuses, and wait until every send has left (the receivers depend on them, whatever
        this rank raises): the first failure an owner relayed to this rank, or None."""
        told, heard = self._told, {owner: torch.zeros(STATUS_BYTES, dtype=torch.uint8, device=device)
                                   for owner, device in self._owners.items()}
        self._told, self._owners = {}, {}
        sends, self._sends = self._sends, []
        works = []
        # Two ranks may each owe the other a status: the lower one's goes first on both, as NCCL runs a pair's
        # messages in the order posted (a send ahead of the receive its peer waits on would wait forever).
        for peer in sorted(told.keys() | heard.keys()):
            first = self.rank < peer
            if first and peer in told:
                sends.append(self._send_status(peer, *told[peer]))
            if peer in heard:
                works.append(dist.irecv(heard[peer], src=peer, tag=STATUS_TAG))
            if not first and peer in told:
                sends.append(self._send_status(peer, *told[peer]))
        for work, _ in sends:
            work.wait()
        while self._copies:
            self._wait_oldest_copy()
        self._copy_bytes = 0
        for work in works:
            work.wait()
        return next((e for e in (_relayed(heard[owner], owner, self.where) for owner in sorted(heard)) if e), None)

    @staticmethod
    def _send_status(peer: int, error: BaseException | None, device: torch.device) -> tuple[Any, torch.Tensor]:
        status = _status(error, device)
        return dist.isend(status, dst=peer, tag=STATUS_TAG), status
