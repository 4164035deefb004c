"""Outer chunks with a compressor (``compression="zstd"`` or ``"blosc"``), in the codec chain
:mod:`tsckpt.format.zarr_json` declares (``docs/format.md``, section 5). Compressed inner chunks differ in
size, so such chunks are read whole. numcodecs compresses, as in zarr-python."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import crc32c as _crc32c
import numpy as np

from ..errors import ChecksumError
from . import checksums, zarr_json
from .shard_encoding import padded
from .shards import ShardFormat, tile_views


def compressor(name: str, itemsize: int) -> Any:
    """The numcodecs codec for ``name``, configured as the array's ``zarr.json`` declares it."""
    from numcodecs import Blosc, Zstd

    config = zarr_json.COMPRESSORS[name](itemsize)["configuration"]
    return Zstd(**config) if name == "zstd" else Blosc(**{**config, "shuffle": Blosc.SHUFFLE})


def _pieces(fmt: ShardFormat, data: np.ndarray) -> list[np.ndarray]:
    """Every inner chunk of an outer chunk whose part inside the array is ``data``, row-major."""
    full = padded(data, [slice(0, c) for c in fmt.chunk])
    body = np.empty((*fmt.grid, *fmt.inner), dtype=data.dtype)
    tiles, pieces = tile_views(full, body, fmt.grid, fmt.inner)
    np.copyto(pieces, tiles)
    return list(body.reshape(-1, *fmt.inner)) if fmt.grid else [body]


@dataclass
class CompressedChunk:
    """One outer chunk, compressed when it is made (its size is not known before)."""

    fmt: ShardFormat
    data: np.ndarray
    name: str
    stored: bytes = field(init=False)

    def __post_init__(self) -> None:
        codec = compressor(self.name, self.fmt.itemsize)
        parts, index = [], []
        at = 0
        for piece in _pieces(self.fmt, self.data):
            raw = np.ascontiguousarray(piece).reshape(-1).view(np.uint8)
            packed = bytes(codec.encode(raw.view(f"u{self.fmt.itemsize}") if self.fmt.itemsize > 1 else raw))
            if self.fmt.crc32c_codec:
                packed += _crc32c.crc32c(packed).to_bytes(4, "little")
            parts.append(packed)
            index.append((at, len(packed)))
            at += len(packed)
        if self.fmt.indexed:
            table = np.asarray(index, dtype="<u8").reshape(-1).tobytes()
            parts.append(table + (_crc32c.crc32c(table).to_bytes(4, "little") if self.fmt.crc32c_codec else b""))
        self.stored = b"".join(parts)

    @property
    def nbytes(self) -> int:
        return len(self.stored)

    def emit(self, write: Callable[[memoryview], None], scratch: Callable[[int], np.ndarray]) -> None:
        write(memoryview(self.stored))


def decode(fmt: ShardFormat, name: str, stored: bytes | memoryview | np.ndarray, dtype: np.dtype,
           where: str) -> np.ndarray:
    """A whole stored outer chunk, decoded: shape ``fmt.chunk`` (fill beyond the array's edge included); a
    :class:`ChecksumError` naming ``where`` when a crc32c fails or the index does not describe the bytes."""
    raw = np.frombuffer(stored, dtype=np.uint8) if not isinstance(stored, np.ndarray) else stored.reshape(-1)
    crc = 4 if fmt.crc32c_codec else 0
    if fmt.indexed:
        size = 16 * fmt.pieces
        if raw.size < size + crc:
            raise ChecksumError(f"{where}: {raw.size} bytes cannot hold a shard index of {fmt.pieces} inner chunks")
        table = raw[raw.size - size - crc:raw.size - crc]
        if crc and not checksums.intact(raw[raw.size - size - crc:]):
            raise ChecksumError(f"{where}: the shard index does not match its crc32c")
        spans = table.view("<u8").reshape(fmt.pieces, 2)
        limit = raw.size - size - crc
        if ((spans[:, 0] + spans[:, 1]) > limit).any() or (spans[:, 1] < crc).any():
            raise ChecksumError(f"{where}: the shard index points outside the chunk's data")
    else:
        spans = np.asarray([[0, raw.size]], dtype=np.uint64)
    codec = compressor(name, fmt.itemsize)
    count = math.prod(fmt.inner)
    pieces = np.empty((max(fmt.pieces, 1), *fmt.inner), dtype=dtype)
    for k, (start, length) in enumerate(spans.tolist()):
        part = raw[start:start + length]
        body = part[:length - crc]
        if crc and not checksums.intact(part):
            raise ChecksumError(f"{where}: inner chunk {k} does not match its stored crc32c "
                                "(the data changed after it was written)")
        try:
            values = np.frombuffer(codec.decode(body.tobytes()), dtype=np.uint8)
        except Exception as e:  # noqa: BLE001 - whatever the decompressor raises, the chunk is damaged
            raise ChecksumError(f"{where}: inner chunk {k} does not decompress ({e})") from None
        if values.size != count * fmt.itemsize:
            raise ChecksumError(f"{where}: inner chunk {k} decompresses to {values.size} bytes, "
                                f"not {count * fmt.itemsize}")
        pieces[k] = values.view(dtype).reshape(fmt.inner)
    if not fmt.grid:
        return pieces.reshape(fmt.chunk)
    full = np.empty(fmt.chunk, dtype=dtype)
    tiles, body_view = tile_views(full, pieces.reshape(*fmt.grid, *fmt.inner), fmt.grid, fmt.inner)
    np.copyto(tiles, body_view)
    return full


def place(fmt: ShardFormat, name: str, stored: bytes | memoryview | np.ndarray, dtype: np.dtype, where: str,
          start: tuple[int, ...], shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...],
          out: np.ndarray) -> None:
    """Decode the outer chunk starting at ``start`` and copy what lies in the box ``offsets``/``sizes`` of an array
    of ``shape`` into ``out``, the box's buffer."""
    full = decode(fmt, name, stored, dtype, where)
    a = tuple(max(s, o) for s, o in zip(start, offsets))
    b = tuple(min(s + c, o + n, e) for s, c, o, n, e in zip(start, fmt.chunk, offsets, sizes, shape))
    if any(y <= x for x, y in zip(a, b)):
        return
    out[(*(slice(x - o, y - o) for x, y, o in zip(a, b, offsets)), ...)] = \
        full[(*(slice(x - s, y - s) for x, y, s in zip(a, b, start)), ...)]
