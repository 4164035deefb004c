"""zarr-python's byte requests as the slices TensorStore reads and the spans a value's checks look at."""

from __future__ import annotations

from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, SuffixByteRequest


def span(byte_range: ByteRequest | None, size: int) -> tuple[int, int]:
    """``[start, end)`` of a request into a value of ``size`` bytes."""
    if byte_range is None:
        return 0, size
    if isinstance(byte_range, RangeByteRequest):
        return byte_range.start, byte_range.end
    if isinstance(byte_range, OffsetByteRequest):
        return byte_range.offset, size
    return size - byte_range.suffix, size


def as_slice(byte_range: ByteRequest | None) -> slice | None:
    if byte_range is None:
        return None
    if isinstance(byte_range, RangeByteRequest):
        return slice(byte_range.start, byte_range.end)
    if isinstance(byte_range, OffsetByteRequest):
        return slice(byte_range.offset, None)
    if isinstance(byte_range, SuffixByteRequest):
        return slice(-byte_range.suffix, None) if byte_range.suffix else slice(0, 0)
    raise TypeError(f"unexpected byte range {byte_range!r}")


def clipped(value: bytes, byte_range: ByteRequest | None) -> bytes:
    """What zarr's own stores return for a range that runs past the end of ``value``."""
    if isinstance(byte_range, RangeByteRequest):
        return value[byte_range.start:byte_range.end]
    if isinstance(byte_range, OffsetByteRequest):
        return value[byte_range.offset:]
    if isinstance(byte_range, SuffixByteRequest):
        return value[max(len(value) - byte_range.suffix, 0):]
    return value
