"""The crc32c guarding what tsckpt stores: the root document, every inner chunk and every value blob."""

from __future__ import annotations

import crc32c as _crc32c
import numpy as np


def crc32c(data: np.ndarray | bytes) -> int:
    """The crc32c of an array's elements in C order (copies only if not contiguous)."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return _crc32c.crc32c(data)


#: The crc32c of any bytes followed by their own crc32c (little-endian).
RESIDUE = 0x48674BC7


def intact(data: bytes | np.ndarray) -> bool:
    """Whether ``data`` (bytes, or contiguous ``uint8``) ends with the crc32c of the bytes before it."""
    return len(data) >= 4 and _crc32c.crc32c(data) == RESIDUE
