"""Which rank saved each outer chunk of an array: the ``writers`` field of a tensor entry, so a reader finds a
chunk's chunk table without any other rank's metadata. Encoding: ``docs/format.md``, section 3."""

from __future__ import annotations

import base64
import binascii
import zlib
from collections.abc import Sequence

import numpy as np

from ..errors import MetadataError

#: The most chunks a ``writers`` field is inflated for (four bytes each).
_MAX_CHUNKS = 1 << 28


def encode(ranks: Sequence[int] | np.ndarray) -> str:
    """The ``writers`` field of an array whose outer chunks (row-major) were saved by ``ranks``."""
    ranks = np.asarray(ranks, np.int64)
    deltas = np.diff(ranks, prepend=0).astype("<i4")
    return base64.b64encode(zlib.compress(deltas.tobytes(), 6)).decode("ascii")


def decode(field: str, nchunks: int, world_size: int, what: str) -> np.ndarray:
    """The writer of each of an array's ``nchunks`` outer chunks (int64), or :class:`MetadataError`."""
    if not isinstance(field, str):
        raise MetadataError(f"{what}: writers must be a string, not {type(field).__name__}")
    try:
        raw = base64.b64decode(field, validate=True)
        inflater = zlib.decompressobj()
        data = inflater.decompress(raw, 4 * min(nchunks, _MAX_CHUNKS) + 1)
    except (binascii.Error, zlib.error, ValueError) as e:
        raise MetadataError(f"{what}: writers is not base64 of a zlib stream ({e})") from None
    if len(data) != 4 * nchunks or not inflater.eof or inflater.unused_data:
        raise MetadataError(f"{what}: writers does not hold one rank for each of the array's {nchunks} chunks")
    ranks = np.cumsum(np.frombuffer(data, "<i4").astype(np.int64))
    if len(ranks) and (ranks.min() < 0 or ranks.max() >= world_size):
        raise MetadataError(f"{what}: writers names a rank outside the {world_size} that saved")
    return ranks
