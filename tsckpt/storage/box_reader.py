"""Reading a box of one tensor: byte ranges planned per file, every value checked before it is placed.

A box is read as the whole checksummed pieces it touches (inner chunks, or outer chunks without them), its
ranges merged per file with those of other boxes (:class:`~tsckpt.storage.byte_reads.RangeBatch`); each piece is
checked against its stored crc32c before any of it is copied out. Compressed chunks are fetched whole and decoded.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import crc32c as _crc32c
import numpy as np

from ..errors import ChecksumError, TsckptError
from ..format import compressed, dtypes, shards, untiling, zarr_json
from ..format.metadata import TensorEntry
from .byte_reads import RangeBatch
from .chunk_source import ChunkSource
from .fetchers import LocalFiles
from .planned_box import ChunkStep, PendingBox, PlannedBox


class BoxReader:
    """Reads boxes of ``entry``'s array from ``source``; ``what`` names the tensor in errors."""

    def __init__(self, source: ChunkSource, entry: TensorEntry, what: str):
        self.source, self.entry, self.what = source, entry, what
        self.dtype = dtypes.from_zarr(entry.dtype).numpy
        options = source.metadata.array_options
        #: Whole chunks decoded here (None: tsckpt's layout, read by byte ranges).
        self.compression = options.compression
        self.fmt = shards.value_format(entry, options)

    def held_bytes(self, sizes: Sequence[int], out: bool) -> int:
        """About how many bytes of host memory a read of ``sizes`` holds until its result is taken."""
        return math.prod(sizes) * self.dtype.itemsize * (1 if out else 2)

    def read(self, offsets: Sequence[int], sizes: Sequence[int], out: np.ndarray | None = None) -> np.ndarray:
        """The box ``offsets``/``sizes`` (into ``out``, its shape and the stored dtype, when given), checked."""
        return self.start(offsets, sizes, out).result()

    def start(self, offsets: Sequence[int], sizes: Sequence[int], out: np.ndarray | None = None) -> PendingBox:
        """Plan the box ``offsets``/``sizes`` on its own; its :meth:`PendingBox.result` reads and checks it."""
        batch = self.source.batch()
        finish = self.plan(offsets, sizes, batch, out)

        def result() -> np.ndarray:
            batch.run()
            return finish()

        return PendingBox(result)

    def plan(self, offsets: Sequence[int], sizes: Sequence[int], batch: RangeBatch,
             out: np.ndarray | None = None) -> PlannedBox:
        """Ask ``batch`` for what the box needs; after ``batch.run()``, the returned call (or its steps, one per
        chunk: :mod:`~tsckpt.storage.planned_box`) checks and places it."""
        offsets, sizes = tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)
        if out is None:
            out = np.empty(sizes, dtype=self.dtype)
        if 0 in sizes:
            return PlannedBox(out, ())
        chunks = list(self.entry.grid.chunks_overlapping([slice(o, o + n) for o, n in zip(offsets, sizes)]))
        self.source.locator.prefetch(self._key(index) for index in chunks)
        return PlannedBox(out, tuple(self._planned(index, offsets, sizes, batch, out) for index in chunks))

    def keys(self, offsets: Sequence[int], sizes: Sequence[int]) -> list[str]:
        if 0 in sizes:
            return []
        return [self._key(index) for index in
                self.entry.grid.chunks_overlapping([slice(int(o), int(o) + int(n)) for o, n in zip(offsets, sizes)])]

    def _key(self, index: Sequence[int]) -> str:
        return f"{self.entry.path}/{zarr_json.chunk_key(index)}"

    def _where(self, index: Sequence[int]) -> str:
        return f"{self.source.store.url}/{self._key(index)}"

    def _missing(self, index: Sequence[int]) -> ValueError:
        return ValueError(f"NOT_FOUND: chunk {{{', '.join(map(str, index))}}} stored at {self._where(index)} "
                          "is missing")

    def _in_file(self, index: Sequence[int]) -> str:
        """' in FILE' where chunk ``index`` is a range of a data file (packed), '' where it is a file of its own."""
        key = self._key(index)
        try:
            found = self.source.locator.locate(key)  # looked up when the read was planned: no I/O
        except (TsckptError, ValueError):
            return ""
        return f" in {found.file}" if found is not None and found.file and found.file != key else ""

    def _planned(self, index: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...], batch: RangeBatch,
                 out: np.ndarray) -> ChunkStep:
        """:meth:`_plan_chunk`; a chunk found missing or damaged while planning fails when its step runs."""
        try:
            return self._plan_chunk(index, offsets, sizes, batch, out)
        except ValueError as e:
            error = e

            def fail() -> None:
                raise error

            return ChunkStep((), fail)

    def _plan_chunk(self, index: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...],
                    batch: RangeBatch, out: np.ndarray) -> ChunkStep:
        fmt = self.fmt
        key = self._key(index)
        try:
            found = self.source.locator.locate(key)
        except TsckptError as e:  # a damaged chunk table or index: which tensor's and chunk's read met it
            raise type(e)(f"{self.what}: chunk {key}: {e}") from None
        if found is None:
            raise self._missing(index)
        start = tuple(i * c for i, c in zip(index, self.entry.grid.chunk_shape))
        if self.compression is not None:
            if found.length is None:  # a plain layout's file: its size is known only to the store
                return ChunkStep((), self._compressed_file(found.file, index, start, offsets, sizes, out))
            whole = batch.want(found.file, found.offset, found.offset + found.length)
            return ChunkStep((whole,), lambda: self._place_compressed(index, start, whole.bytes, offsets, sizes, out))
        if found.length is not None and found.length != fmt.nbytes:
            raise ValueError(f"DATA_LOSS: chunk {{{', '.join(map(str, index))}}} stored at {self._where(index)}"
                             f"{self._in_file(index)} is {found.length} bytes, not the {fmt.nbytes} written "
                             "(truncated or replaced)")
        if found.length is None and isinstance(self.source.fetcher, LocalFiles):
            self.source.fetcher.expect(found.file, fmt.nbytes)
        base = found.offset
        # The inner chunks of this outer chunk the box needs: [first, last) along each dimension (all of them,
        # decided first, where the chunk lies inside the box: most chunks of most reads).
        inside = self.source.metadata.codec_checksums and all(
            o <= s and s + c <= o + n for s, c, o, n in zip(start, fmt.chunk, offsets, sizes))
        if inside:
            first, last = (0,) * len(fmt.grid), fmt.grid
        else:
            region = self.entry.grid.chunk_region(index)
            first = tuple((max(o, r.start) - r.start) // i for o, r, i in zip(offsets, region, fmt.inner))
            last = tuple(-(-(min(o + n, r.stop) - r.start) // i)
                         for o, n, r, i in zip(offsets, sizes, region, fmt.inner))
        whole = first == (0,) * len(fmt.grid) and last == fmt.grid
        if whole and fmt.nbytes <= batch.cost.max_request:
            # The whole chunk, index included, as one range, checked and placed in one go: a band of a banded
            # save holds a few kilobytes, and planning it by runs cost more than its bytes.
            chunk = batch.want(found.file, base, base + fmt.nbytes)
            return ChunkStep((chunk,), lambda: self._place_whole(index, start, chunk.bytes, inside, offsets, sizes,
                                                                 out))
        if whole:
            positions = fmt.stored
        else:
            block = [b - a for a, b in zip(first, last)]
            positions = np.sort(fmt.position(np.indices(block).reshape(len(block), -1).T + np.asarray(first)))
        runs = _runs(positions, max(batch.cost.max_request // fmt.piece_bytes, 1))
        # The index is checked with a whole chunk (one laid out otherwise is gathered by it), and read with
        # the pieces of an object of its own, which has no size on record (one cut short fails there).
        indexed = fmt.indexed and (whole or found.length is None and not isinstance(self.source.fetcher, LocalFiles))
        span = (int(positions[-1]) - int(positions[0]) + 1) * fmt.piece_bytes
        if (len(runs) > 1 and not indexed and span <= batch.cost.max_request
                and (int(np.diff(positions).max()) - 1) * fmt.piece_bytes <= batch.cost.gap_bytes):
            # Runs the batch would fetch as one request anyway: one range, checked and placed as one block.
            slot = batch.want(found.file, base + int(positions[0]) * fmt.piece_bytes,
                              base + int(positions[0]) * fmt.piece_bytes + span)
            return ChunkStep((slot,), lambda: self._place_block(index, start, first, last, positions, slot.bytes,
                                                                offsets, sizes, out))
        # One range per run of inner chunks stored one after the other, at most a request long (so reads
        # reuse buffers), each placed from its own bytes.
        slots = [batch.want(found.file, base + int(positions[a]) * fmt.piece_bytes,
                            base + (int(positions[b - 1]) + 1) * fmt.piece_bytes) for a, b in runs]
        tail = batch.want(found.file, base + fmt.nbytes - fmt.index_bytes, base + fmt.nbytes) if indexed else None

        def step() -> None:
            if tail is not None and not np.array_equal(tail.bytes, fmt.index):
                if not whole:
                    raise ChecksumError(f"{self.what}: the shard index of chunk {list(index)} is not the one tsckpt "
                                        f"wrote (key {self._key(index)}{self._in_file(index)}; it was damaged or cut "
                                        "short)")
                data = np.concatenate([*(s.bytes for s in slots), tail.bytes])
                self._place(index, start, first, last, (*self._gathered(index, data), 0), offsets, sizes, out)
                return
            for (a, b), slot in zip(runs, slots):
                self._place(index, start, first, last, (slot.bytes, positions[a:b], a), offsets, sizes, out)

        return ChunkStep(tuple(slots) if tail is None else (*slots, tail), step)

    def _gathered(self, index: tuple[int, ...], data: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """A whole stored outer chunk whose index is not tsckpt's: its inner chunks' bytes gathered into tsckpt's
        order, and their storage positions."""
        fmt = self.fmt
        assert data is not None
        data = np.asarray(data).reshape(-1)
        tail = data[fmt.nbytes - fmt.index_bytes:]
        positions = np.arange(fmt.pieces)
        where = self._where(index)
        try:
            table = fmt.parse_index(tail, where)
        except ValueError as e:
            raise ChecksumError(f"{self.what}: {e}") from None
        starts = table[np.argsort(fmt.positions), 0].astype(np.int64)
        if (starts + fmt.piece_bytes > fmt.nbytes - fmt.index_bytes).any():
            raise ChecksumError(f"{self.what}: {where}: the shard index points outside the shard's data")
        return np.concatenate([data[a:a + fmt.piece_bytes] for a in starts.tolist()]), positions

    def _check(self, index: tuple[int, ...], positions: np.ndarray, stored: np.ndarray, pieces: np.ndarray) -> None:
        """Check inner chunks against the crc32c stored after each (in ``pieces``)."""
        if self.source.metadata.codec_checksums:
            raw = stored.shape[1]
            found = np.fromiter(map(_crc32c.crc32c, stored), dtype="<u4", count=len(stored))
            self._compare(index, positions, found, pieces[:, raw:raw + 4])

    def _compare(self, index: tuple[int, ...], positions: np.ndarray, found: np.ndarray, stored: np.ndarray) -> None:
        """Refuse the inner chunks at storage ``positions`` unless their crc32c ``found`` are the ``stored`` ones."""
        bad = np.flatnonzero(found != np.ascontiguousarray(stored).view("<u4").reshape(-1))
        if len(bad):
            at = self.fmt.coords(positions[bad[:1]])[0].tolist()
            inner = f" at inner chunk {at}" if self.fmt.indexed else ""
            raise ChecksumError(f"{self.what}: chunk {list(index)} does not match its stored crc32c{inner} "
                                f"(key {self._key(index)}{self._in_file(index)}; the data changed after it was "
                                "written)")

    def _place_block(self, index: tuple[int, ...], start: tuple[int, ...], first: tuple[int, ...],
                     last: tuple[int, ...], positions: np.ndarray, span: np.ndarray, offsets: tuple[int, ...],
                     sizes: tuple[int, ...], out: np.ndarray) -> None:
        """Check the inner chunks ``[first, last)`` of outer chunk ``index`` (at storage ``positions`` within
        ``span``), then copy what the box wants of them to ``out``."""
        fmt = self.fmt
        raw = math.prod(fmt.inner) * fmt.itemsize
        pieces = untiling.stored_block(span, fmt.grid, fmt.order, fmt.piece_bytes, first, last)
        if self.source.metadata.codec_checksums:
            rows = itertools.chain.from_iterable(map(_crc32c.crc32c, pieces[i][:, :raw])
                                                 for i in np.ndindex(*pieces.shape[:-2]))
            self._compare(index, positions, np.fromiter(rows, dtype="<u4", count=len(positions)),
                          pieces[..., raw:raw + 4])
        values = pieces[..., :raw].view(self.dtype).reshape((*pieces.shape[:-1], *fmt.inner))
        self._untile(values, start, first, offsets, sizes, out)

    def _place_whole(self, index: tuple[int, ...], start: tuple[int, ...], data: np.ndarray, inside: bool,
                     offsets: tuple[int, ...], sizes: tuple[int, ...], out: np.ndarray) -> None:
        """Check all of outer chunk ``index`` (``data``, its index included), then copy what the box wants of it
        to ``out``. ``inside``: the chunk lies in the box, and the chunks carry their crc32c."""
        fmt = self.fmt
        end = [s + c for s, c in zip(start, fmt.chunk)]
        # Rows one after the other (a band's) are checked by one crc32c call per inner chunk and copied in one
        # go, where the general check and untiling cost a band 4-5x its copy.
        rows = inside and fmt.rows is not None and fmt.intact(data)
        as_written = rows or not fmt.indexed or np.array_equal(data[fmt.nbytes - fmt.index_bytes:], fmt.index)
        if not (as_written and inside):
            read = (data, fmt.stored, 0) if as_written else (*self._gathered(index, data), 0)
            self._place(index, start, (0,) * len(fmt.grid), fmt.grid, read, offsets, sizes, out)
            return
        # The chunk lies inside the box: checked, then untiled straight into its place in one copy.
        raw = math.prod(fmt.inner) * fmt.itemsize
        pieces = data[:fmt.pieces * fmt.piece_bytes].reshape(fmt.pieces, fmt.piece_bytes)
        dest = out[(*(slice(s - o, e - o) for s, e, o in zip(start, end, offsets)), ...)]  # a view, even 0-d
        if rows:  # splitting an axis is always a view
            np.copyto(dest.reshape(fmt.rows), pieces[:, :raw].view(self.dtype).reshape(fmt.rows))
            return
        self._check(index, fmt.stored, pieces[:, :raw], pieces)
        np.copyto(*shards.tile_views(dest, fmt.grid_view(pieces[:, :raw].view(self.dtype)), fmt.grid, fmt.inner))

    def _place(self, index: tuple[int, ...], start: tuple[int, ...], first: tuple[int, ...], last: tuple[int, ...],
               read: tuple[np.ndarray, np.ndarray, int], offsets: tuple[int, ...], sizes: tuple[int, ...],
               out: np.ndarray) -> None:
        """Check a run of the inner chunks ``[first, last)`` of outer chunk ``index``, then copy what the box wants
        of them to ``out``. ``read``: the run's stored bytes, their (consecutive) storage positions, and where the
        run starts in the storage order of the block."""
        fmt = self.fmt
        data, positions, at = read
        count = len(positions)
        raw = math.prod(fmt.inner) * fmt.itemsize
        pieces = data[:count * fmt.piece_bytes].reshape(count, fmt.piece_bytes)
        stored = pieces[:, :raw]
        values = stored.view(self.dtype).reshape(count, *fmt.inner)
        self._check(index, positions, stored, pieces)
        order = fmt.order
        # The run is a range of the block's storage order: boxes of the block, each a view of its bytes.
        for lo, hi in untiling.linear_boxes([last[d] - first[d] for d in order], at, at + count):
            shape, corner = [y - x for x, y in zip(lo, hi)], tuple(f + lo[order.index(d)] for d, f in enumerate(first))
            self._untile(values[:math.prod(shape)].reshape((*shape, *fmt.inner)), start, corner, offsets, sizes, out)
            values = values[math.prod(shape):]

    def _untile(self, stored: np.ndarray, start: tuple[int, ...], corner: tuple[int, ...], offsets: tuple[int, ...],
                sizes: tuple[int, ...], out: np.ndarray) -> None:
        """Copy what the box wants of checked inner chunks ``stored`` (``(*block, *inner)``, the block in storage
        order, from grid coordinates ``corner`` of the outer chunk at ``start``) to ``out``."""
        fmt = self.fmt
        ndim = len(fmt.inner)
        values = stored.transpose(*[fmt.order.index(d) for d in range(ndim)], *range(ndim, 2 * ndim))
        origin = tuple(s + c * i for s, c, i in zip(start, corner, fmt.inner))
        a = tuple(max(o, x) for o, x in zip(origin, offsets))
        b = tuple(min(o + n * i, x + m, e) for o, n, i, x, m, e in
                  zip(origin, values.shape[:ndim], fmt.inner, offsets, sizes, self.entry.shape))
        untiling.untile_into(values, fmt.inner, origin, a, b, out, offsets)

    def _place_compressed(self, index: tuple[int, ...], start: tuple[int, ...], data: np.ndarray | None,
                          offsets: tuple[int, ...], sizes: tuple[int, ...], out: np.ndarray) -> None:
        assert data is not None and self.compression is not None
        compressed.place(self.fmt, self.compression, data, self.dtype, f"{self.what}: chunk {list(index)}",
                         start, self.entry.shape, offsets, sizes, out)

    def _compressed_file(self, key: str, index: tuple[int, ...], start: tuple[int, ...], offsets: tuple[int, ...],
                         sizes: tuple[int, ...], out: np.ndarray) -> Callable[[], None]:
        """A compressed chunk stored as a key of its own (plain layout), read whole."""
        future = self.source.locator.kvstore.read(key)

        def step() -> None:
            result = future.result()
            if result.state != "value":
                raise self._missing(index)
            self._place_compressed(index, start, np.frombuffer(result.value, np.uint8), offsets, sizes, out)

        return step


def _runs(positions: np.ndarray, most: int) -> list[tuple[int, int]]:
    """``[a, b)`` index ranges of ``positions`` (sorted) whose values are consecutive, each at most ``most`` long."""
    cuts = [0, *(np.flatnonzero(np.diff(positions) != 1) + 1).tolist(), len(positions)]
    return [(k, min(k + most, b)) for a, b in zip(cuts[:-1], cuts[1:]) for k in range(a, b, most)]
