"""Replicas read once, the bytes: an owner sends a region it fetched to the ranks that also need it.

Point-to-point messages on the default process group, one per receiver (an owner whose read failed still
sends, so no receiver waits forever), then one status per receiver: success, or the first error, which the
receiver raises. Every rank posts in the schedule's global order, as NCCL needs (it ignores tags and runs a
pair's messages in posting order); receives gloo carries (matched by sender and tag) are posted when planned.
Bytes travel in the stored dtype, straight from and into the destination where the backend carries it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ChecksumError, StorageError, TsckptError
from .replica_reads import Transfer

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


#: Bytes of sent copies a rank keeps while they leave, before it waits for the oldest (waiting for each
#: cost ~1 ms per region).
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
        """Whether ``dest`` itself can be sent or received into."""
        return self.wire_device(dest) == dest.device and dest.dtype == self.stored(fqn) and dest.is_contiguous()

    def send(self, transfer: Transfer, payload: torch.Tensor, error: BaseException | None, copy: bool) -> None:
        """Send ``payload`` (contiguous, stored dtype, on the wire device) to the region's receivers; with
        ``error``, :meth:`finish`'s status tells them. ``copy``: a temporary copy, counted in ``max_copies``."""
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
        # Two ranks may each owe the other a status. The lower one's goes first, as both post them: NCCL runs
        # a pair's messages in the order posted, so a send posted ahead of the receive its peer waits on
        # behind its own send would wait forever.
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
