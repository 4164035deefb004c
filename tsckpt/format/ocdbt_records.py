"""What every OCDBT record is built from: LEB128 varints (alone or in columns, vectorised: a leaf holds up to a
million entries), the envelope around a manifest or node (header, body, crc32c), and data file tables."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import crc32c as _crc32c
import numpy as np

_HEADER = struct.Struct(">IQ")  # magic (big-endian), then the whole encoded length (little-endian, below)


class OcdbtFormatError(ValueError):
    """An OCDBT manifest or node that is damaged or not of the kind :mod:`tsckpt.format.ocdbt` writes."""


def varint(n: int) -> bytes:
    """``n`` (unsigned) as LEB128."""
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


class VarintColumn:
    """A column encoded once as LEB128, to be cut into the byte runs of consecutive values: ``[lo, hi)``."""

    def __init__(self, values: np.ndarray | Sequence[int]):
        self.data, self.starts = varint_column(values)

    def cut(self, lo: int, hi: int) -> bytes:
        return self.data[self.starts[lo]:self.starts[hi]].tobytes()


def varint_column(values: np.ndarray | Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """LEB128 bytes of a column (uint8), and where each value's bytes begin (``len + 1`` offsets)."""
    v = np.asarray(values)
    v = v.reshape(-1).view(np.uint64) if v.dtype == np.int64 else np.asarray(v, dtype=np.uint64).reshape(-1)
    if not v.size:
        return np.zeros(0, np.uint8), np.zeros(1, np.int64)
    top = int(v.max())
    if top < 0x80:  # one byte each: most of a node's small columns
        return v.astype(np.uint8), np.arange(v.size + 1, dtype=np.int64)
    if top >= 1 << 56:
        return _wide_varints(v, top)
    # Each value's bytes in one little-endian word (four bytes or eight), continuation bits included: a few passes
    # over words instead of one per byte. Block by block, so that temporaries stay a few megabytes, reused.
    word = _WORD4 if top < 1 << 28 else _WORD8
    width = (top.bit_length() + 6) // 7
    blocks = [(lo, min(v.size, lo + _BLOCK)) for lo in range(0, v.size, _BLOCK)]
    index = np.int32 if v.size * word.size < 1 << 31 else np.int64
    if int(v.min()) >> (7 * (width - 1)):
        # Every value as wide as the widest (an array's offsets, at scale): each word stored whole, ``width`` bytes
        # after the one before (picking each word's bytes by a mask cost several times more). A word's bytes past
        # its varint are made the next value's first bytes, so overlapping stores agree in any order.
        data = np.empty(v.size * width + word.size - width, np.uint8)
        into = np.ndarray((v.size,), word.type, data, 0, (width,))
        for lo, hi in blocks:
            words = _words(v[lo:hi + 1], word, width)
            if width < word.size:
                words[:-1] |= words[1:] << word.type(8 * width)
            into[lo:hi] = words[:hi - lo]
        return data[:v.size * width], np.arange(0, (v.size + 1) * width, width, dtype=index)
    nbytes = np.empty(v.size, dtype=np.uint8)
    for lo, hi in blocks:
        count = nbytes[lo:hi]
        count[:] = 1
        for k in range(1, width):
            count += v[lo:hi] >= (1 << (7 * k))
    starts = np.zeros(v.size + 1, dtype=index)
    np.cumsum(nbytes, out=starts[1:])
    # Room for the bytes the last values' planes write past the end (see _planes).
    data = np.empty(int(starts[-1]) + width, np.uint8)
    for lo, hi in blocks:
        _planes(v[lo:hi], nbytes[lo:hi], starts[lo:hi], word, width, data)
    return data[:int(starts[-1])], starts


#: Values encoded at once by :func:`varint_column`.
_BLOCK = 1 << 18


def _words(v: np.ndarray, word: _Word, width: int) -> np.ndarray:
    """Each of ``v`` as the ``width`` bytes of its varint in a little-endian word (the bytes above them 0)."""
    w = v.astype(word.type)
    out = w & word.type(0x7F)
    byte = np.empty_like(w)
    for k in range(1, width):
        np.left_shift(w, word.type(k), out=byte)
        byte &= word.type(0x7F << (8 * k))
        out |= byte
    out |= word.continued[width]
    return out


def _planes(v: np.ndarray, nbytes: np.ndarray, starts: np.ndarray, word: _Word, width: int, data: np.ndarray) -> None:
    """The varints of ``v`` (``nbytes`` each) into ``data`` at ``starts``: byte ``k`` of every value at once,
    from the last byte to the first. Byte ``k`` of a value shorter than ``k + 1`` bytes lands on a later value's
    byte ``j < k`` (or past the end), which a later pass writes over; no mask picks the bytes each value keeps."""
    w = v.astype(word.type)
    shifted, byte = np.empty_like(w), np.empty(len(v), np.uint8)
    at = starts + (width - 1)
    for k in range(width - 1, -1, -1):
        np.right_shift(w, word.type(7 * k), out=shifted)
        np.bitwise_and(shifted, word.type(0x7F), out=byte, casting="unsafe")
        if k < width - 1:
            byte |= (nbytes > k + 1).view(np.uint8) << 7
        data[at] = byte
        at -= 1


class _Word:
    """Per byte count ``n``: the continuation bits of an ``n``-byte varint in a little-endian word."""

    def __init__(self, dtype: type):
        self.type = dtype
        self.size = np.dtype(dtype).itemsize
        self.continued = [dtype(sum(0x80 << (8 * k) for k in range(n - 1))) for n in range(self.size + 1)]


_WORD4, _WORD8 = _Word(np.uint32), _Word(np.uint64)


def _wide_varints(v: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`varint_column` of values of nine or ten bytes (at or above 2**56): byte by byte."""
    nbytes = np.ones(v.size, dtype=np.uint8)
    width = 1
    while width < 10 and top >> (7 * width):
        nbytes += v >= (1 << (7 * width))
        width += 1
    starts = np.zeros(v.size + 1, dtype=np.int64)
    np.cumsum(nbytes, out=starts[1:])
    rows = np.empty((width, v.size), dtype=np.uint8)
    for k in range(width):
        byte = (v >> np.uint64(7 * k)).astype(np.uint8)
        byte &= 0x7F
        byte |= (nbytes > k + 1).view(np.uint8) << 7
        rows[k] = byte
    return rows.T[(np.arange(width, dtype=np.uint8)[:, None] < nbytes).T], starts


def prefix_lengths(keys: Sequence[bytes], block: int = 1 << 16) -> np.ndarray:
    """For each key, the length of its common prefix with the key before it (0 for the first); vectorised."""
    return sorted_prefix_lengths(keys, block)[0]


def sorted_prefix_lengths(keys: Sequence[bytes], block: int = 1 << 16) -> tuple[np.ndarray, int | None]:
    """:func:`prefix_lengths`, and the first key not greater than the one before it (None if none). Keys hold no
    NUL byte (names escape it): as fixed-width rows, a key that is a prefix of the next differs at a NUL of padding."""
    n = len(keys)
    out = np.zeros(n, dtype=np.int64)
    for start in range(1, n, block):
        part = keys[start - 1:start + block]
        lengths = np.fromiter((len(k) for k in part), np.int64, len(part))
        width = int(lengths.max()) or 1
        rows = np.array(part, dtype=f"S{width}").view(np.uint8).reshape(len(part), width)
        differ = rows[1:] != rows[:-1]
        found = differ.any(axis=1)
        first = np.where(found, differ.argmax(axis=1), width)
        out[start:start + len(part) - 1] = np.minimum(first, np.minimum(lengths[:-1], lengths[1:]))
        at = np.minimum(first, width - 1)[:, None]
        greater = found & (np.take_along_axis(rows[1:], at, 1)[:, 0] > np.take_along_axis(rows[:-1], at, 1)[:, 0])
        if not greater.all():
            return out, start + int(np.argmin(greater))
    return out, None


class Reader:
    """A cursor over encoded bytes; every read past the end raises :class:`OcdbtFormatError`."""

    def __init__(self, data: bytes | memoryview, where: str):
        self.data, self.at, self.where = memoryview(data), 0, where

    def fail(self, what: str) -> OcdbtFormatError:
        return OcdbtFormatError(f"{self.where}: {what} (at byte {self.at})")

    def take(self, n: int) -> memoryview:
        if n < 0 or self.at + n > len(self.data):
            raise self.fail(f"ends before {n} more bytes")
        out = self.data[self.at:self.at + n]
        self.at += n
        return out

    def byte(self) -> int:
        return self.take(1)[0]

    def varint(self) -> int:
        value, shift = 0, 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7
            if shift > 63:
                raise self.fail("a varint longer than 64 bits")

    def varints(self, n: int) -> list[int]:
        return self.column(n).tolist()

    def column(self, n: int) -> np.ndarray:
        """The next ``n`` varints at once, as ``uint64`` (vectorised: a leaf holds up to a million)."""
        if n <= 0:
            return np.zeros(0, dtype=np.uint64)
        window = np.frombuffer(self.data, dtype=np.uint8, count=min(10 * n, len(self.data) - self.at), offset=self.at)
        ends = np.flatnonzero(window < 0x80)[:n]
        if len(ends) < n:
            raise self.fail(f"ends inside a column of {n} varints")
        starts = np.empty(n, dtype=np.int64)
        starts[0] = 0
        starts[1:] = ends[:-1] + 1
        lengths = ends - starts + 1
        if int(lengths.max()) > 10:
            raise self.fail("a varint longer than 64 bits")
        values = np.zeros(n, dtype=np.uint64)
        for k in range(int(lengths.max())):
            live = lengths > k
            values[live] |= (window[starts[live] + k] & 0x7F).astype(np.uint64) << np.uint64(7 * k)
        self.at += int(ends[-1]) + 1
        return values

    def done(self) -> None:
        if self.at != len(self.data):
            raise self.fail(f"{len(self.data) - self.at} bytes left over")


def envelope(magic: int, body: bytes | Sequence[bytes]) -> bytes:
    """Header (magic, total length, version 0, uncompressed), ``body`` (or its parts), then the crc32c of all
    before it."""
    out = bytearray()
    envelope_into(out, magic, (body,) if isinstance(body, (bytes, bytearray, memoryview)) else body)
    return bytes(out)


def envelope_into(out: bytearray, magic: int, parts: Sequence[bytes | memoryview]) -> int:
    """:func:`envelope` of the body made of ``parts``, appended to ``out`` (a record of its own per leaf would copy
    every leaf twice); returns its length."""
    length = _HEADER.size + 2 + sum(map(len, parts)) + 4
    head = magic.to_bytes(4, "big") + length.to_bytes(8, "little") + b"\x00\x00"
    crc = _crc32c.crc32c(head)
    out += head
    for part in parts:
        crc = _crc32c.crc32c(part, crc)
        out += part
    out += crc.to_bytes(4, "little")
    return length


def open_envelope(data: bytes | memoryview, magic: int, where: str) -> Reader:
    """The body of an encoded manifest or node, after checking its header and crc32c."""
    data = memoryview(data)
    if len(data) < _HEADER.size + 2 + 4:
        raise OcdbtFormatError(f"{where}: {len(data)} bytes is too short for an OCDBT record")
    found = struct.unpack(">I", data[:4])[0]
    if found != magic:
        raise OcdbtFormatError(f"{where}: starts with 0x{found:08x}, expected 0x{magic:08x}")
    length = struct.unpack("<Q", data[4:12])[0]
    if length != len(data):
        raise OcdbtFormatError(f"{where}: its header says {length} bytes, but it is {len(data)}")
    stored = struct.unpack("<I", data[-4:])[0]
    if _crc32c.crc32c(data[:-4]) != stored:
        raise OcdbtFormatError(f"{where}: does not match its crc32c (it was damaged)")
    reader = Reader(data[:-4], where)
    reader.at = 12
    if reader.varint() != 0:
        raise reader.fail("format version other than 0")
    if reader.varint() != 0:
        raise reader.fail("compressed; tsckpt writes and reads uncompressed records only")
    return reader


def encode_file_table(paths: Sequence[str]) -> bytes:
    """A data file table of ``paths`` (sorted, distinct; base paths empty)."""
    raw = [p.encode() for p in paths]
    if raw != sorted(set(raw)):
        raise ValueError("data file paths must be sorted and distinct")
    prefixes = prefix_lengths(raw).tolist()
    columns = (prefixes[1:], [len(p) - n for p, n in zip(raw, prefixes)], [0] * len(raw))
    return (varint(len(raw)) + b"".join(bytes(varint_column(c)[0]) for c in columns)
            + b"".join(p[n:] for p, n in zip(raw, prefixes)))


def decode_file_table(r: Reader) -> list[str]:
    n = r.varint()
    prefixes = [0] + r.varints(n - 1) if n else []
    suffixes = r.varints(n)
    bases = r.varints(n)
    out: list[str] = []
    prev = b""
    for k in range(n):
        if prefixes[k] > len(prev):
            raise r.fail(f"data file {k}'s prefix is longer than the path before it")
        path = prev[:prefixes[k]] + bytes(r.take(suffixes[k]))
        if bases[k] > len(path):
            raise r.fail(f"data file {k}'s base path is longer than its path")
        out.append(path.decode("utf-8", "surrogateescape"))
        prev = path
    return out
