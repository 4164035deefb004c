"""A rank's chunk table: where every value one rank saved is stored, and its content hash, beside its data. A
loading rank reads the table of the rank that wrote a chunk (its ``writers``), so what it reads grows with the
chunks it reads. Sorted by key ``(array_key(path), flat chunk index)`` and cut into blocks whose first keys
and crc32c form a directory at the front (``docs/format.md``, section 8)."""

from __future__ import annotations

import bisect
import json
import struct
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import crc32c as _crc32c
import numpy as np
import xxhash

from ..errors import ChecksumError, MetadataError
from . import content_hashes

MAGIC = b"TSCKCTBL"
VERSION = 1
#: Records a block: a few kilobytes, so that a lookup of one key reads little beyond the directory.
BLOCK = 128
_HEAD = struct.Struct("<8sII")
_DIRECTORY = np.dtype([("array", "<u8"), ("chunk", "<u8"), ("crc", "<u4")])
#: Reads spans ``(table, offset, length)`` of several tables at once: their bytes, in order.
ReadSpans = Callable[[Sequence[tuple["TableReader", int, int]]], list[np.ndarray]]


def array_key(path: str) -> int:
    """The number that stands for array ``path`` in every chunk table."""
    return xxhash.xxh3_64_intdigest(path.encode("utf-8", "surrogateescape"))


def _record(located: bool, hashed: bool) -> np.dtype:
    fields = [("array", "<u8"), ("chunk", "<u8")]
    if located:
        fields += [("file", "<u4"), ("offset", "<u8"), ("length", "<u8")]
    if hashed:
        fields += [("digest", "u1", (content_hashes.WIDTH,))]
    return np.dtype(fields)


@dataclass(frozen=True)
class ChunkTable:
    """Rows of a chunk table (all, or those a reader looked up), sorted by key, of :func:`_record`'s dtype;
    ``files`` is empty for a table of no locations."""

    files: tuple[str, ...]
    hashed: bool
    records: np.ndarray

    @classmethod
    def of(cls, arrays: Sequence[str], chunks: Sequence[int], *, files: Sequence[str] = (),
           where: Sequence[tuple[int, int, int]] | None = None, digests: Sequence[bytes] | None = None) -> ChunkTable:
        """The table of values ``(arrays[k], chunks[k])``, stored at ``where[k]`` = (file index, offset, length)
        and hashed ``digests[k]``, in any order."""
        records = np.zeros(len(arrays), _record(where is not None, digests is not None))
        keys = {p: array_key(p) for p in set(arrays)}
        records["array"] = [keys[p] for p in arrays]
        records["chunk"] = chunks
        if where is not None:
            located = np.asarray(where, np.int64).reshape(-1, 3)
            records["file"], records["offset"], records["length"] = located.T
        if digests is not None:
            records["digest"] = np.frombuffer(b"".join(digests), np.uint8).reshape(-1, content_hashes.WIDTH)
        records = np.sort(records, order=["array", "chunk"], kind="stable")
        if len(records) > 1:
            same = (records["array"][1:] == records["array"][:-1]) & (records["chunk"][1:] == records["chunk"][:-1])
            if same.any():
                k = int(np.flatnonzero(same)[0])
                raise MetadataError(f"two values of one rank share the key ({records['array'][k]}, "
                                    f"{records['chunk'][k]}): two arrays whose paths hash alike, or a chunk "
                                    f"written twice")
        return cls(tuple(files), digests is not None, records)

    def encode(self) -> bytes:
        n = len(self.records)
        blocks = [self.records[k:k + BLOCK] for k in range(0, n, BLOCK)]
        directory = np.zeros(len(blocks), _DIRECTORY)
        for k, block in enumerate(blocks):
            directory[k] = (block["array"][0], block["chunk"][0], _crc32c.crc32c(block.tobytes()))
        header = json.dumps({"files": list(self.files),
                             "digests": content_hashes.STORED_ALGORITHM if self.hashed else None,
                             "count": n, "block": BLOCK}, separators=(",", ":")).encode()
        front = b"".join((_HEAD.pack(MAGIC, VERSION, len(header)), header, directory.tobytes()))
        return front + struct.pack("<I", _crc32c.crc32c(front)) + self.records.tobytes()

    def get(self, path: str, chunk: int) -> np.void | None:
        """The row of chunk ``chunk`` of array ``path``, or None."""
        return self.get_key(array_key(path), chunk)

    def get_key(self, key: int, chunk: int) -> np.void | None:
        """:meth:`get` by the array's :func:`array_key`."""
        at = int(np.searchsorted(self.records["array"], key))
        stop = int(np.searchsorted(self.records["array"], key, side="right"))
        rows = self.records[at:stop]
        k = int(np.searchsorted(rows["chunk"], chunk))
        return rows[k] if k < len(rows) and int(rows["chunk"][k]) == chunk else None


class _Front(NamedTuple):
    """A chunk table's header and directory, parsed."""

    files: tuple[str, ...]
    hashed: bool
    block: int
    count: int
    directory: np.ndarray
    start: int
    record: np.dtype


class TableReader:
    """A chunk table as a reader looks keys up in it: its front (header and directory), then only the blocks it
    needs; one of at most ``whole_up_to`` bytes is taken whole. :meth:`wants` says which spans it needs next,
    :meth:`take` hands them over, so a caller fetches those of many tables together (:func:`look_up`)."""

    def __init__(self, length: int, where: str, whole_up_to: int = 0):
        self.length, self.where = length, where
        self._whole_up_to = whole_up_to
        self._head = b""  # the bytes read from the table's start
        self._front: _Front | None = None
        self._blocks: dict[int, np.ndarray] = {}
        self.bytes_read = 0

    def wants(self, keys: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """The spans ``(offset, length)`` of the table to read next to find ``keys`` (``(array key, chunk)``
        pairs); none once everything they need is here."""
        if self._front is None:
            have = len(self._head)
            if not have:
                return [(0, self.length if self.length <= self._whole_up_to else min(self.length, _FRONT))]
            need = self._front_length()
            if need > have:
                return [(have, need - have)]
            self._parse_front()
        return [self._span(k) for k in self._blocks_of(keys) if k not in self._blocks and not self._in_head(k)]

    def take(self, spans: Sequence[tuple[int, int]], data: Sequence[np.ndarray | bytes]) -> None:
        """The bytes of ``spans`` (as :meth:`wants` gave them), read."""
        for (offset, length), raw in zip(spans, data):
            if len(raw) != length:
                raise MetadataError(f"{self.where}: the chunk table is cut short (bytes {offset}+{length})")
            self.bytes_read += length
            if self._front is None:
                self._head += bytes(raw)
                continue
            f = self._front
            self._take_block((offset - f.start) // (f.block * f.record.itemsize), np.frombuffer(bytes(raw), np.uint8))

    def rows(self, keys: Iterable[tuple[int, int]]) -> ChunkTable:
        """Every row of the blocks holding ``keys`` (all read)."""
        front = self._parsed()
        parts = []
        for k in self._blocks_of(keys):
            if k not in self._blocks and self._in_head(k):
                start, length = self._span(k)
                self._take_block(k, np.frombuffer(self._head[start:start + length], np.uint8))
            parts.append(self._blocks[k])
        return ChunkTable(front.files, front.hashed, np.concatenate(parts) if parts else np.zeros(0, front.record))

    def every_key(self) -> list[tuple[int, int]]:
        """The first key of every block (whose lookups read the whole table)."""
        directory = self._parsed().directory
        return list(zip(directory["array"].tolist(), directory["chunk"].tolist()))

    def _parsed(self) -> _Front:
        if self._front is None:
            self._parse_front()
        assert self._front is not None
        return self._front

    def _header(self) -> tuple[int, dict]:
        head = self._head
        fail = f"{self.where}: not a version-{VERSION} chunk table"
        if self.length < _HEAD.size + 4 or len(head) < _HEAD.size:
            raise MetadataError(f"{fail} ({self.length} bytes)")
        magic, version, size = _HEAD.unpack(head[:_HEAD.size])
        if magic != MAGIC or version != VERSION:
            raise MetadataError(fail)
        if _HEAD.size + size + 4 > self.length:
            raise MetadataError(f"{fail} (its header runs past its end)")
        if len(head) < _HEAD.size + size:
            return size, {}
        try:
            header = json.loads(head[_HEAD.size:_HEAD.size + size])
            files, digests, n, block = header["files"], header["digests"], header["count"], header["block"]
        except (ValueError, KeyError, TypeError) as e:
            raise MetadataError(f"{self.where}: the chunk table's header is malformed ({e})") from None
        if (not isinstance(files, list) or not all(isinstance(f, str) for f in files)
                or digests not in (None, content_hashes.STORED_ALGORITHM)
                or not isinstance(n, int) or n < 0 or not isinstance(block, int) or block < 1):
            raise MetadataError(f"{self.where}: the chunk table's header is malformed")
        return size, header

    def _front_length(self) -> int:
        """The bytes of header, directory and crc32c, as far as the bytes read so far tell."""
        size, header = self._header()
        if not header:
            return _HEAD.size + size
        return _HEAD.size + size + -(-header["count"] // header["block"]) * _DIRECTORY.itemsize + 4

    def _parse_front(self) -> None:
        size, header = self._header()
        files, hashed = tuple(header["files"]), header["digests"] is not None
        n, block, record = header["count"], header["block"], _record(bool(files), hashed)
        front = self._front_length()
        if front + n * record.itemsize != self.length:
            raise MetadataError(f"{self.where}: the chunk table holds another number of rows than the {n} it declares")
        head = self._head
        if _crc32c.crc32c(head[:front - 4]) != struct.unpack("<I", head[front - 4:front])[0]:
            raise ChecksumError(f"{self.where}: the chunk table's directory does not match its crc32c (it was "
                                "damaged)")
        directory = np.frombuffer(head, _DIRECTORY, -(-n // block), _HEAD.size + size)
        self._front = _Front(files, hashed, block, n, directory, front, record)

    def _blocks_of(self, keys: Iterable[tuple[int, int]]) -> list[int]:
        firsts = self.every_key()
        return sorted({k for k in (bisect.bisect_right(firsts, key) - 1 for key in set(keys)) if k >= 0})

    def _span(self, k: int) -> tuple[int, int]:
        f = self._parsed()
        return f.start + k * f.block * f.record.itemsize, min(f.block, f.count - k * f.block) * f.record.itemsize

    def _in_head(self, k: int) -> bool:
        start, length = self._span(k)
        return start + length <= len(self._head)

    def _take_block(self, k: int, raw: np.ndarray) -> None:
        front = self._parsed()
        directory = front.directory
        if _crc32c.crc32c(raw) != int(directory["crc"][k]):
            raise ChecksumError(f"{self.where}: block {k} of the chunk table does not match its crc32c (it was "
                                "damaged)")
        rows = np.frombuffer(raw.tobytes(), front.record)
        a, c = rows["array"], rows["chunk"]
        if (len(rows) == 0 or (int(a[0]), int(c[0])) != (int(directory["array"][k]), int(directory["chunk"][k]))
                or not ((a[1:] > a[:-1]) | ((a[1:] == a[:-1]) & (c[1:] > c[:-1]))).all()):
            raise MetadataError(f"{self.where}: block {k} of the chunk table is out of key order")
        if front.files and int(rows["file"].max()) >= len(front.files):
            raise MetadataError(f"{self.where}: the chunk table names a file it does not list")
        self._blocks[k] = rows


#: Bytes read first from a table too large to take whole: its header and directory, for up to 3,000 blocks.
_FRONT = 64 << 10


def look_up(wanted: Mapping[TableReader, Collection[tuple[int, int]]],
            read: ReadSpans) -> dict[TableReader, ChunkTable]:
    """Each table's rows that hold its keys, reading what every table needs next together, round after round."""
    while True:
        spans = {table: table.wants(keys) for table, keys in wanted.items()}
        spans = {table: s for table, s in spans.items() if s}
        if not spans:
            return {table: table.rows(keys) for table, keys in wanted.items()}
        flat = [(table, span) for table, s in spans.items() for span in s]
        data = read([(table, offset, length) for table, (offset, length) in flat])
        for table, s in spans.items():
            table.take(s, [d for (t, _), d in zip(flat, data) if t is table])
