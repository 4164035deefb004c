"""What the coordinator makes of every rank's summary (contract step 5): each chunk placed once, linearly.

:class:`MergedChunks` puts every row of every rank's
:class:`~tsckpt.dcp.contract.RankSummary` at its tensor's chunk position with
one ``bincount``-style pass, refusing a chunk written twice or never, and a
checksum the plan asked for but a rank did not compute. ``finish`` then reads
each tensor's writers, checksums and content hashes in grid order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import PlanError
from ..format import content_hashes
from .contract import RankSummary


@dataclass(frozen=True)
class TensorChunks:
    """One tensor's chunks in row-major grid order, as :meth:`MergedChunks.of` returns them.

    ``crc``: one crc32c per piece of the tensor's checksum grid, in its row-major order.
    """

    writer: np.ndarray
    crc: np.ndarray | None
    digest: np.ndarray | None
    reused: np.ndarray


def _place(tensor: np.ndarray, index: np.ndarray, sizes: Sequence[int], names: Sequence[str], unit: str,
           done: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-tensor start offsets and the flat position of every ``(tensor, index)`` row; each position exactly once."""
    starts = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(np.asarray(sizes, np.int64), out=starts[1:])
    total = int(starts[-1])
    tensor = tensor.astype(np.int64)
    if len(tensor) and (tensor.min() < 0 or tensor.max() >= len(sizes)):
        raise PlanError(f"saving {where}: a rank reported a tensor the coordinator did not lay out")
    if len(index) and ((index < 0).any() or (index >= starts[tensor + 1] - starts[tensor]).any()):
        raise PlanError(f"saving {where}: a rank reported a {unit} outside its tensor's grid")
    flat = starts[tensor] + index
    counts = np.bincount(flat, minlength=total) if total else np.zeros(0, np.int64)
    if (counts != 1).any():
        bad = int(np.flatnonzero(counts != 1)[0])
        t = int(np.searchsorted(starts, bad, side="right") - 1)
        what = f"was never {done}" if counts[bad] == 0 else f"was {done} by {int(counts[bad])} ranks"
        raise PlanError(f"saving {where}: {unit} {bad - int(starts[t])} of tensor {names[t]!r} {what}; "
                        f"nothing was committed")
    return starts, flat


@dataclass(frozen=True)
class MergedChunks:
    """Every chunk of every tensor as the ranks reported it (step 5), flat over tensors in coordinator order.

    Tensor ``t`` owns positions ``starts[t]:starts[t+1]``; ``writer`` is the
    rank that wrote each chunk, ``digest`` its content hash (None with
    checksums off), ``reused`` whether it was taken from an incremental base.
    ``crc`` holds the crc32c of every piece of every tensor's checksum grid,
    tensor ``t`` owning ``piece_starts[t]:piece_starts[t+1]``.
    """

    starts: np.ndarray
    writer: np.ndarray
    crc: np.ndarray | None
    digest: np.ndarray | None
    reused: np.ndarray
    piece_starts: np.ndarray

    @classmethod
    def merge(cls, summaries: Sequence[RankSummary], nchunks: Sequence[int], names: Sequence[str],
              with_checksums: bool, where: str, npieces: Sequence[int] | None = None) -> MergedChunks:
        """Place every rank's rows, in time linear in the number of chunks; refuse a missing or doubled chunk.

        ``npieces``: pieces of each tensor's checksum grid (default: its chunks);
        with checksums, each piece must have been checksummed exactly once.
        """
        tensor = np.concatenate([s.tensor for s in summaries] or [np.zeros(0, np.int32)])
        chunk = np.concatenate([s.chunk for s in summaries] or [np.zeros(0, np.int64)])
        starts, flat = _place(tensor, chunk, nchunks, names, "chunk", "written", where)
        total = int(starts[-1])
        writer = np.empty(total, np.int64)
        writer[flat] = np.repeat(np.asarray([s.rank for s in summaries], np.int64),
                                 [len(s.tensor) for s in summaries])
        reused = np.zeros(total, bool)
        for s, part in zip(summaries, np.split(flat, np.cumsum([len(s.tensor) for s in summaries])[:-1])):
            if s.reused is not None and len(s.reused) == len(part):
                reused[part] = s.reused
        npieces = nchunks if npieces is None else npieces
        piece_starts = np.zeros(len(npieces) + 1, np.int64)
        np.cumsum(np.asarray(npieces, np.int64), out=piece_starts[1:])
        crc = digest = None
        if with_checksums:
            # A summary without piece columns checksums its chunks: one crc32c per chunk row.
            pieces = [(s.tensor, s.chunk) if s.piece is None else (s.crc_tensor, s.piece) for s in summaries]
            if any(s.crc is None or len(s.crc) != len(p[1]) or p[0] is None or len(p[0]) != len(p[1])
                   or s.digest is None or len(s.digest) != len(s.tensor) for s, p in zip(summaries, pieces)):
                raise PlanError(f"saving {where}: a rank wrote without the checksums the plan asked for")
            piece_starts, at = _place(np.concatenate([p[0] for p in pieces] or [np.zeros(0, np.int32)]),
                                      np.concatenate([p[1] for p in pieces] or [np.zeros(0, np.int64)]),
                                      npieces, names, "inner chunk", "checksummed", where)
            crc = np.empty(int(piece_starts[-1]), np.uint32)
            crc[at] = np.concatenate([s.crc for s in summaries] or [np.zeros(0, np.uint32)])  # type: ignore[misc]
            digest = np.empty((total, content_hashes.WIDTH), np.uint8)
            digest[flat] = np.concatenate([s.digest for s in summaries]  # type: ignore[misc]
                                          or [np.zeros((0, content_hashes.WIDTH), np.uint8)])
        return cls(starts, writer, crc, digest, reused, piece_starts)

    def of(self, t: int) -> TensorChunks:
        """Tensor ``t``'s chunks, one row each in row-major grid order (its crc32c values, per piece)."""
        a, b = int(self.starts[t]), int(self.starts[t + 1])
        pa, pb = int(self.piece_starts[t]), int(self.piece_starts[t + 1])
        return TensorChunks(self.writer[a:b], None if self.crc is None else self.crc[pa:pb],
                            None if self.digest is None else self.digest[a:b], self.reused[a:b])
