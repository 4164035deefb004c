"""A rank's digest table: the content hash of every outer chunk one rank saved, stored beside its data.

Incremental saves compare each chunk's content hash
(:mod:`tsckpt.format.content_hashes`) with the base's. Since format version 4
those hashes no longer sit in the root document, which every loading rank
reads and which would grow with ranks x tensors; each rank writes the table
of its own chunks once, at the end of its data file (packed layout) or as a
file of its own (plain layout), and the root document records where
(:class:`~tsckpt.format.data_files.DataFiles`). Only a save that takes this
checkpoint as its base reads the tables, and only those of the ranks whose
chunks it may take.

Encoding, all integers little-endian::

    magic      8 bytes  b"TSCKDGST"
    version    u32      1
    header     u32      length of the JSON header that follows
    JSON       {"algorithm": "xxh3_128_stored", "paths": [array path, ...], "count": n}
    tensor     n x u32  index into "paths" of each chunk's array
    chunk      n x u64  flat index of each chunk in its array's chunk grid (row-major)
    digest     n x 16 bytes (XXH3-128 of the chunk's stored bytes, canonical big-endian form)
    crc32c     u32      of every byte before it

Pure functions of bytes; no I/O.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import crc32c as _crc32c
import numpy as np

from ..errors import ChecksumError, MetadataError
from . import content_hashes

MAGIC = b"TSCKDGST"
VERSION = 1
_HEAD = struct.Struct("<8sII")


@dataclass(frozen=True)
class DigestTable:
    """The content hashes of the chunks one rank saved: ``digests[k]`` of chunk ``chunk[k]`` of array
    ``paths[tensor[k]]``."""

    paths: tuple[str, ...]
    tensor: np.ndarray  # uint32 [n]
    chunk: np.ndarray  # uint64 [n]
    digests: np.ndarray  # uint8 [n, 16]

    def encode(self) -> bytes:
        header = json.dumps({"algorithm": content_hashes.STORED_ALGORITHM, "paths": list(self.paths),
                             "count": len(self.tensor)}, separators=(",", ":")).encode()
        body = b"".join((_HEAD.pack(MAGIC, VERSION, len(header)), header,
                         np.asarray(self.tensor, "<u4").tobytes(), np.asarray(self.chunk, "<u8").tobytes(),
                         np.ascontiguousarray(self.digests, np.uint8).tobytes()))
        return body + struct.pack("<I", _crc32c.crc32c(body))

    @classmethod
    def decode(cls, data: bytes | memoryview, where: str) -> DigestTable:
        """The table in ``data``; :class:`ChecksumError` if it was damaged, :class:`MetadataError` if malformed."""
        raw = memoryview(data)
        if len(raw) < _HEAD.size + 4:
            raise MetadataError(f"{where}: a digest table of {len(raw)} bytes is too short")
        if _crc32c.crc32c(raw[:-4]) != struct.unpack("<I", raw[-4:])[0]:
            raise ChecksumError(f"{where}: the digest table does not match its crc32c (it was damaged)")
        magic, version, size = _HEAD.unpack(raw[:_HEAD.size])
        if magic != MAGIC or version != VERSION:
            raise MetadataError(f"{where}: not a version-{VERSION} digest table")
        try:
            header = json.loads(bytes(raw[_HEAD.size:_HEAD.size + size]))
            algorithm, paths, n = header["algorithm"], header["paths"], header["count"]
        except (ValueError, KeyError, TypeError) as e:
            raise MetadataError(f"{where}: the digest table's header is malformed ({e})") from None
        if algorithm != content_hashes.STORED_ALGORITHM or not isinstance(n, int) or n < 0 or not (
                isinstance(paths, list) and all(isinstance(p, str) for p in paths)):
            raise MetadataError(f"{where}: the digest table's header is malformed")
        at = _HEAD.size + size
        if len(raw) - 4 - at != n * (4 + 8 + content_hashes.WIDTH):
            raise MetadataError(f"{where}: the digest table holds another number of rows than the {n} it declares")
        tensor = np.frombuffer(raw, "<u4", n, at)
        chunk = np.frombuffer(raw, "<u8", n, at + 4 * n)
        digests = np.frombuffer(raw, np.uint8, n * content_hashes.WIDTH, at + 12 * n).reshape(n, -1)
        if n and int(tensor.max()) >= len(paths):
            raise MetadataError(f"{where}: the digest table names an array it does not list")
        return cls(tuple(paths), tensor, chunk, digests)

    @classmethod
    def of(cls, paths: Sequence[str], tensor: Sequence[int], chunk: Sequence[int],
           digests: Sequence[bytes]) -> DigestTable:
        return cls(tuple(paths), np.asarray(tensor, np.uint32), np.asarray(chunk, np.uint64),
                   np.frombuffer(b"".join(digests), np.uint8).reshape(-1, content_hashes.WIDTH))

    def by_array(self) -> dict[str, dict[int, bytes]]:
        """Every digest, by array path and flat chunk index."""
        out: dict[str, dict[int, bytes]] = {p: {} for p in self.paths}
        for t, c, d in zip(self.tensor.tolist(), self.chunk.tolist(), self.digests):
            out[self.paths[t]][c] = d.tobytes()
        return out
