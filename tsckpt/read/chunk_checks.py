"""The crc32c checks of what zarr-python reads of a chunk through :func:`tsckpt.zarr_store`: a whole chunk
as stored (compressed: decoded), of a part what covers whole checksummed pieces (the shard index, an inner
chunk). Damage is returned as a problem, for the store to raise an error naming the tensor, chunk and file."""

from __future__ import annotations

import numpy as np
from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, SuffixByteRequest

from ..errors import ChecksumError
from ..format import checksums, compressed, dtypes, shards
from ..format.metadata import ArrayOptions, TensorEntry

_CHANGED = "does not match its stored crc32c (the data changed after it was written)"


def check_read(key: str, value: bytes, byte_range: ByteRequest | None, entry: TensorEntry | None,
               index: tuple[int, ...], options: ArrayOptions, pieces: dict[str, set[tuple[int, int]]]) -> str | None:
    """What is wrong with ``value``, read by ``byte_range`` from chunk ``index`` (key ``key``) of tensor ``entry``
    (None: a value blob), if anything. ``pieces`` keeps, per key, the inner chunks a compressed chunk's index
    gave, for the reads of them that follow."""
    if entry is None:  # a value blob: one piece, read whole
        return f"its blob {_CHANGED}" if byte_range is None and not checksums.intact(value) else None
    fmt = shards.value_format(entry, options)
    data = np.frombuffer(value, dtype=np.uint8)
    if options.compression is not None:
        return _check_compressed(key, entry, options, fmt, data, byte_range, pieces)
    start, end, _ = (as_slice(byte_range) or slice(None)).indices(fmt.nbytes)
    if (start, end) == (0, fmt.nbytes):
        try:
            shards.check_stored_codec(fmt, index, data, "")
        except ChecksumError as e:
            return str(e).removeprefix(": ")
    elif fmt.indexed and (start, end) == (fmt.nbytes - fmt.index_bytes, fmt.nbytes):
        if not checksums.intact(data):
            return "its shard index does not match its stored crc32c"
    elif end <= fmt.pieces * fmt.piece_bytes and start % fmt.piece_bytes == 0 and data.size % fmt.piece_bytes == 0:
        for at in range(0, data.size, fmt.piece_bytes):
            if not checksums.intact(data[at:at + fmt.piece_bytes]):
                return f"the inner chunk at bytes [{start + at}, {start + at + fmt.piece_bytes}) {_CHANGED}"
    return None


def _check_compressed(key: str, entry: TensorEntry, options: ArrayOptions, fmt: shards.ShardFormat,
                      data: np.ndarray, byte_range: ByteRequest | None,
                      pieces: dict[str, set[tuple[int, int]]]) -> str | None:
    """Compressed chunks: a whole one decoded and checked; its index, and then each inner chunk zarr reads by
    the ranges the index gives, by the crc32c each ends with."""
    assert options.compression is not None
    if byte_range is None:
        try:
            compressed.decode(fmt, options.compression, data, dtypes.from_zarr(entry.dtype).numpy, "")
        except ChecksumError as e:
            return str(e).removeprefix(": ")
        return None
    if fmt.indexed and isinstance(byte_range, SuffixByteRequest) and byte_range.suffix == fmt.index_bytes:
        if not checksums.intact(data):
            return "its shard index does not match its stored crc32c"
        pairs = np.frombuffer(data[:16 * fmt.pieces].tobytes(), dtype="<u8").reshape(-1, 2)
        pieces[key] = {(int(o), int(o + n)) for o, n in pairs.tolist() if o != shards.MISSING}
    elif isinstance(byte_range, RangeByteRequest) and (byte_range.start, byte_range.end) in pieces.get(key, ()):
        if not checksums.intact(data):
            return f"the inner chunk at bytes [{byte_range.start}, {byte_range.end}) {_CHANGED}"
    return None


def as_slice(byte_range: ByteRequest | None) -> slice | None:
    """zarr-python's byte request as the slice TensorStore reads (None: the whole value)."""
    if byte_range is None:
        return None
    if isinstance(byte_range, RangeByteRequest):
        return slice(byte_range.start, byte_range.end)
    if isinstance(byte_range, OffsetByteRequest):
        return slice(byte_range.offset, None)
    if isinstance(byte_range, SuffixByteRequest):
        return slice(-byte_range.suffix, None) if byte_range.suffix else slice(0, 0)
    raise TypeError(f"unexpected byte range {byte_range!r}")
