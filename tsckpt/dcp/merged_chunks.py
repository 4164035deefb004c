"""What the coordinator makes of every rank's summary (contract step 5): each chunk placed once, linearly.

:class:`MergedChunks` puts every row of every rank's
:class:`~tsckpt.dcp.contract.RankSummary` at its tensor's chunk position with
one ``bincount``-style pass, refusing a chunk written twice or never, and
gathers where each is stored. ``finish`` then reads each tensor's chunks in
grid order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import PlanError
from ..format import writers, zarr_json
from ..format.data_files import RankFiles
from ..format.metadata import TensorEntry
from ..storage.packed import StoredValues
from .summary import RankSummary, columns_of, expand


@dataclass(frozen=True)
class TensorChunks:
    """One tensor's chunks in row-major grid order, as :meth:`MergedChunks.of` returns them.

    ``file`` (an index into :attr:`MergedChunks.files`, -1 where chunks are keys of their own), ``offset``
    and ``length``: where each is stored.
    """

    writer: np.ndarray
    reused: np.ndarray
    file: np.ndarray
    offset: np.ndarray
    length: np.ndarray


def _place(tensor: np.ndarray, index: np.ndarray, sizes: Sequence[int], names: Sequence[str], unit: str,
           done: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-tensor start offsets and the flat position of every ``(tensor, index)`` row; each position exactly once."""
    starts = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(np.asarray(sizes, np.int64), out=starts[1:])
    total = int(starts[-1])
    if len(tensor) and (tensor.min() < 0 or tensor.max() >= len(sizes)):
        raise PlanError(f"saving {where}: a rank reported a tensor the coordinator did not lay out")
    if len(index) and ((index < 0).any() or (index >= np.asarray(sizes, np.int64)[tensor]).any()):
        raise PlanError(f"saving {where}: a rank reported a {unit} outside its tensor's grid")
    flat = starts[tensor] + index
    # As many rows as positions, every position reached: then each exactly once.
    seen = np.zeros(total, bool)
    seen[flat] = True
    if len(flat) != total or not seen.all():
        counts = np.bincount(flat, minlength=total)
        bad = int(np.flatnonzero(counts != 1)[0])
        t = int(np.searchsorted(starts, bad, side="right") - 1)
        what = f"was never {done}" if counts[bad] == 0 else f"was {done} by {int(counts[bad])} ranks"
        raise PlanError(f"saving {where}: {unit} {bad - int(starts[t])} of tensor {names[t]!r} {what}; "
                        f"nothing was committed")
    return starts, flat


@dataclass(frozen=True)
class MergedChunks:
    """Every chunk of every tensor as the ranks reported it (step 5): their rows one rank after the other, and
    where each chunk of each tensor is among them.

    Tensor ``t`` owns coordinator positions ``starts[t]:starts[t+1]`` (its
    chunks in row-major order); ``row[p]`` is the row of position ``p``. Per
    row: ``writer``, the rank that wrote it; ``reused``, whether it was taken
    from an incremental base; ``file``/``offset``/``length``, where it is
    stored (``file`` indexes ``files``; -1 in the plain layout). Rows stay in
    the ranks' order: reordering every column costs more than looking rows up.
    """

    starts: np.ndarray
    row: np.ndarray
    writer: np.ndarray
    reused: np.ndarray
    file: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    files: tuple[str, ...]

    @classmethod
    def merge(cls, summaries: Sequence[RankSummary], nchunks: Sequence[int], names: Sequence[str],
              where: str) -> MergedChunks:
        """Place every rank's rows, in time linear in the number of chunks; refuse a missing or doubled chunk."""
        # Each rank numbers the files it names; their numbers in the merged list, one table per rank.
        files: dict[str, int] = {}
        tables = [np.asarray([files.setdefault(p, len(files)) for p in s.files], np.int64) for s in summaries]
        columns = columns_of(summaries, tables)
        rows = columns["rows"]
        for name in ("file", "offset", "length"):
            if columns[name] is None:
                rank = next(s.rank for s in summaries if not s.has(name))
                raise PlanError(f"saving {where}: rank {rank} did not say where its chunks are stored")
        starts, flat = _place(columns["tensor"], columns["chunk"], nchunks, names, "chunk", "written", where)
        row = np.empty(int(starts[-1]), np.int64)
        row[flat] = np.arange(len(flat))
        writer = expand(np.asarray([s.rank for s in summaries], np.int64), rows)
        reused = columns["reused"].astype(bool) if columns["reused"] is not None else np.zeros(len(flat), bool)
        file, offset, length = columns["file"], columns["offset"], columns["length"]
        assert file is not None and offset is not None and length is not None
        return cls(starts, row, writer, reused, file, offset, length, tuple(files))

    def writers(self, tensors: Mapping[str, TensorEntry]) -> dict[str, TensorEntry]:
        """``tensors`` (in the order merged) with the rank that wrote each chunk recorded (``writers``)."""
        return {fqn: dataclasses.replace(entry, writers=writers.encode(self.writer[self.rows_of(t)]))
                for t, (fqn, entry) in enumerate(tensors.items())}

    def rows_of(self, t: int) -> np.ndarray:
        """Tensor ``t``'s rows, in row-major grid order of its chunks."""
        return self.row[int(self.starts[t]):int(self.starts[t + 1])]

    def of(self, t: int) -> TensorChunks:
        """Tensor ``t``'s chunks, one row each in row-major grid order."""
        at = self.rows_of(t)
        return TensorChunks(self.writer[at], self.reused[at], self.file[at], self.offset[at], self.length[at])


def stored_values(tensors: Mapping[str, TensorEntry], written: MergedChunks,
                  blobs: Mapping[str, tuple[str, Sequence[int]]]) -> StoredValues:
    """Where every chunk of ``tensors`` (in the coordinator's order, as merged) and every value blob
    (``blobs``: array path -> (data file, [offset, length])) is stored."""
    files = list(written.files)
    numbers = {p: i for i, p in enumerate(files)}
    blob_file = [numbers.setdefault(f, len(numbers)) for f, _ in blobs.values()]
    return StoredValues([(entry.path, entry.grid.grid_shape) for entry in tensors.values()],
                        [f"{path}/{zarr_json.chunk_key((0,))}" for path in blobs],
                        np.concatenate([written.file, np.asarray(blob_file, np.int64)]),
                        np.concatenate([written.offset, np.asarray([r[0] for _, r in blobs.values()], np.int64)]),
                        np.concatenate([written.length, np.asarray([r[1] for _, r in blobs.values()], np.int64)]),
                        list(numbers), np.concatenate([written.row, len(written.row) + np.arange(len(blobs))]))


def once_each(ranks: Sequence[RankFiles]) -> list[RankFiles]:
    """Each rank's files, a file several ranks name (a base's data file linked in) listed by the first only."""
    seen: set[str] = set()
    out = []
    for record in ranks:
        files = tuple(f for f in record.files if f.path not in seen)
        seen.update(f.path for f in files)
        out.append(RankFiles(files, record.table))
    return out
