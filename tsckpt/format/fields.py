"""Field parsers for the metadata document: each checks one JSON value and names it in its error."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import MetadataError

#: Most dimensions of a tensor or a mesh (TensorStore's own maximum rank).
MAX_NDIM = 32
#: Largest byte size of one tensor: its byte count must fit a signed 64-bit integer.
MAX_TENSOR_BYTES = 2**63 - 1


def parse_ints(value: Any, what: str, *, minimum: int = 0) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= minimum
                                              for v in value):
        raise MetadataError(f"{what}: expected a list of integers >= {minimum}, got {value!r}")
    return tuple(value)


def get_field(d: Mapping[str, Any], key: str, what: str, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(d, Mapping):
        raise MetadataError(f"{what}: expected a JSON object, got {type(d).__name__}")
    if key not in d:
        raise MetadataError(f"{what}: missing field {key!r}")
    value = d[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise MetadataError(f"{what}: field {key!r} has the wrong type ({type(value).__name__})")
    return value


def parse_shape(value: Any, what: str, field: str, *, minimum: int = 0) -> tuple[int, ...]:
    dims = parse_ints(value, f"{what}: {field}", minimum=minimum)
    if len(dims) > MAX_NDIM:
        raise MetadataError(f"{what}: {field} has {len(dims)} dimensions; at most {MAX_NDIM} are supported")
    return dims


def optional_field(d: Mapping[str, Any], key: str, what: str, kind: type) -> Any:
    return get_field(d, key, what, kind) if d.get(key) is not None else None
