"""Encoding outer chunks in the :class:`~tsckpt.format.shards.ShardFormat` layout, whole or streamed in parts.

An outer chunk's inner chunks split into *units* (those sharing their indices along the slowest few stored
dimensions, about :data:`UNIT_BYTES` each, one contiguous run of stored bytes): :func:`encode_to` streams a
chunk unit by unit through one reused buffer, :func:`encode` fills one buffer. Both return the crc32c of
every inner chunk holding any element inside the array, in row-major order of the inner grid, over those
elements only."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import crc32c as _crc32c
import numpy as np

from . import checksums
from .shards import ShardFormat, tile_views

#: About how many stored bytes :func:`encode_to` encodes at a time: a few fit a core's share of cache.
UNIT_BYTES = 2 << 20


@functools.lru_cache(maxsize=1024)
def unit_dims(fmt: ShardFormat, target: int | None = None) -> int:
    """How many of the slowest stored dimensions a unit fixes: the fewest that bring it to ``target`` bytes
    (:data:`UNIT_BYTES` by default)."""
    size, k = fmt.pieces * fmt.piece_bytes, 0
    while size > (UNIT_BYTES if target is None else target) and k < len(fmt.order) and fmt.grid[fmt.order[k]] > 1:
        size //= fmt.grid[fmt.order[k]]
        k += 1
    return k


def units(fmt: ShardFormat, target: int | None = None) -> int:
    """How many units an outer chunk of ``fmt`` has."""
    return math.prod(fmt.grid[d] for d in fmt.order[:unit_dims(fmt, target)])


def unit_bytes(fmt: ShardFormat, target: int | None = None) -> int:
    """Stored bytes of one unit (inner chunks and their codec checksums; the index is not in any unit)."""
    return fmt.pieces // units(fmt, target) * fmt.piece_bytes


def encode(fmt: ShardFormat, data: np.ndarray, out: np.ndarray | None = None,
           unit: int | None = None) -> tuple[np.ndarray, list[int]]:
    """The stored bytes (in ``out`` or a new buffer) of an outer chunk whose part inside the array is ``data``, and
    its crc32c values. ``unit``: the units' target size; any gives the same bytes."""
    if out is None:
        out = np.empty(fmt.nbytes, dtype=np.uint8)
    size, whole = unit_bytes(fmt, unit), []
    for u in range(units(fmt, unit)):
        whole += _encode_unit(fmt, data, u, out[u * size:(u + 1) * size], unit)
    out[fmt.nbytes - fmt.index_bytes:] = fmt.index
    return out, _crcs(fmt, data, whole)


def encode_to(fmt: ShardFormat, data: np.ndarray, write: Callable[[memoryview], None],
              scratch: Callable[[int], np.ndarray], unit: int | None = None) -> list[int]:
    """Pass the stored bytes of an outer chunk to ``write`` in parts, each encoded into ``scratch(n)`` (reused, valid
    only during its ``write``) or ``data`` itself; return its crc32c values."""
    if fmt.pieces == 1 and tuple(data.shape) == fmt.chunk and data.flags.c_contiguous:
        flat = data.reshape(-1).view(np.uint8)
        crc = _crc32c.crc32c(flat)
        write(memoryview(flat))
        tail = fmt.index if not fmt.crc32c_codec else \
            np.concatenate([np.frombuffer(crc.to_bytes(4, "little"), np.uint8), fmt.index])
        write(memoryview(tail))
        return [crc]
    size, whole = unit_bytes(fmt, unit), []
    buffer = scratch(size)
    for u in range(units(fmt, unit)):
        whole += _encode_unit(fmt, data, u, buffer, unit)
        write(memoryview(buffer))
    write(memoryview(fmt.index))
    return _crcs(fmt, data, whole)


def _encode_unit(fmt: ShardFormat, data: np.ndarray, u: int, out: np.ndarray, unit: int | None) -> list[int]:
    """Unit ``u`` of the chunk into ``out``; its inner chunks' crc32c in storage order, padding included."""
    k = unit_dims(fmt, unit)
    fixed = np.unravel_index(u, [fmt.grid[d] for d in fmt.order[:k]]) if k else ()
    box = [slice(0, c) for c in fmt.chunk]
    grid = list(fmt.grid)
    for d, i in zip(fmt.order[:k], fixed):
        box[d] = slice(int(i) * fmt.inner[d], (int(i) + 1) * fmt.inner[d])
        grid[d] = 1
    source = padded(data, box)
    raw = math.prod(fmt.inner) * fmt.itemsize
    count = math.prod(grid)
    stored = out.reshape(count, fmt.piece_bytes)
    values = stored[:, :raw].view(data.dtype).reshape((*(grid[d] for d in fmt.order), *fmt.inner))
    ndim = len(grid)
    body = values.transpose(*[fmt.order.index(d) for d in range(ndim)], *range(ndim, 2 * ndim))
    tiles, pieces = tile_views(source, body, grid, fmt.inner)
    np.copyto(pieces, tiles)
    whole = [_crc32c.crc32c(piece) for piece in stored[:, :raw]]
    if fmt.crc32c_codec:
        stored[:, raw:] = np.asarray(whole, dtype="<u4").reshape(-1, 1).view(np.uint8)
    return whole


def padded(data: np.ndarray, box: Sequence[slice]) -> np.ndarray:
    """``box`` of the chunk whose part inside the array is ``data``: a view, or zero-padded past the edge."""
    if all(s.stop <= n for s, n in zip(box, data.shape)):
        return data[tuple(box)]
    out = np.zeros([s.stop - s.start for s in box], dtype=data.dtype)
    inside = tuple(slice(s.start, min(s.stop, n)) for s, n in zip(box, data.shape))
    if all(s.stop > s.start for s in inside):
        out[tuple(slice(0, s.stop - s.start) for s in inside)] = data[inside]
    return out


def _crcs(fmt: ShardFormat, data: np.ndarray, whole: list[int]) -> list[int]:
    """The crc32c values :func:`encode` returns, from those of the stored inner chunks (storage order)."""
    if tuple(data.shape) == fmt.chunk:  # every inner chunk whole: its crc32c is the one just taken
        return [whole[p] for p in fmt.positions.tolist()]
    crcs = []
    for k in np.flatnonzero(fmt.present(data.shape).reshape(-1)).tolist():  # row-major order of the grid
        origin = np.unravel_index(k, fmt.grid)
        within = tuple(slice(o * i, min((o + 1) * i, n)) for i, n, o in zip(fmt.inner, data.shape, origin))
        whole_piece = all(s.stop - s.start == i for s, i in zip(within, fmt.inner))
        # Pieces across the array's edge are checksummed over their elements inside it only.
        crcs.append(whole[fmt.positions[k]] if whole_piece else checksums.crc32c(data[within]))
    return crcs


@dataclass
class EncodedChunk:
    """One outer chunk as a value a sink stores (:mod:`tsckpt.storage.sinks`), encoded while it is written."""

    fmt: ShardFormat
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.fmt.nbytes

    def emit(self, write: Callable[[memoryview], None], scratch: Callable[[int], np.ndarray]) -> None:
        encode_to(self.fmt, self.data, write, scratch)
