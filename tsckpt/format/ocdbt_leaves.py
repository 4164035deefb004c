"""Every leaf of a B+tree encoded from columns of the whole index, so that per-leaf work is slicing, not per key:
at scale tens of millions of chunks, every leaf listing hundreds of data files. Layout: TensorStore's
(``kvstore/ocdbt/index.rst``); :func:`tsckpt.format.ocdbt.decode_node` reads it back."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import crc32c as _crc32c
import numpy as np
import xxhash

from .ocdbt import BTREE_MAGIC, MAX_NODE_ARITY, Entries
from .ocdbt_keys import KeyRun, Tails
from .ocdbt_records import VarintColumn, envelope_into, prefix_lengths, varint

#: What a node costs beyond its entries, in the size estimate that cuts nodes.
NODE_OVERHEAD = 64
#: What an entry costs beyond its key and inline value, in the same estimate.
ENTRY_OVERHEAD = 24


class Leaf(NamedTuple):
    """A leaf: its first key, the parts of its body (:func:`~tsckpt.format.ocdbt_records.envelope_into` makes
    the node of them), its number of keys and the bytes its values hold in data files."""

    first: bytes
    body: tuple[bytes | memoryview, ...]
    keys: int
    held: int


class Written(NamedTuple):
    """Consecutive leaves appended to a node file: each one's first key, length, number of keys and bytes its
    values hold in data files; the first begins at ``at``, each of the others where the one before ends."""

    at: int
    first: list[bytes]
    length: list[int]
    keys: list[int]
    held: list[int]


#: The fewest keys of a run encoded from a template. A template costs about 0.2 ms to set up and to write from,
#: more than encoding a few hundred keys one by one with the loose keys (measured with 16 KiB leaves: 2,000
#: arrays of 8 chunks took 392 ms from templates, 51 ms loose; runs of 2,048 keys 89 ms and 201 ms).
TEMPLATE_KEYS = 512


def leaves(entries: Entries, limit: int, out: bytearray) -> Iterator[Written]:
    """Every leaf of ``entries`` in key order, each estimated under ``limit`` bytes, appended to ``out``.

    A run of at least :data:`TEMPLATE_KEYS` keys whose values are all in data files (an array's chunks) is cut on
    its own, from a template shared by every such run of the same tails, head length, data files and value
    lengths (at scale, every array of one shape and placement). The keys between such runs (array documents,
    single values) are cut together, key by key."""
    keys = entries.keys
    paths = _Paths(entries.files)
    runs = range(len(keys.runs))
    lo, hi = keys.run_starts[:-1], keys.run_starts[1:]
    # A run is whole when it is long enough for a template and holds no inline value (those are few: documents).
    inline = np.asarray(sorted(entries.inline), np.int64)
    whole = (hi - lo >= TEMPLATE_KEYS) & (np.searchsorted(inline, lo) == np.searchsorted(inline, hi))
    # The runs between whole ones, all together: their leaves come from one pass, each cut within its stretch.
    loose = [r for r in runs if not whole[r]]
    part = entries.pick(loose)
    sizes = part.keys.length + ENTRY_OVERHEAD
    for k, v in part.inline.items():
        sizes[k] += len(v)
    stretch = np.flatnonzero(np.diff(np.asarray(loose, np.int64), prepend=-2) != 1)  # where each stretch begins
    stretch_keys = np.append(part.keys.run_starts[stretch], len(part.keys))
    bounds = [0]
    counts = []
    for a, b in zip(stretch_keys[:-1].tolist(), stretch_keys[1:].tolist()):
        cuts = cut(sizes[a:b], limit)[1:] + a
        bounds += cuts.tolist()
        counts.append(len(cuts))
    loose_leaves = encode_leaves(part, np.asarray(bounds, np.int64), paths)
    templates: dict[tuple[int, int, bytes, bytes], list[_RunLeaves]] = {}
    nstretch = 0
    for r in runs:
        if not whole[r]:
            if r == 0 or whole[r - 1]:
                for _ in range(counts[nstretch]):
                    leaf = next(loose_leaves)
                    at = len(out)
                    yield Written(at, [leaf.first], [envelope_into(out, BTREE_MAGIC, leaf.body)], [leaf.keys],
                                  [leaf.held])
                nstretch += 1
            continue
        run = keys.runs[r]
        a, b = int(lo[r]), int(hi[r])
        file, length = entries.file[a:b], entries.length[a:b]
        key = (id(run.tails), len(run.head), xxhash.xxh3_128_digest(file), xxhash.xxh3_128_digest(length))
        found = next((t for t in templates.get(key, []) if t.fits(file, length)), None)
        if found is None:
            found = _RunLeaves(run, file, length, paths, limit)
            templates.setdefault(key, []).append(found)
        yield found.write(out, run, entries.offset[a:b])


class _RunLeaves:
    """The leaves of one run of keys (``head`` + each of ``tails``) whose values are all in data files, but for
    what differs between runs that share them: the head, and where each value is in its file."""

    def __init__(self, run: KeyRun, file: np.ndarray, length: np.ndarray, paths: _Paths, limit: int):
        tails: Tails = run.tails
        head = len(run.head)
        self.file, self.length = file, length
        self.bounds = cut(tails.length + (head + ENTRY_OVERHEAD), limit)
        nleaves = len(self.bounds) - 1
        leaf = np.repeat(np.arange(nleaves, dtype=np.int64), np.diff(self.bounds))
        tables = _FileTables(paths, file, leaf, nleaves)
        prefix = VarintColumn(tails.prefix + head)
        suffix = VarintColumn(tails.length - tails.prefix)
        value_length, number = VarintColumn(length), VarintColumn(tables.number)
        held = np.zeros(len(length) + 1, np.int64)
        np.cumsum(length, out=held[1:])
        #: Each leaf's record, as parts to join: header, its bytes before its first key, the head, its first key's
        #: tail and its bytes after that up to the offsets, the offsets, and room for the crc32c. The header, the
        #: head and the offsets are set run by run.
        self.parts: list[bytes | memoryview | None] = []
        #: Each leaf's first key's tail, and its record's length but for the offsets.
        self.tails, fixed = [], []
        for i in range(nleaves):
            lo, hi = int(self.bounds[i]), int(self.bounds[i + 1])
            before = b"".join((b"\x00", tables.table(i), varint(hi - lo), prefix.cut(lo + 1, hi),
                               varint(head + int(tails.length[lo])), suffix.cut(lo + 1, hi)))
            after = b"".join((tails.tails[lo], tails.rest[tails.rest_starts[lo + 1]:tails.rest_starts[hi]].tobytes(),
                              value_length.cut(lo, hi), b"\x01" * (hi - lo), number.cut(lo, hi)))
            self.parts += (None, before, None, after, None, _NO_CRC)
            self.tails.append(tails.tails[lo])
            fixed.append(_FIXED + len(before) + head + len(after))
        self.fixed = np.asarray(fixed, np.int64)
        self.held = np.diff(held[self.bounds]).tolist()
        self.counts = np.diff(self.bounds).tolist()

    def fits(self, file: np.ndarray, length: np.ndarray) -> bool:
        return np.array_equal(self.file, file) and np.array_equal(self.length, length)

    def write(self, out: bytearray, run: KeyRun, offset: np.ndarray) -> Written:
        """Append the leaves of ``run``, whose values' offsets are ``offset``, to ``out``."""
        # Encoded run by run: a column of the whole index's offsets would be a gigabyte of new pages at scale. The
        # leaves are joined at once and each crc32c taken in one call over its record: per part of each leaf (of
        # hundreds of thousands), a call and a few Python steps cost more than the checksums themselves.
        offsets = VarintColumn(offset)
        ends = offsets.starts[self.bounds]
        length = self.fixed + np.diff(ends)
        header = np.zeros(len(length), _HEADER)
        header["magic"] = BTREE_MAGIC
        header["length"] = length
        parts = self.parts.copy()
        parts[0::6] = header.view(f"V{_HEADER.itemsize}").tolist()
        parts[2::6] = [run.head] * len(length)
        values, cuts = memoryview(offsets.data), ends.tolist()
        parts[4::6] = [values[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
        at = len(out)
        out += b"".join(parts)
        stop = np.cumsum(length)  # where each leaf's record ends, in the bytes just appended
        begins, crcs = (stop - length).tolist(), stop - 4
        crc32c = _crc32c.crc32c
        with memoryview(out) as written:
            appended = written[at:]
            sums = np.asarray([crc32c(appended[a:b]) for a, b in zip(begins, crcs.tolist())], "<u4")
            np.frombuffer(appended, np.uint8)[crcs[:, None] + np.arange(4)] = sums.view(np.uint8).reshape(-1, 4)
            del appended
        head = run.head
        return Written(at, [head + tail for tail in self.tails], length.tolist(), self.counts, self.held)


#: A B+tree node's header, as :func:`~tsckpt.format.ocdbt_records.envelope_into` writes it (magic, length,
#: version, compression), and what its record holds besides its body: that header and its crc32c.
_HEADER = np.dtype([("magic", ">u4"), ("length", "<u8"), ("version", "u1"), ("compression", "u1")])
_FIXED = _HEADER.itemsize + 4
_NO_CRC = bytes(4)


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
    """Minimum of ``values[a:b]`` for many ranges at once, O(1) each: row ``k`` of a sparse table holds the
    minimum of each run of ``2**k`` values; a range is two such runs, overlapping."""

    def __init__(self, values: np.ndarray):
        levels = [values.astype(np.int32)]
        width = 1
        while 2 * width <= len(values):
            below = levels[-1].copy()
            np.minimum(below[:len(values) - width], levels[-1][width:], out=below[:len(values) - width])
            levels.append(below)
            width *= 2
        self.table = np.stack(levels)

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Each ``min(values[a[i]:b[i]])`` (ranges with ``b[i] <= a[i]`` give a value of no meaning)."""
        level = np.log2(np.maximum(b - a, 1)).astype(np.int64)
        return np.minimum(self.table[level, a], self.table[level, b - (1 << level)])


class _Paths:
    """A tree's data file paths sorted once, for every leaf's table: each path's bytes and its common prefix with
    the path before it."""

    def __init__(self, files: Sequence[str]):
        order = sorted(range(len(files)), key=files.__getitem__)
        self.position = np.empty(len(files), np.int64)
        self.position[np.asarray(order, np.int64)] = np.arange(len(files))
        raw = [files[k].encode() for k in order]
        self.starts = np.zeros(len(raw) + 1, np.int64)
        np.cumsum(np.fromiter(map(len, raw), np.int64, len(raw)), out=self.starts[1:])
        self.bytes = np.frombuffer(b"".join(raw), np.uint8)
        # Two sorted paths share the least of the common prefixes of the neighbours between them.
        self.common = _RangeMin(np.append(prefix_lengths(raw), 0))


class _FileTables:
    """The data file table of every leaf, as columns over all leaves (leaf ``i``'s rows ``rows[i]:rows[i + 1]``);
    ``number``: for each value, its file's position in its leaf's table."""

    def __init__(self, paths: _Paths, file: np.ndarray, leaf: np.ndarray, nleaves: int):
        width = max(1, len(paths.position))
        pair = leaf * width + paths.position[file]
        if nleaves * width < 1 << 31:  # narrower keys sort and search faster
            pair = pair.astype(np.int32)
        used = np.sort(pair)
        if len(used):
            used = used[np.concatenate(([True], used[1:] != used[:-1]))]
        self.rows = np.searchsorted(used // width, np.arange(nleaves + 1)).astype(np.int64)
        self.number = np.searchsorted(used, pair) - self.rows[leaf]
        at = (used % width).astype(np.int64)
        prefix = np.zeros(len(at), np.int64)
        prefix[1:] = paths.common(at[:-1] + 1, at[1:] + 1)
        prefix[self.rows[:-1][self.rows[:-1] < len(at)]] = 0  # each leaf's first path is whole
        self.prefix = VarintColumn(prefix)
        self.suffix_length = VarintColumn(paths.starts[at + 1] - paths.starts[at] - prefix)
        self.suffixes, self.suffix_starts = _gather(paths.bytes, paths.starts[at] + prefix, paths.starts[at + 1])

    def table(self, i: int) -> bytes:
        a, b = int(self.rows[i]), int(self.rows[i + 1])
        return b"".join((varint(b - a), self.prefix.cut(a + 1, b) if b > a else b"", self.suffix_length.cut(a, b),
                         bytes(b - a), self.suffixes[self.suffix_starts[a]:self.suffix_starts[b]].tobytes()))


def encode_leaves(entries: Entries, bounds: np.ndarray, paths: _Paths | None = None) -> Iterator[Leaf]:
    """Each leaf ``[bounds[i], bounds[i + 1])`` of ``entries``, key by key from columns of them all."""
    keys, inline, file, offset, length = entries.keys, entries.inline, entries.file, entries.offset, entries.length
    n, nleaves = len(file), len(bounds) - 1
    leaf = np.repeat(np.arange(nleaves, dtype=np.int64), np.diff(bounds))
    indirect = file >= 0
    where = np.flatnonzero(indirect)
    tables = _FileTables(paths or _Paths(entries.files), file[where], leaf[where], nleaves)
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
        body = (b"\x00", tables.table(i), varint(hi - lo), prefix.cut(lo + 1, hi), varint(len(first)),
                suffix.cut(lo + 1, hi), first, keys.rest[keys.starts[lo + 1]:keys.starts[hi]].tobytes(),
                value_length.cut(lo, hi), kinds[lo:hi].tobytes(), number.cut(a, b), offsets.cut(a, b), values)
        yield Leaf(first, body, hi - lo, int(held[hi] - held[lo]))
