"""Checks on the chunk bytes :func:`tsckpt.zarr_store` serves from checkpoints before format version 4.

Since version 4 every chunk carries Zarr's crc32c codec, which zarr-python
checks itself, so the store serves those as stored. Older checkpoints keep
their crc32c values in the root document, which zarr-python knows nothing of:
zarr-python gets only bytes checked here first. It reads a sharded chunk key
whole, or its index and then the byte range of each inner chunk it needs.
For a tensor whose outer chunks tsckpt encoded (:mod:`tsckpt.format.shards`),
every request is widened to whole inner chunks, each is checked against the
checkpoint's checksum table, and only then is the requested range handed
over; a request for the shard index is compared with the index tsckpt writes,
so a damaged index cannot point zarr-python at other bytes. For any other
tensor with checksums (no inner chunks, compressed, or written before format
version 3), the whole chunk key is read, decoded and checked, and the
requested range is cut from those same bytes. Keys that are not tensor chunks
pass unchecked (value blobs carry their own crc32c codec, ``zarr.json``
documents are not data).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ChecksumError, StorageError
from ..format import checksums, compressed, dtypes, shards
from ..format.metadata import CheckpointMetadata, TensorEntry
from ..storage.store import Store

#: A request: (start, stop) with None for "to the end", or ("suffix", n).
Request = tuple[Any, Any] | None


@dataclass(frozen=True)
class Plan:
    """How to serve one request for a tensor chunk key.

    ``before``: a check to run before the read (may block); ``fetch``: the byte
    range to read (None: the whole key); ``finish``: turns what was read into
    the bytes to hand over, raising if they fail their checks. For tensors
    checked through a BoxReader the whole key is read, whatever was asked.
    """

    fetch: slice | None
    finish: Callable[[Any], bytes | None]
    before: Callable[[], None] | None = None


class ServedChunks:
    """The checks for one checkpoint's chunk keys; :meth:`plan` says how to serve a request."""

    def __init__(self, metadata: CheckpointMetadata, store: Store):
        self.store = store
        self.tensors = {e.path: (key, e) for key, e in metadata.tensors.items() if e.checksums is not None}
        self._tables: dict[str, np.ndarray] = {}
        self._checked: set[tuple[str, tuple[int, ...]]] = set()
        self._lock = threading.Lock()

    def plan(self, key: str, request: Request) -> Plan | None:
        """How to serve ``request`` for ``key``, or None when ``key`` is not a checked tensor chunk."""
        path, _, leaf = key.rpartition("/")
        found = self.tensors.get(path)
        index = _chunk_index(leaf)
        if found is None or index is None or len(index) != len(found[1].shape):
            return None
        name, entry = found
        what = f"tensor {name!r} in {self.store.url}"
        fmt = shards.shard_format(entry, self.store.array_options) if entry.checksums_per_inner_chunk else None
        if fmt is None:
            # The whole key, checked, then clipped to what was asked as zarr's own stores clip a range past the end.
            return Plan(None, lambda r: _clip(self._check_bytes(entry, index, _bytes(r, key, self.store.url), what),
                                              request))
        return self._encoded(key, name, entry, fmt, index, request, what)

    def _encoded(self, key: str, name: str, entry: TensorEntry, fmt: shards.ShardFormat, index: tuple[int, ...],
                 request: Request, what: str) -> Plan:
        size = fmt.nbytes
        data_end = fmt.pieces * fmt.piece_bytes
        start, stop = _bounds(request, size)
        # Whole inner chunks around what lies in the data part; the index part as asked.
        first = start // fmt.piece_bytes if start < data_end else None
        lo = first * fmt.piece_bytes if first is not None else start
        hi = max(stop, -(-min(stop, data_end) // fmt.piece_bytes) * fmt.piece_bytes) if first is not None else stop
        table = self._table(name, entry, what)

        def finish(result: Any) -> bytes:
            raw = np.frombuffer(_bytes(result, key, self.store.url), dtype=np.uint8)
            if raw.size != hi - lo:
                raise StorageError(f"reading {key!r} from {self.store.url} failed: {raw.size} bytes where "
                                  f"{hi - lo} were expected (the chunk is truncated)")
            if first is not None:
                count = (min(hi, data_end) - lo) // fmt.piece_bytes
                stored = raw[:count * fmt.piece_bytes].reshape(count, fmt.piece_bytes)[:, :fmt.piece_bytes - (
                    4 if fmt.crc32c_codec else 0)]
                values = stored.view(dtypes.from_zarr(entry.dtype).numpy).reshape(count, *fmt.inner)
                coords = fmt.coords(np.arange(first, first + count)) + np.asarray(index) * np.asarray(fmt.grid)
                shards.check_pieces(entry, fmt, table, index, coords, stored, values, what)
            tail_from = max(lo, data_end)
            if hi > tail_from and not np.array_equal(raw[tail_from - lo:hi - lo],
                                                     fmt.index[tail_from - data_end:hi - data_end]):
                raise ChecksumError(f"{what}: the shard index of chunk {list(index)} is not the one tsckpt "
                                    "wrote (it was damaged)")
            return raw[start - lo:stop - lo].tobytes()

        return Plan(slice(lo, hi), finish)

    def _table(self, name: str, entry: TensorEntry, what: str) -> np.ndarray:
        with self._lock:
            if name not in self._tables:
                self._tables[name] = checksums.decode_table(entry.checksums or "", entry.checksum_grid, what)
            return self._tables[name]

    def _check_bytes(self, entry: TensorEntry, index: tuple[int, ...], data: bytes, what: str) -> bytes:
        """``data``, a whole stored chunk of an array tsckpt did not encode itself, once its decoded values match
        the checksum table (:class:`ChecksumError` otherwise)."""
        options = self.store.array_options
        fmt = shards.value_format(entry, options) if options is not None else None
        dtype = dtypes.from_zarr(entry.dtype).numpy
        region = entry.grid.chunk_region(index)
        if fmt is not None and options is not None and options.compression is not None:
            full = compressed.decode(fmt, options.compression, data, dtype, f"{what}: chunk {list(index)}")
        else:
            count = math.prod(entry.chunk_shape)
            raw = np.frombuffer(data, dtype=np.uint8)
            if raw.size < count * dtype.itemsize:
                raise ChecksumError(f"{what}: chunk {list(index)} is {raw.size} bytes, too short for its "
                                    f"{count} values (it was truncated)")
            full = raw[:count * dtype.itemsize].view(dtype).reshape(entry.chunk_shape)
        inside = full[tuple(slice(0, r.stop - r.start) for r in region)]
        table = self._table(_name(self, entry), entry, what)
        checksums.check_region(inside, entry.checksum_grid, [r.start for r in region], table, what)
        return data


def _name(served: ServedChunks, entry: TensorEntry) -> str:
    return served.tensors[entry.path][0]


def _chunk_index(leaf: str) -> tuple[int, ...] | None:
    """The grid index of chunk key ``leaf`` ("c" or "c.i.j..."), None for any other name."""
    if leaf == "c":
        return ()
    parts = leaf.split(".")
    if parts[0] != "c" or not all(p.isdigit() for p in parts[1:]):
        return None
    return tuple(int(p) for p in parts[1:])


def _bounds(request: Request, size: int) -> tuple[int, int]:
    if request is None:
        return 0, size
    if request[0] == "suffix":
        return max(size - request[1], 0), size
    start, stop = request
    return min(start, size), size if stop is None else min(stop, size)


def _clip(value: bytes, request: Request) -> bytes:
    start, stop = _bounds(request, len(value))
    return value[start:stop]


def _bytes(result: Any, key: str, url: str) -> bytes:
    if result.state != "value":
        raise StorageError(f"reading {key!r} from {url} failed: the chunk is missing (a committed checkpoint "
                          "stores every chunk: it was deleted or damaged)")
    return bytes(result.value)
