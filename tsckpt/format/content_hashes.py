"""Content hashes: the XXH3-128 of every outer chunk's stored bytes, 16 bytes big-endian in its writer's chunk
table, which incremental saves compare (``docs/format.md``, section 8). XXH3 is the fastest candidate measured;
it guards against accidental equality, not crafted collisions."""

from __future__ import annotations

from typing import Any

import numpy as np
import xxhash

#: XXH3-128 of an outer chunk's *stored* bytes, taken from the buffers being written (hashing the elements would
#: cost one more pass); stored bytes are a function of the elements and codecs, so equal digests mean equal chunks.
STORED_ALGORITHM = "xxh3_128_stored"
#: Bytes of one digest.
WIDTH = 16


def hasher() -> Any:
    """A running XXH3-128: ``update`` with each part of a value in order, then ``digest``."""
    return xxhash.xxh3_128()


def stored(data: bytes | memoryview | np.ndarray) -> bytes:
    """The digest of a value's stored bytes (:data:`STORED_ALGORITHM`)."""
    return xxhash.xxh3_128_digest(data)


def stored_value(value: Any) -> bytes:
    """The digest of what ``value`` (with ``emit(write, scratch)``, as sinks store it) would store, made part by
    part in one reused buffer."""
    state = hasher()
    buffer = [np.empty(0, dtype=np.uint8)]

    def scratch(n: int) -> np.ndarray:
        if buffer[0].size < n:
            buffer[0] = np.empty(n, dtype=np.uint8)
        return buffer[0][:n]

    value.emit(state.update, scratch)
    return state.digest()

