"""Reading a box of one tensor, every value returned checked against the checkpoint's checksums.

Every read path (the DCP reader, :func:`tsckpt.open` handles, whole-tensor
reads for ``convert`` and ``diff``, ``verify``) reads through a
:class:`BoxReader`. A box is read as the whole checksummed pieces it touches,
and each piece is checked before any of its values is handed out, so a read of
one element checks the inner chunk holding it.

Arrays whose outer chunks tsckpt encoded itself (:mod:`tsckpt.format.shards`)
are read here from their chunk keys: an outer chunk the box covers whole with
one read of its key, one it covers in part with one read per run of needed
inner chunks stored one after the other (``ShardFormat.order`` keeps those
runs few). Each inner chunk is checked where it lies in the bytes read (no
copy), then copied into place. A local plain checkpoint's arrays without
inner chunks are read the same way, from their chunk files (each one piece,
no index: :func:`~tsckpt.format.shards.leaf_format`). Other arrays (without
inner chunks elsewhere, compressed, written before format version 3 or
without checksums) are read through TensorStore's array driver, over the box
widened to whole pieces, and checked after.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorstore as ts

from ..format import checksums, dtypes, shard_encoding, shards, zarr_json
from ..format.metadata import TensorEntry
from . import chunk_files
from .store import Store, read_error, then

@dataclass
class PendingBox:
    """A box read in flight; :meth:`result` checks it and returns the values of the box asked for."""

    finish: Callable[[], np.ndarray]

    def result(self) -> np.ndarray:
        return self.finish()


class BoxReader:
    """Reads boxes of ``entry``'s array from ``store``; ``what`` names the tensor in checksum errors.

    The arrays and kvstores it needs are opened on construction, concurrently
    with other readers' openings.
    """

    def __init__(self, store: Store, entry: TensorEntry, what: str):
        self.store = store
        self.entry = entry
        self.what = what
        self.dtype = dtypes.from_zarr(entry.dtype).numpy
        # Chunks tsckpt encoded are read here; without checksums nothing would notice one laid out otherwise.
        checked = entry.checksums_per_inner_chunk and entry.checksums is not None
        # Chunk files on a local disk are read with file calls: many times faster than through the kvstore,
        # and for arrays without inner chunks, than opening each through TensorStore.
        self._dir = chunk_files.local_directory(store, entry.path) if checked else None
        self.fmt = shards.file_format(entry, store.array_options, self._dir is not None) if checked else None
        self.table: np.ndarray | None = None
        if self.fmt is None:
            self._dir = None
            self._array = store.open_tensor(entry)
        elif self._dir is None:
            self._raw = store.open_raw(entry.path, entry.grid.grid_shape, self.fmt.nbytes)
            self._kv = ts.KvStore.open(store.array_kvstore(entry.path), context=store.context)

    def opened(self) -> None:
        """Wait for the openings (raises what they raised); chunk files read with file calls need none."""
        if self.fmt is None:
            self._array.result()
        elif self._dir is None:
            self._raw.result()
            self._kv.result()

    def _checksums(self) -> np.ndarray | None:
        if self.entry.checksums is not None and self.table is None:
            self.table = checksums.decode_table(self.entry.checksums, self.entry.checksum_grid, self.what)
        return self.table

    def held_bytes(self, sizes: Sequence[int], out: bool) -> int:
        """About how many bytes of host memory a read of ``sizes`` holds until its result is taken.

        A read into ``out`` through TensorStore's array driver holds none; one of
        encoded chunks holds the bytes read (whole inner chunks) until it is placed.
        """
        nbytes = math.prod(sizes) * self.dtype.itemsize
        return nbytes * (2 if not out else 1) if self.fmt is not None else (0 if out else nbytes)

    def read(self, offsets: Sequence[int], sizes: Sequence[int], out: np.ndarray | None = None) -> PendingBox:
        """Start reading the box ``offsets``/``sizes``; into ``out`` (its shape, the stored dtype) if given."""
        offsets, sizes = tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)
        if self.fmt is None:
            return self._read_array(offsets, sizes, out)
        if 0 in sizes:  # nothing to read
            empty = out if out is not None else np.empty(sizes, dtype=self.dtype)
            return PendingBox(lambda: empty)
        return self._read_chunks(offsets, sizes, out)

    # --- through TensorStore's array driver ---------------------------------------

    def _read_array(self, offsets: tuple[int, ...], sizes: tuple[int, ...], out: np.ndarray | None) -> PendingBox:
        lo, extent = checksums.covering_box(self.entry, offsets, sizes)
        source = self._array.result()[tuple(slice(o, o + n) for o, n in zip(lo, extent))]
        within = tuple(slice(o - a, o - a + n) for o, a, n in zip(offsets, lo, sizes))
        direct = out is not None and extent == sizes
        fut = ts.array(out, copy=False, write=True).write(source) if direct else source.read()

        def finish() -> np.ndarray:
            data = out if direct else np.asarray(fut.result())
            if direct:
                fut.result()
            checksums.check_read(self.entry, data, lo, self.what, self._checksums())
            if direct or out is None:
                return data if extent == sizes else data[within]
            np.copyto(out, data[within])
            return out

        return PendingBox(finish)

    # --- encoded chunks, read here ------------------------------------------------

    def _read_chunks(self, offsets: tuple[int, ...], sizes: tuple[int, ...], out: np.ndarray | None) -> PendingBox:
        fmt = self.fmt
        assert fmt is not None
        outer = self.entry.grid
        lo, extent = checksums.covering_box(self.entry, offsets, sizes)
        if out is None:
            out = np.empty(sizes, dtype=self.dtype)
        reads = []
        for index in outer.chunks_overlapping([slice(o, o + n) for o, n in zip(lo, extent)]):
            region = outer.chunk_region(index)
            # The inner chunks of this outer chunk the box needs: [first, last) along each dimension.
            first = tuple((max(o, r.start) - r.start) // i for o, r, i in zip(lo, region, fmt.inner))
            last = tuple(-(-(min(o + n, r.stop) - r.start) // i) for o, n, r, i in zip(lo, extent, region, fmt.inner))
            key = zarr_json.chunk_key(index)
            if all(o <= r.start and r.stop <= o + n for o, n, r in zip(lo, extent, region)):
                # The whole outer chunk: one read of its key, index included (and padding beyond the edge).
                first, last = (0,) * len(fmt.grid), fmt.grid
                if self._dir is not None and fmt.nbytes >= chunk_files.INLINE_BYTES:
                    self._checksums()  # decoded here, not on the read threads
                    fut = _Then(chunk_files.submit(self._stream_whole, key, index, tuple(r.start for r in region),
                                                   offsets, sizes, out),
                                lambda done: done, missing=lambda key=key, index=index: self._missing(key, index))
                elif self._dir is not None:  # small: one read, into memory the allocator has at hand
                    fut = _Then(chunk_files.read_whole(os.path.join(self._dir, key)),
                                lambda data, key=key, index=index: self._whole_file(key, index, data),
                                missing=lambda key=key, index=index: self._missing(key, index))
                else:
                    at = (*index[:-1], slice(index[-1] * fmt.nbytes, (index[-1] + 1) * fmt.nbytes))
                    fut = then(self._raw.result()[at].read(), lambda data, key=key: self._whole(key, data))
            else:
                fut = self._read_runs(key, index, first, last)
            reads.append((index, region, first, last, fut))

        def finish() -> np.ndarray:
            for index, region, first, last, fut in reads:
                read = fut.result()
                if read is not None:  # not placed by its read already
                    self._place(index, tuple(r.start for r in region), first, last, read, offsets, sizes, out)
            return out

        return PendingBox(finish)

    def _where(self, key: str) -> str:
        return f"{self.store.url}/{self.entry.path}/{key}"

    def _missing(self, key: str, index: Sequence[int]) -> ValueError:
        return ValueError(f"NOT_FOUND: chunk {{{', '.join(map(str, index))}}} stored at {self._where(key)} is missing")

    def _whole_file(self, key: str, index: tuple[int, ...], data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_whole` of a chunk file read whole: refused as cut or grown first."""
        assert self.fmt is not None
        if data.size != self.fmt.nbytes:
            raise ValueError(self._cut(index, key, data.size))
        return self._whole(key, data)

    def _cut(self, index: tuple[int, ...], key: str, size: int) -> str:
        assert self.fmt is not None
        return (f"DATA_LOSS: chunk {{{', '.join(map(str, index))}}} stored at {self._where(key)} is {size} bytes, "
                f"not the {self.fmt.nbytes} written (truncated or replaced)")

    def _stream_whole(self, key: str, index: tuple[int, ...], start: tuple[int, ...], offsets: tuple[int, ...],
                      sizes: tuple[int, ...], out: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Read a whole chunk file unit by unit (:mod:`~tsckpt.format.shard_encoding`) into a scratch buffer,
        checking each unit and placing what the box wants of it in ``out``; runs on a read thread.

        None once placed; for a chunk whose index is not the one tsckpt
        writes, its inner chunks for :meth:`_place` (:meth:`_whole`). Reading
        the whole file into a fresh buffer instead faults in a page of new
        memory per 4 KiB, which costs more than the read on a small VM.
        """
        fmt = self.fmt
        assert fmt is not None
        path = os.path.join(self._dir or "", key)
        fd = chunk_files.open_read(path)
        try:
            size, tail = chunk_files.stored_tail(fd, path, fmt)
            if size != fmt.nbytes:
                raise ValueError(self._cut(index, key, size))
            if not np.array_equal(tail, fmt.index):
                return self._whole(key, chunk_files.whole_file(path))
            count = fmt.pieces // shard_encoding.units(fmt)
            for first, unit in chunk_files.stored_units(fd, path, fmt):
                positions = np.arange(first, first + count)
                corners = fmt.coords(positions[[0, -1]])  # a unit is a block of the inner grid
                self._place(index, start, tuple(corners[0].tolist()), tuple((corners[1] + 1).tolist()),
                            (unit, positions), offsets, sizes, out)
        finally:
            os.close(fd)
        return None

    def _whole(self, key: str, data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A whole stored outer chunk as (its inner chunks' bytes one after the other, their storage positions)."""
        fmt = self.fmt
        assert fmt is not None
        data = np.asarray(data).reshape(-1)
        tail = data[fmt.nbytes - fmt.index_bytes:]
        positions = np.arange(fmt.pieces)
        if np.array_equal(tail, fmt.index):
            return data, positions  # as tsckpt writes them
        # Laid out otherwise: gather the inner chunks where the index says, into tsckpt's order.
        table = fmt.parse_index(tail, self._where(key))
        starts = table[np.argsort(fmt.positions), 0].astype(np.int64)
        if (starts + fmt.piece_bytes > fmt.nbytes - fmt.index_bytes).any():
            raise ValueError(f"{self._where(key)}: the shard index points outside the shard's data")
        return np.concatenate([data[a:a + fmt.piece_bytes] for a in starts.tolist()]), positions

    def _read_runs(self, key: str, index: tuple[int, ...], first: tuple[int, ...], last: tuple[int, ...]) -> ts.Future:
        """Read the inner chunks ``[first, last)`` of an outer chunk: each run stored one after the other at once.

        The future gives (their bytes one after the other, their storage
        positions, ascending). They are found where tsckpt stores them
        (:attr:`~tsckpt.format.shards.ShardFormat.order`, without reading the
        index): a chunk laid out otherwise was not written by tsckpt, and fails
        its checksums like any other change.
        """
        fmt = self.fmt
        assert fmt is not None
        block = [b - a for a, b in zip(first, last)]
        coords = np.indices(block).reshape(len(block), -1).T + np.asarray(first)
        positions = np.sort(fmt.position(coords))
        runs = np.split(positions, np.flatnonzero(np.diff(positions) != 1) + 1)
        spans = [(int(run[0]) * fmt.piece_bytes, (int(run[-1]) + 1) * fmt.piece_bytes) for run in runs]
        if self._dir is not None:
            path = os.path.join(self._dir, key)
            return _Then(chunk_files.read_ranges(path, spans), lambda data: (data, positions),
                         missing=lambda: self._missing(key, index))
        kv = self._kv.result()
        futures = [kv.read(key, byte_range=slice(a, b)) for a, b in spans]
        joined = _all(futures, lambda r: _value(r, self._missing(key, index)))
        return then(joined, lambda parts: (np.concatenate(parts) if len(parts) > 1 else parts[0], positions))

    def _place(self, index: tuple[int, ...], start: tuple[int, ...], first: tuple[int, ...], last: tuple[int, ...],
               read: tuple[np.ndarray, np.ndarray], offsets: tuple[int, ...], sizes: tuple[int, ...],
               out: np.ndarray) -> None:
        """Check the inner chunks ``[first, last)`` of outer chunk ``index``, then copy what the box
        ``offsets``/``sizes`` wants of them to ``out``.

        ``read``: their stored bytes one after the other, and the storage positions of those.
        """
        fmt = self.fmt
        assert fmt is not None
        data, positions = read
        count = len(positions)
        raw = math.prod(fmt.inner) * fmt.itemsize
        stored = data[:count * fmt.piece_bytes].reshape(count, fmt.piece_bytes)[:, :raw]
        values = stored.view(self.dtype).reshape(count, *fmt.inner)
        table = self._checksums()
        if table is not None:
            coords = fmt.coords(positions) + np.asarray(index) * np.asarray(fmt.grid)
            shards.check_pieces(self.entry, fmt, table, index, coords, stored, values, self.what)
        block = tuple(b - a for a, b in zip(first, last))
        if count == fmt.pieces:
            values = fmt.grid_view(values)  # the whole chunk: a view, no copy
        else:  # the block's inner chunks in its row-major order
            wanted = fmt.position(np.indices(block).reshape(len(block), -1).T + np.asarray(first))
            values = values[np.searchsorted(positions, wanted)].reshape(*block, *fmt.inner)
        origin = tuple(s + f * i for s, f, i in zip(start, first, fmt.inner))  # of the block, in the array
        # The block's values in the array, and the part of them the box wants.
        span = tuple(b * i for b, i in zip(block, fmt.inner))
        a = tuple(max(o, x) for o, x in zip(origin, offsets))
        b = tuple(min(o + n, x + m, e) for o, n, x, m, e in zip(origin, span, offsets, sizes, self.entry.shape))
        if any(y <= x for x, y in zip(a, b)):
            return
        dest = out[(*(slice(x - o, y - o) for x, y, o in zip(a, b, offsets)), ...)]  # a view, even 0-d
        if a == origin and all(y - o == n for y, o, n in zip(b, origin, span)):
            tiles, pieces = shards.tile_views(dest, values, block, fmt.inner)
            np.copyto(tiles, pieces)
            return
        full = np.empty(span, dtype=self.dtype)
        tiles, pieces = shards.tile_views(full, values, block, fmt.inner)
        np.copyto(tiles, pieces)
        np.copyto(dest, full[tuple(slice(x - o, y - o) for x, y, o in zip(a, b, origin))])


class _Then:
    """``step`` applied to a thread pool's future when its result is taken (a missing file named as the reader names it)."""

    def __init__(self, fut: Any, step: Callable[[Any], Any], missing: Callable[[], Exception] | None = None):
        self.fut, self.step, self.missing = fut, step, missing

    def result(self) -> Any:
        try:
            data = self.fut.result()
        except ValueError as e:
            if self.missing is not None and str(e).startswith("NOT_FOUND"):
                raise self.missing() from None
            raise
        return self.step(data)


def _value(result: Any, missing: Exception) -> np.ndarray:
    if result.state != "value":
        raise missing
    return np.frombuffer(result.value, dtype=np.uint8)


def _all(futures: list[ts.Future], step: Any) -> ts.Future:
    """A future of ``[step(result) for each future]``, failing with the first failure.

    The futures complete on TensorStore's threads, so the count of those
    outstanding is kept under a lock.
    """
    promise, out = ts.Promise.new()
    results: list[Any] = [None] * len(futures)
    state = {"left": len(futures), "failed": False}
    lock = threading.Lock()

    def done(k: int, f: ts.Future) -> None:
        try:
            value = step(f.result())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            with lock:
                first, state["failed"] = not state["failed"], True
            if first:
                promise.set_exception(e)
            return
        with lock:
            results[k] = value
            state["left"] -= 1
            finished = state["left"] == 0 and not state["failed"]
        if finished:
            promise.set_result(results)

    if not futures:
        promise.set_result([])
    for k, f in enumerate(futures):
        f.add_done_callback(lambda f, k=k: done(k, f))
    return out


def read_tensor(store: Store, key: str, entry: TensorEntry) -> np.ndarray:
    """The whole tensor as numpy, checked, or a clear error naming the tensor (and the chunk, when one is missing)."""
    reader = BoxReader(store, entry, f"tensor {key!r} in {store.url}")
    try:
        return reader.read((0,) * len(entry.shape), entry.shape).result()
    except ValueError as e:
        raise read_error(key, store.url, e) from None
