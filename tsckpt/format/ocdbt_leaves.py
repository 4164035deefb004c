"""Every leaf of a B+tree encoded from columns of the whole index: per-leaf work is slicing, not per key.

A packed checkpoint at scale indexes tens of millions of chunks, each in a
data file of its own rank: every leaf lists hundreds of data files in its
table. So each column a leaf is made of (key prefixes and suffixes, value
lengths, data file numbers, offsets, and the data file tables themselves) is
computed once for all entries in numpy, and a leaf is a concatenation of
slices. The layout of a leaf is TensorStore's (``kvstore/ocdbt/index.rst``);
:func:`tsckpt.format.ocdbt.decode_node` reads it back. Pure functions of
bytes; no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from .ocdbt import BTREE_MAGIC, MAX_NODE_ARITY, Entries
from .ocdbt_records import VarintColumn, envelope, prefix_lengths, varint

#: What a node costs beyond its entries, in the size estimate that cuts nodes.
NODE_OVERHEAD = 64


def cut(sizes: np.ndarray, limit: int, least: int = 1) -> np.ndarray:
    """Where consecutive runs of entries of estimated ``sizes`` begin (and, last, ``len(sizes)``): each run as long
    as it stays under ``limit`` and :data:`MAX_NODE_ARITY` entries, and of at least ``least`` entries."""
    total = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=total[1:])
    bounds, lo, n = [0], 0, len(sizes)
    while lo < n:
        hi = int(np.searchsorted(total, total[lo] + limit - NODE_OVERHEAD, side="right")) - 1
        lo = min(max(hi, lo + least), lo + MAX_NODE_ARITY, n)
        bounds.append(lo)
    return np.asarray(bounds, np.int64)


def _gather(buf: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``buf[lo[i]:hi[i]]`` for every ``i``, back to back, and where each begins (``len + 1`` offsets)."""
    n = hi - lo
    starts = np.zeros(len(n) + 1, np.int64)
    np.cumsum(n, out=starts[1:])
    index = np.arange(int(starts[-1]), dtype=np.int64) - np.repeat(starts[:-1] - lo, n)
    return buf[index], starts


class _RangeMin:
    """Minimum of ``values[a:b]`` for many ranges at once (a sparse table: O(1) per range)."""

    def __init__(self, values: np.ndarray):
        self.levels = [values]
        width = 1
        while 2 * width <= len(values):
            prev = self.levels[-1]
            self.levels.append(np.minimum(prev[:len(prev) - width], prev[width:]))
            width *= 2

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        out = np.zeros(len(a), np.int64)
        if not len(a):
            return out
        level = np.floor(np.log2(np.maximum(b - a, 1))).astype(np.int64)
        for k in np.unique(level).tolist():
            at = np.flatnonzero(level == k)
            table = self.levels[k]
            out[at] = np.minimum(table[a[at]], table[b[at] - (1 << k)])
        return out


class _FileTables:
    """The data file table of every leaf, as columns over all leaves (leaf ``i``'s rows ``rows[i]:rows[i + 1]``).

    ``number``: for each indirect value, its file's position in its leaf's table.
    """

    def __init__(self, files: Sequence[str], file: np.ndarray, leaf: np.ndarray, nleaves: int):
        order = sorted(range(len(files)), key=files.__getitem__)
        position = np.empty(len(files), np.int64)
        position[np.asarray(order, np.int64)] = np.arange(len(files))
        raw = [files[k].encode() for k in order]
        path_starts = np.zeros(len(raw) + 1, np.int64)
        np.cumsum(np.fromiter(map(len, raw), np.int64, len(raw)), out=path_starts[1:])
        paths = np.frombuffer(b"".join(raw), np.uint8)
        width = max(1, len(files))
        pair = leaf * width + position[file]
        used = np.sort(pair)
        if len(used):
            used = used[np.concatenate(([True], used[1:] != used[:-1]))]
        self.rows = np.searchsorted(used // width, np.arange(nleaves + 1)).astype(np.int64)
        self.number = np.searchsorted(used, pair) - self.rows[leaf]
        at = used % width
        # Two sorted paths share the least of the common prefixes of the neighbours between them.
        common = np.append(prefix_lengths(raw), 0)
        prefix = np.zeros(len(at), np.int64)
        prefix[1:] = _RangeMin(common)(at[:-1] + 1, at[1:] + 1)
        prefix[self.rows[:-1][self.rows[:-1] < len(at)]] = 0  # each leaf's first path is whole
        self.prefix = VarintColumn(prefix)
        self.suffix_length = VarintColumn(path_starts[at + 1] - path_starts[at] - prefix)
        self.suffixes, self.suffix_starts = _gather(paths, path_starts[at] + prefix, path_starts[at + 1])

    def table(self, i: int) -> bytes:
        a, b = int(self.rows[i]), int(self.rows[i + 1])
        return b"".join((varint(b - a), self.prefix.cut(a + 1, b) if b > a else b"", self.suffix_length.cut(a, b),
                         bytes(b - a), self.suffixes[self.suffix_starts[a]:self.suffix_starts[b]].tobytes()))


def encode_leaves(entries: Entries, bounds: np.ndarray) -> Iterator[tuple[bytes, bytes, int, int]]:
    """Each leaf ``[bounds[i], bounds[i + 1])`` of ``entries``: its first key, its node, its number of keys and
    the bytes its values hold in data files."""
    keys, inline, file, offset, length = entries.keys, entries.inline, entries.file, entries.offset, entries.length
    files = entries.files
    n, nleaves = len(file), len(bounds) - 1
    leaf = np.repeat(np.arange(nleaves, dtype=np.int64), np.diff(bounds))
    indirect = file >= 0
    where = np.flatnonzero(indirect)
    tables = _FileTables(files, file[where], leaf[where], nleaves)
    before = np.zeros(n + 1, np.int64)  # indirect values before each entry
    np.cumsum(indirect, out=before[1:])
    lengths = length.copy()
    for k, v in inline.items():
        lengths[k] = len(v)
    held = np.zeros(n + 1, np.int64)
    np.cumsum(np.where(indirect, length, 0), out=held[1:])
    prefix, suffix = VarintColumn(keys.prefix), VarintColumn(keys.length - keys.prefix)
    value_length, number, offsets = VarintColumn(lengths), VarintColumn(tables.number), VarintColumn(offset[where])
    kinds = indirect.astype(np.uint8)
    at_inline = np.asarray(sorted(inline), np.int64)
    for i in range(nleaves):
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        first = keys.key(lo)
        a, b = int(before[lo]), int(before[hi])
        values = b""
        if len(at_inline):
            s, e = np.searchsorted(at_inline, [lo, hi]).tolist()
            values = b"".join(inline[k] for k in at_inline[s:e].tolist())
        body = b"".join((
            b"\x00", tables.table(i), varint(hi - lo), prefix.cut(lo + 1, hi), varint(len(first)),
            suffix.cut(lo + 1, hi), first, keys.rest[keys.starts[lo + 1]:keys.starts[hi]].tobytes(),
            value_length.cut(lo, hi), kinds[lo:hi].tobytes(), number.cut(a, b), offsets.cut(a, b), values))
        yield first, envelope(BTREE_MAGIC, body), hi - lo, int(held[hi] - held[lo])
