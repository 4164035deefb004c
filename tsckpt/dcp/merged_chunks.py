"""What the coordinator makes of every rank's summary (contract step 5): :class:`MergedChunks` puts every row at
its tensor's chunk position with one scatter, refusing a chunk written twice or never, and brings where each is
stored into chunk order, so that ``finish`` reads each tensor's chunks in grid order, together."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from ..errors import PlanError
from ..format import writers, zarr_json
from ..format.data_files import RankFiles
from ..format.metadata import TensorEntry
from ..storage.packed import StoredValues
from .summary import PerRank, RankSummary, columns_of, full


@dataclass(frozen=True)
class TensorChunks:
    """One tensor's chunks in row-major grid order; ``file`` (into :attr:`MergedChunks.files`, -1 where chunks
    are keys of their own), ``offset`` and ``length``: where each is stored."""

    writer: np.ndarray
    reused: np.ndarray
    file: np.ndarray
    offset: np.ndarray
    length: np.ndarray


def _index_type(n: int) -> type:
    return np.int32 if n < 1 << 31 else np.int64


def _place(tensor: np.ndarray, index: np.ndarray, ranks: np.ndarray, rows: np.ndarray, sizes: Sequence[int],
           names: Sequence[str], unit: str, done: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-tensor start offsets, and the rank that wrote each position (``ranks``: each summary's, ``rows``: its
    number of rows); each position exactly once. ``index`` (int64) becomes the flat positions, in place.

    As many rows as positions, every position reached: then each exactly once, and no row is outside its
    tensor's grid. So the common case makes one column, block by block, and a refusal works out what was wrong.
    """
    starts = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(np.asarray(sizes, np.int64), out=starts[1:])
    total = int(starts[-1])
    flat = index
    placed = np.full(total, -1, ranks.dtype)
    ends = np.cumsum(rows)
    whole = len(flat) == total
    # Each block's positions found, checked and its ranks placed (repeated here, not from a column of every
    # row's rank: new pages, then a pass) while in cache.
    for lo, hi in _blocks(len(flat)):
        part = tensor[lo:hi]
        if part.min() < 0 or part.max() >= len(sizes):
            raise PlanError(f"saving {where}: a rank reported a tensor the coordinator did not lay out")
        at = flat[lo:hi]
        at += starts.take(part)
        whole = whole and at.min() >= 0 and at.max() < total
        if whole:
            a, b = np.searchsorted(ends, [lo, hi - 1], side="right").tolist()
            counts = np.minimum(ends[a:b + 1], hi) - np.maximum(ends[a:b + 1] - rows[a:b + 1], lo)
            placed[at] = np.repeat(ranks[a:b + 1], counts)
    if whole and (not total or placed.min() >= 0):
        return starts, placed
    _refuse(tensor, flat - starts.take(tensor), starts, names, unit, done, where)
    raise AssertionError("unreachable")


def _in_chunk_order(column: np.ndarray | PerRank, flat: np.ndarray, rows: np.ndarray, ranks: np.ndarray | None,
                    writer: np.ndarray, spare: list[np.ndarray]) -> np.ndarray:
    """``column`` (rows in the summaries' order) at the positions ``flat`` (``spare``: as :func:`_scattered`).

    A column of one value per rank is taken by each position's writer (``ranks``: each summary's, None if some
    repeat): a pass in order, where a scatter reaches each position at random (a TLB miss each). One value in
    all is a view of it; each rank's own number (its one data file) is the writers' column itself.
    """
    if not isinstance(column, PerRank) or ranks is None:
        return _scattered(full(column, rows), flat, spare)
    some = rows > 0
    held = column.values[some]
    if not len(held) or (held == held[0]).all():
        return np.broadcast_to(held[:1] if len(held) else column.values[:0], (len(writer),))
    if column.values.dtype.kind in "iu" and np.array_equal(held, ranks[some]):
        return writer
    by_rank = np.zeros(int(ranks.max()) + 1, column.values.dtype)
    by_rank[ranks] = column.values
    return np.take(by_rank, writer, out=_fresh(spare, by_rank.dtype, len(writer)), mode="clip")  # writers: ranks


def _scattered(values: np.ndarray, flat: np.ndarray, spare: list[np.ndarray]) -> np.ndarray:
    """``values`` at the positions ``flat`` (a permutation), block by block, int64 that fit as int32, into one
    of ``spare`` (columns no longer needed) of the same type and length if there is one.

    In chunk order each array's values lie together (gathering from the ranks' order was most of ``finish`` at
    100 million chunks). A scatter costs mostly the pages it reaches at random, half as many at half the width;
    new pages cost as much again, where a spare column's are there already.
    """
    narrow = values.dtype == np.int64 and len(values) and values.min() >= -1 << 31 and values.max() < 1 << 31
    dtype = np.dtype(np.int32) if narrow else values.dtype
    out = _fresh(spare, dtype, len(values))
    part = np.empty(min(len(values), _BLOCK), out.dtype)
    for lo, hi in _blocks(len(values)):
        block = part[:hi - lo]
        block[...] = values[lo:hi]
        out[flat[lo:hi]] = block
    return out


def _fresh(spare: list[np.ndarray], dtype: np.dtype, n: int) -> np.ndarray:
    """A column of ``n`` of ``dtype`` to write into: one of ``spare``, which it takes, if one fits."""
    # By position: list.remove would compare arrays by value.
    at = next((i for i, c in enumerate(spare) if c.dtype == dtype and len(c) == n), None)
    return np.empty(n, dtype) if at is None else spare.pop(at)


def _blocks(n: int) -> list[tuple[int, int]]:
    return [(lo, min(n, lo + _BLOCK)) for lo in range(0, n, _BLOCK)]


#: Rows placed at once: the temporaries stay a few megabytes, reused (a whole column would be new pages).
_BLOCK = 1 << 18


def _refuse(tensor: np.ndarray, index: np.ndarray, starts: np.ndarray, names: Sequence[str], unit: str, done: str,
            where: str) -> None:
    """Raise :class:`PlanError` naming the first thing wrong with rows that do not each take one position."""
    sizes = np.diff(starts)
    if len(index) and ((index < 0).any() or (index >= sizes[tensor]).any()):
        raise PlanError(f"saving {where}: a rank reported a {unit} outside its tensor's grid")
    counts = np.bincount(starts[tensor] + index, minlength=int(starts[-1]))
    bad = int(np.flatnonzero(counts != 1)[0])
    t = int(np.searchsorted(starts, bad, side="right") - 1)
    what = f"was never {done}" if counts[bad] == 0 else f"was {done} by {int(counts[bad])} ranks"
    raise PlanError(f"saving {where}: {unit} {bad - int(starts[t])} of tensor {names[t]!r} {what}; "
                    f"nothing was committed")


@dataclass(frozen=True)
class MergedChunks:
    """Every chunk of every tensor as the ranks reported it: tensor ``t`` owns positions ``starts[t]:starts[t+1]``
    of every column (its chunks in row-major order). Per chunk: ``writer``, the rank that wrote it; ``reused``,
    taken from an incremental base; ``file``/``offset``/``length``, where it is stored (``file`` indexes
    ``files``; -1 in the plain layout). Read-only: a column may be a view of one value, or ``writer`` itself.
    """

    starts: np.ndarray
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
        # Each rank numbers the files it names: their numbers in the merged list, one table per rank.
        files: dict[str, int] = {}
        tables = [np.asarray([files.setdefault(p, len(files)) for p in s.files], np.int32) for s in summaries]
        columns = columns_of(summaries, tables)
        rows = columns["rows"]
        for name in ("file", "offset", "length"):
            if columns[name] is None:
                rank = next(s.rank for s in summaries if not s.has(name))
                raise PlanError(f"saving {where}: rank {rank} did not say where its chunks are stored")
        flat = columns.pop("chunk")
        assert flat is not None and flat.dtype == np.int64
        ranks = np.asarray([s.rank for s in summaries], _index_type(len(summaries)))
        tensor = columns.pop("tensor")
        starts, writer = _place(tensor, flat, ranks, rows, nchunks, names, "chunk", "written", where)
        # Placed, the tensor numbers are not needed: their column may hold another.
        spare = [tensor] if tensor.flags.owndata else []
        del tensor
        if columns["reused"] is None:
            columns["reused"] = PerRank(np.zeros(len(summaries), bool))
        distinct = ranks if len(np.unique(ranks)) == len(ranks) else None
        # One column at a time, each dropped once placed.
        file, offset, length, reused = (_in_chunk_order(columns.pop(name), flat, rows, distinct, writer, spare)
                                        for name in ("file", "offset", "length", "reused"))
        return cls(starts, writer, reused, file, offset, length, tuple(files))

    def writers(self, tensors: Mapping[str, TensorEntry]) -> dict[str, TensorEntry]:
        """``tensors`` (in the order merged) with the rank that wrote each chunk recorded (``writers``)."""
        # Arrays of one layout have the same writers: each distinct field is compressed once.
        fields: dict[bytes, str] = {}
        out = {}
        for t, (fqn, entry) in enumerate(tensors.items()):
            ranks = self.writer[self.rows_of(t)]
            key = xxhash.xxh3_128_digest(ranks) + len(ranks).to_bytes(8, "little")
            field = fields.get(key)
            if field is None:
                field = fields[key] = writers.encode(ranks)
            out[fqn] = dataclasses.replace(entry, writers=field)
        return out

    def rows_of(self, t: int) -> slice:
        """Tensor ``t``'s positions in every column, in row-major grid order of its chunks."""
        return slice(int(self.starts[t]), int(self.starts[t + 1]))

    def of(self, t: int) -> TensorChunks:
        at = self.rows_of(t)
        return TensorChunks(self.writer[at], self.reused[at], self.file[at], self.offset[at], self.length[at])


def stored_values(tensors: Mapping[str, TensorEntry], written: MergedChunks,
                  blobs: Mapping[str, tuple[str, Sequence[int]]]) -> StoredValues:
    """Where every chunk of ``tensors`` (as merged) and every value blob (``blobs``: array path -> (data file,
    [offset, length])) is stored; the index gathers each array's chunks into key order."""
    numbers = {p: i for i, p in enumerate(written.files)}
    refs = [(f"{path}/{zarr_json.chunk_key((0,))}", numbers.setdefault(f, len(numbers)), int(r[0]), int(r[1]))
            for path, (f, r) in blobs.items()]
    return StoredValues([(entry.path, entry.grid.grid_shape) for entry in tensors.values()], refs,
                        written.file, written.offset, written.length, list(numbers))


def once_each(ranks: Sequence[RankFiles]) -> list[RankFiles]:
    """Each rank's files, a file several ranks name (a base's data file linked in) listed by the first only."""
    seen: set[str] = set()
    out = []
    for record in ranks:
        files = tuple(f for f in record.files if f.path not in seen)
        seen.update(f.path for f in files)
        out.append(RankFiles(files, record.table))
    return out
