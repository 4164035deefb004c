"""The Zarr v3 array metadata (``zarr.json``) tsckpt writes for each entry.

One function builds it, used both for writing chunks before any ``zarr.json``
exists (TensorStore's ``assume_metadata``) and for the ``zarr.json`` the
coordinator writes at commit, so the two can never disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import dtypes

_BYTES = {"name": "bytes", "configuration": {"endian": "little"}}
_CRC32C = {"name": "crc32c"}


def _leaf_codecs(dt: dtypes.DType) -> list[dict[str, Any]]:
    # One-byte types must not declare an endianness (zarr-python rejects it).
    return [{"name": "bytes"} if dt.itemsize == 1 else _BYTES, _CRC32C]


def array_metadata(
    shape: Sequence[int],
    dtype: str,
    chunk_shape: Sequence[int],
    inner_chunk_shape: Sequence[int] | None = None,
    attributes: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``zarr.json`` document of one array. Every chunk carries a crc32c."""
    dt = dtypes.from_zarr(dtype)
    if inner_chunk_shape is None:
        codecs = _leaf_codecs(dt)
    else:
        codecs = [{
            "name": "sharding_indexed",
            "configuration": {
                "chunk_shape": list(inner_chunk_shape),
                "codecs": _leaf_codecs(dt),
                "index_codecs": [_BYTES, _CRC32C],
                "index_location": "end",
            },
        }]
    doc: dict[str, Any] = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": dt.zarr,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": dt.fill_value,
        "codecs": codecs,
    }
    if attributes is not None:
        doc["attributes"] = attributes
    return doc


def group_metadata(attributes: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}
