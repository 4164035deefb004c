"""Content hashes: the XXH3-128 of every outer chunk's stored bytes, which incremental saves compare.

Each rank keeps the digests of the chunks it wrote in its chunk table (:mod:`tsckpt.format.chunk_table`),
16 bytes in XXH3's canonical (big-endian) form. A save given a base (``docs/format.md``, section 8)
takes a chunk from it only when the digests are equal and the base's copy passes its crc32c. XXH3 is the
fastest candidate measured (32 GB/s a core); it guards against accidental equality, not crafted collisions."""

from __future__ import annotations

from typing import Any

import numpy as np
import xxhash

#: XXH3-128 of an outer chunk's *stored* bytes (tsckpt's layout: inner chunks, their
#: crc32c, the index), taken from the buffers being written, where hashing the elements would cost one
#: more pass over the tensor. Stored bytes are a function of the elements (and the codecs), so equal
#: digests still mean equal chunks.
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
    """The digest of what ``value`` (a value as sinks store it: ``emit(write, scratch)``) would store, without
    storing it: its bytes are made part by part in one reused buffer and hashed."""
    state = hasher()
    buffer = [np.empty(0, dtype=np.uint8)]

    def scratch(n: int) -> np.ndarray:
        if buffer[0].size < n:
            buffer[0] = np.empty(n, dtype=np.uint8)
        return buffer[0][:n]

    value.emit(state.update, scratch)
    return state.digest()

