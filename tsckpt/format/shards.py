"""Zarr's ``sharding_indexed`` layout for raw inner chunks: an outer chunk's stored bytes and index
(``docs/format.md``, section 5). Every inner chunk is stored, in the order :attr:`ShardFormat.order` gives,
so all outer chunks of an array have one size and a load split along one dimension reads a few ranges of
each; :mod:`tsckpt.format.shard_encoding` encodes them with one transposing copy."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import crc32c as _crc32c
import numpy as np

from ..errors import ChecksumError
from . import checksums, dtypes
from .metadata import ArrayOptions, TensorEntry

#: The index value of an inner chunk that is not stored (outside the array).
MISSING = 2**64 - 1
_ENTRY = np.dtype("<u8")
_CRC_BYTES = 4


@dataclass(frozen=True)
class ShardFormat:
    """How one array's outer chunks are laid out. ``indexed=False``: no sharding codec, one piece, no index."""

    chunk: tuple[int, ...]
    inner: tuple[int, ...]
    itemsize: int
    crc32c_codec: bool = False
    indexed: bool = True
    #: Dimensions stored slowest (:attr:`order`): those no chunk boundary cuts, where boundaries cut another.
    first: tuple[int, ...] = ()

    @functools.cached_property
    def grid(self) -> tuple[int, ...]:
        """Inner chunks per outer chunk."""
        return tuple(c // i for c, i in zip(self.chunk, self.inner))

    @functools.cached_property
    def order(self) -> tuple[int, ...]:
        """The dimensions of the inner grid in storage order, slowest first: :attr:`first` (a load into another
        topology reads part of every chunk along those), then the others, each by inner chunks held, fewest
        first (a load split along a dimension reads as many ranges as the slower ones hold inner chunks)."""
        return tuple(sorted(range(len(self.grid)), key=lambda d: (d not in self.first, self.grid[d], d)))

    @functools.cached_property
    def positions(self) -> np.ndarray:
        """Where each inner chunk is stored (its rank in storage order), by its row-major index in the grid."""
        return self.position(self.every)

    def position(self, coords: np.ndarray) -> np.ndarray:
        """Storage positions of the inner chunks at grid coordinates ``coords`` (one row each)."""
        if not self.grid:  # a 0-d array's one chunk
            return np.zeros(max(len(np.asarray(coords)), 1), dtype=np.int64)
        coords = np.asarray(coords, dtype=np.int64).reshape(-1, len(self.grid))
        return np.ravel_multi_index(tuple(coords[:, d] for d in self.order), [self.grid[d] for d in self.order])

    def coords(self, positions: np.ndarray) -> np.ndarray:
        """Grid coordinates (one row each) of the inner chunks stored at ``positions``."""
        if not self.grid:
            return np.zeros((len(np.atleast_1d(positions)), 0), dtype=np.int64)
        stored = np.unravel_index(np.asarray(positions, dtype=np.int64), [self.grid[d] for d in self.order])
        out = np.empty((len(np.atleast_1d(positions)), len(self.grid)), dtype=np.int64)
        for k, d in enumerate(self.order):
            out[:, d] = stored[k]
        return out

    def grid_view(self, values: np.ndarray) -> np.ndarray:
        """All inner chunks, ``(pieces, *inner)`` in storage order, as a ``(*grid, *inner)`` view."""
        ndim = len(self.grid)
        stored = values.reshape((*(self.grid[d] for d in self.order), *self.inner))
        back = [self.order.index(d) for d in range(ndim)]
        return stored.transpose(*back, *range(ndim, 2 * ndim))

    @functools.cached_property
    def pieces(self) -> int:
        return math.prod(self.grid)

    @functools.cached_property
    def piece_bytes(self) -> int:
        """Stored bytes of one inner chunk, its crc32c included."""
        return math.prod(self.inner) * self.itemsize + (_CRC_BYTES if self.crc32c_codec else 0)

    @functools.cached_property
    def index_bytes(self) -> int:
        if not self.indexed:
            return 0
        return 16 * self.pieces + (_CRC_BYTES if self.crc32c_codec else 0)

    def present(self, extent: Sequence[int]) -> np.ndarray:
        """Which inner chunks hold any of an outer chunk whose part inside the array is ``extent`` (a bool grid)."""
        ndim = len(self.grid)
        axes = [(np.arange(g) * i < e).reshape([-1 if d == k else 1 for k in range(ndim)])
                for d, (g, i, e) in enumerate(zip(self.grid, self.inner, extent))]
        return np.broadcast_to(functools.reduce(np.logical_and, axes, np.True_), self.grid)

    @functools.cached_property
    def stored(self) -> np.ndarray:
        """``0 .. pieces - 1``: every inner chunk's storage position, in storage order."""
        return np.arange(self.pieces)

    @functools.cached_property
    def every(self) -> np.ndarray:
        """The grid coordinates of every inner chunk, one row each, row-major."""
        return np.argwhere(np.ones(self.grid, dtype=bool))

    @functools.cached_property
    def rows(self) -> tuple[int, ...] | None:
        """``(pieces, *inner)`` where the inner chunks, one after the other, are the outer chunk in row-major
        order (a band of rows); else None, and placing them takes untiling."""
        cut = [d for d, g in enumerate(self.grid) if g > 1]
        if len(cut) > 1 or any(self.chunk[d] != 1 for d in range(cut[0] if cut else 0)):
            return None
        return (self.pieces, *self.inner)

    def intact(self, data: np.ndarray) -> bool:
        """Whether a whole stored outer chunk (with the crc32c codec) is intact: a fast yes or no, for
        :func:`check_stored_codec` to explain a no."""
        if not self.crc32c_codec or data[self.nbytes - self.index_bytes:].tobytes() != self.index_blob:
            return False
        step = self.piece_bytes
        return all(checksums.intact(data[k:k + step]) for k in range(0, self.pieces * step, step))

    @functools.cached_property
    def index_blob(self) -> bytes:
        return self.index.tobytes()

    @functools.cached_property
    def nbytes(self) -> int:
        """Stored bytes of one outer chunk: every inner chunk, then the index."""
        return self.pieces * self.piece_bytes + self.index_bytes

    @functools.cached_property
    def index(self) -> np.ndarray:
        """The index (``uint8``) that ends every outer chunk, its entries in row-major order."""
        if not self.indexed:
            return np.empty(0, dtype=np.uint8)
        entries = np.empty((self.pieces, 2), dtype=_ENTRY)
        entries[:, 0] = self.positions.astype(np.uint64) * np.uint64(self.piece_bytes)
        entries[:, 1] = self.piece_bytes
        raw = entries.reshape(-1).view(np.uint8)
        if not self.crc32c_codec:
            return raw
        return np.concatenate([raw, np.frombuffer(checksums.crc32c(raw).to_bytes(4, "little"), dtype=np.uint8)])

    def parse_index(self, tail: bytes | memoryview, where: str) -> np.ndarray:
        """The ``(pieces, 2)`` ``(offset, nbytes)`` of a shard's last :attr:`index_bytes` bytes; ``ValueError`` when
        its crc32c fails or an entry does not describe one raw inner chunk."""
        raw = np.frombuffer(tail, dtype=np.uint8)
        if raw.size != self.index_bytes:
            raise ValueError(f"{where}: the shard index is {raw.size} bytes, expected {self.index_bytes}")
        body = raw[:16 * self.pieces]
        if self.crc32c_codec and checksums.crc32c(body) != int.from_bytes(raw[16 * self.pieces:].tobytes(), "little"):
            raise ValueError(f"{where}: the shard index does not match its crc32c")
        index = body.view(_ENTRY).reshape(self.pieces, 2)
        stored = index[:, 0] != MISSING
        if ((index[stored, 1] != self.piece_bytes).any() or (index[~stored, 1] != MISSING).any()
                or (index[stored, 0] > MISSING - np.uint64(self.piece_bytes)).any()):
            raise ValueError(f"{where}: the shard index describes inner chunks of another size than "
                             f"{self.piece_bytes} bytes")
        return index


def check_stored_codec(fmt: ShardFormat, index: Sequence[int], data: bytes | np.ndarray, what: str) -> None:
    """Raise :class:`ChecksumError` unless a whole stored outer chunk has :attr:`ShardFormat.nbytes`, ends in
    tsckpt's index and every inner chunk matches the crc32c stored after it."""
    raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1)
    if raw.size != fmt.nbytes:
        raise ChecksumError(f"{what}: chunk {list(index)} is {raw.size} bytes, not the {fmt.nbytes} written "
                            "(it was truncated or replaced)")
    if not np.array_equal(raw[raw.size - fmt.index_bytes:], fmt.index):
        raise ChecksumError(f"{what}: the shard index of chunk {list(index)} is not the one tsckpt wrote "
                            "(it was damaged)")
    if not fmt.crc32c_codec:
        return
    size = math.prod(fmt.inner) * fmt.itemsize
    pieces = raw[:fmt.pieces * fmt.piece_bytes].reshape(fmt.pieces, fmt.piece_bytes)
    found = np.fromiter(map(_crc32c.crc32c, pieces[:, :size]), dtype="<u4", count=fmt.pieces)
    if not np.array_equal(found, pieces[:, size:].copy().view("<u4").reshape(-1)):
        raise ChecksumError(f"{what}: chunk {list(index)} does not match its stored crc32c "
                            "(the data changed after it was written)")


def value_format(entry: TensorEntry, options: ArrayOptions) -> ShardFormat:
    """How every outer chunk of ``entry`` is laid out."""
    inner = entry.inner_chunk_shape
    # Cached per layout, so arrays laid out alike share one format's tables (positions, index).
    return _format(entry.chunk_shape, inner if inner is not None else entry.chunk_shape,
                   dtypes.from_zarr(entry.dtype).itemsize, options.crc32c_codec, inner is not None, uncut(entry))


def uncut(entry: TensorEntry) -> tuple[int, ...]:
    """:attr:`ShardFormat.first` of ``entry``: the dimensions one chunk spans whole, where boundaries cut another."""
    whole = tuple(d for d, (n, c) in enumerate(zip(entry.shape, entry.chunk_shape)) if c >= n)
    return whole if len(whole) < len(entry.shape) else ()


_format = functools.lru_cache(maxsize=1024)(ShardFormat)


def tile_views(full: np.ndarray, body: np.ndarray, grid: Sequence[int],
               inner: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Views of ``full`` (a box of whole inner chunks) and ``body`` (them, ``(*grid, *inner)``) of one shape: copying
    either into the other tiles or untiles the box. Where both last axes are contiguous a row of an inner chunk
    is one numpy element (several times faster when rows are short)."""
    ndim = len(grid)
    if not ndim:  # a 0-d array: one element, one inner chunk
        return full, body.reshape(())
    if full.strides[-1] == full.itemsize and body.strides[-1] == body.itemsize:
        row = np.dtype((np.void, inner[-1] * full.itemsize))
        lead = [n for g, i in zip(grid[:-1], inner[:-1]) for n in (g, i)]
        rows = full.view(row).reshape(*lead, grid[-1])
        order = [*range(0, 2 * ndim - 2, 2), 2 * ndim - 2, *range(1, 2 * ndim - 2, 2)]
        return rows.transpose(order), body.view(row)[..., 0]
    split = [n for g, i in zip(grid, inner) for n in (g, i)]
    return full.reshape(split).transpose([*range(0, 2 * ndim, 2), *range(1, 2 * ndim, 2)]), body
