"""The Zarr v3 documents (``zarr.json``) tsckpt writes: one builder for the chunks written before any
``zarr.json`` exists (TensorStore's ``assume_metadata``) and for the documents written at commit."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from . import dtypes

_BYTES = {"name": "bytes", "configuration": {"endian": "little"}}
# "." keeps every chunk file directly in its array's directory ("c.0.1"): half the inodes of "c/0/1".
CHUNK_KEY_SEPARATOR = "."
_CRC32C = {"name": "crc32c"}


#: Optional compression, by name. Weights and optimizer moments barely compress (bf16/fp32 noise): default none.
COMPRESSORS: dict[str, Callable[[int], dict[str, Any]]] = {  # by item size
    "zstd": lambda itemsize: {"name": "zstd", "configuration": {"level": 1, "checksum": False}},
    "blosc": lambda itemsize: {"name": "blosc", "configuration": {
        "cname": "lz4", "clevel": 5, "shuffle": "shuffle", "typesize": itemsize, "blocksize": 0}},
}


def _leaf_codecs(dt: dtypes.DType, checksums: bool, compression: str | None) -> list[dict[str, Any]]:
    # One-byte types must not declare an endianness (zarr-python rejects it).
    codecs = [{"name": "bytes"} if dt.itemsize == 1 else _BYTES]
    if compression is not None:
        codecs.append(COMPRESSORS[compression](dt.itemsize))
    return codecs + [_CRC32C] if checksums else codecs


def array_metadata(shape: Sequence[int], dtype: str, chunk_shape: Sequence[int],
                   inner_chunk_shape: Sequence[int] | None = None, attributes: dict[str, Any] | None = None, *,
                   checksums: bool = True, compression: str | None = None,
                   dimension_names: Sequence[str] | None = None) -> dict[str, Any]:
    """The ``zarr.json`` document of one array. With ``checksums`` every chunk (and shard index) carries a
    crc32c; ``compression`` names an entry of :data:`COMPRESSORS` applied before it."""
    dt = dtypes.from_zarr(dtype)
    codecs = _leaf_codecs(dt, checksums, compression)
    if inner_chunk_shape is not None:
        codecs = [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": list(inner_chunk_shape), "codecs": codecs,
            "index_codecs": [_BYTES, _CRC32C] if checksums else [_BYTES], "index_location": "end"}}]
    doc: dict[str, Any] = {
        "zarr_format": 3, "node_type": "array", "shape": list(shape), "data_type": dt.zarr,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": CHUNK_KEY_SEPARATOR}},
        "fill_value": dt.fill_value, "codecs": codecs}
    if dimension_names is not None:
        doc["dimension_names"] = list(dimension_names)
    if attributes is not None:
        doc["attributes"] = attributes
    return doc


def blob_metadata(nbytes: int, attributes: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``zarr.json`` of a value blob: ``nbytes`` of ``uint8`` in one chunk, with a crc32c."""
    return array_metadata([nbytes], "uint8", [max(nbytes, 1)], attributes=attributes)


#: The codecs of every value blob: raw bytes and a crc32c, never compressed (its length plus 4 bytes stored).
BLOB_CODECS: list[dict[str, Any]] = blob_metadata(0)["codecs"]
BLOB_CHECKSUM_BYTES = 4


def chunk_key(index: Sequence[int], separator: str = CHUNK_KEY_SEPARATOR) -> str:
    """The key of one chunk relative to its array ("c" for a 0-d array's only chunk)."""
    return separator.join(["c", *map(str, index)])


def chunk_key_separator(doc: dict[str, Any]) -> str:
    """The separator a ``zarr.json`` declares ("/" is Zarr v3's default when it says none)."""
    encoding = doc.get("chunk_key_encoding")
    config = encoding.get("configuration") if isinstance(encoding, dict) else None
    return str(config.get("separator", "/")) if isinstance(config, dict) else "/"


def group_metadata(attributes: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}
