"""zarr-python data types for bfloat16 and the float8 formats, backed by ml_dtypes.

TensorStore writes these types under the names ``bfloat16``, ``float8_e4m3fn``...
but zarr-python ships no data type for them and refuses such arrays. The
classes here fill that gap; they are registered through the ``zarr.data_type``
entry-point group, so installing tsckpt is enough for ``zarr.open_group`` to
read a checkpoint's bf16 and float8 arrays as ml_dtypes arrays once zarr loads
its entry points, which zarr-python does from 3.4.1 on. Releases 3.1 to 3.4.0
list them but never load them and fail with "No Zarr data type found that
matches 'bfloat16'", so importing this module also registers the types:
``import tsckpt`` (or this module) before ``zarr.open_group`` works with every
supported zarr release.

Two-byte types carry an endianness like zarr's own floats; one-byte types
carry none, because the ``bytes`` codec must not declare one for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self, TypeGuard

import ml_dtypes
import numpy as np
from zarr.core.dtype.common import DTypeJSON, HasEndianness, HasItemSize
from zarr.core.dtype.npy.common import (
    check_json_float_v3,
    check_json_floatish_str,
    endianness_to_numpy_str,
    float_from_json_v3,
    float_to_json_v3,
    get_endianness_from_numpy_dtype,
)
from zarr.core.dtype.wrapper import ZDType

try:  # zarr >= 3.3; the old home still works in 3.4 but warns
    from zarr.errors import DataTypeValidationError
except ImportError:  # zarr 3.1 and 3.2
    from zarr.core.dtype.common import DataTypeValidationError

ZarrFormat = Literal[2, 3]


def _native(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name))


@dataclass(frozen=True, kw_only=True)
class _MLFloat(ZDType[np.dtype, np.generic], HasItemSize):
    """Everything an ml_dtypes float needs; subclasses only name the type.

    Scalars travel as JSON numbers, ``"NaN"``/``"Infinity"``/``"-Infinity"``, or
    a ``"0x.."`` hex string of the raw bits (the Zarr v3 rule for floats), which
    is the only exact form for types whose zero or NaN is unusual (e8m0).
    """

    _zarr_v3_name: ClassVar[str]

    @classmethod
    def _scalar_type(cls) -> type[np.generic]:
        return getattr(ml_dtypes, cls._zarr_v3_name)

    @classmethod
    def _check_native_dtype(cls, dtype: Any) -> TypeGuard[np.dtype]:
        return isinstance(dtype, np.dtype) and dtype.type is cls._scalar_type()

    @classmethod
    def from_native_dtype(cls, dtype: Any) -> Self:
        if not cls._check_native_dtype(dtype):
            raise DataTypeValidationError(f"Invalid data type: {dtype}. Expected {cls._zarr_v3_name}")
        return cls._from_checked_native(dtype)

    @classmethod
    def _from_checked_native(cls, dtype: np.dtype) -> Self:
        return cls()

    def to_native_dtype(self) -> np.dtype:
        return _native(self._zarr_v3_name)

    @classmethod
    def _from_json_v2(cls, data: DTypeJSON) -> Self:
        # Zarr v2 has no name for these types; say "not me" so matching moves on.
        raise DataTypeValidationError(f"{cls._zarr_v3_name} has no Zarr v2 representation")

    @classmethod
    def _from_json_v3(cls, data: DTypeJSON) -> Self:
        if data == cls._zarr_v3_name:
            return cls()
        raise DataTypeValidationError(f"Invalid JSON representation of {cls.__name__}: {data!r}")

    def to_json(self, zarr_format: ZarrFormat) -> Any:
        if zarr_format == 3:
            return self._zarr_v3_name
        raise ValueError(f"{self._zarr_v3_name} can only be stored in Zarr format 3, not {zarr_format}")

    @property
    def item_size(self) -> int:
        return self.to_native_dtype().itemsize

    def _check_scalar(self, data: object) -> bool:
        if isinstance(data, (int, float, np.integer, np.floating)):
            return True
        if isinstance(data, np.generic) and data.dtype.type is self._scalar_type():
            return True
        return isinstance(data, str) and check_json_floatish_str(data)

    def cast_scalar(self, data: object) -> np.generic:
        if not self._check_scalar(data):
            raise TypeError(f"Cannot convert {data!r} ({type(data).__name__}) to a {self._zarr_v3_name} scalar")
        return self.to_native_dtype().type(float(data))  # type: ignore[arg-type]

    def default_scalar(self) -> np.generic:
        return self.to_native_dtype().type(0)

    def from_json_scalar(self, data: Any, *, zarr_format: ZarrFormat) -> np.generic:
        if isinstance(data, str) and data.startswith("0x"):
            return self._from_hex(data)
        if check_json_float_v3(data):
            return self.to_native_dtype().type(float_from_json_v3(data))  # type: ignore[arg-type]
        if check_json_floatish_str(data):
            return self.to_native_dtype().type(float(data))
        raise TypeError(f"Invalid {self._zarr_v3_name} fill value {data!r}: expected a number, "
                        "'NaN', 'Infinity', '-Infinity' or a '0x' hex string")

    def _from_hex(self, data: str) -> np.generic:
        dtype = self.to_native_dtype()
        raw = bytes.fromhex(data[2:])
        if len(raw) != dtype.itemsize:
            raise TypeError(f"Invalid {self._zarr_v3_name} fill value {data!r}: expected {dtype.itemsize} bytes")
        # Hex fill values are big-endian bit patterns.
        return np.frombuffer(raw[::-1], dtype=dtype.newbyteorder("<"))[0].astype(dtype)

    def to_json_scalar(self, data: object, *, zarr_format: ZarrFormat) -> Any:
        value = self.cast_scalar(data)
        as_float = float(value)
        if np.isnan(as_float) or self.to_native_dtype().type(as_float).tobytes() != value.tobytes():
            # NaN payloads and values float() cannot carry: keep the exact bits.
            bits = value.astype(self.to_native_dtype().newbyteorder("<")).tobytes()[::-1]
            return "0x" + bits.hex()
        return float_to_json_v3(as_float)


@dataclass(frozen=True, kw_only=True)
class _TwoByteFloat(_MLFloat, HasEndianness):
    """A two-byte type: the ``bytes`` codec picks its byte order."""

    @classmethod
    def _from_checked_native(cls, dtype: np.dtype) -> Self:
        return cls(endianness=get_endianness_from_numpy_dtype(dtype))

    def to_native_dtype(self) -> np.dtype:
        return _native(self._zarr_v3_name).newbyteorder(endianness_to_numpy_str(self.endianness))


@dataclass(frozen=True, kw_only=True)
class BFloat16(_TwoByteFloat):
    """bfloat16 (``torch.bfloat16``), as ``ml_dtypes.bfloat16``."""

    _zarr_v3_name: ClassVar[str] = "bfloat16"


@dataclass(frozen=True, kw_only=True)
class Float8E4M3FN(_MLFloat):
    """``torch.float8_e4m3fn``, as ``ml_dtypes.float8_e4m3fn``."""

    _zarr_v3_name: ClassVar[str] = "float8_e4m3fn"


@dataclass(frozen=True, kw_only=True)
class Float8E5M2(_MLFloat):
    """``torch.float8_e5m2``, as ``ml_dtypes.float8_e5m2``."""

    _zarr_v3_name: ClassVar[str] = "float8_e5m2"


@dataclass(frozen=True, kw_only=True)
class Float8E4M3FNUZ(_MLFloat):
    """``torch.float8_e4m3fnuz``, as ``ml_dtypes.float8_e4m3fnuz``."""

    _zarr_v3_name: ClassVar[str] = "float8_e4m3fnuz"


@dataclass(frozen=True, kw_only=True)
class Float8E5M2FNUZ(_MLFloat):
    """``torch.float8_e5m2fnuz``, as ``ml_dtypes.float8_e5m2fnuz``."""

    _zarr_v3_name: ClassVar[str] = "float8_e5m2fnuz"


@dataclass(frozen=True, kw_only=True)
class Float8E8M0FNU(_MLFloat):
    """``torch.float8_e8m0fnu`` (exponent only, no zero), as ``ml_dtypes.float8_e8m0fnu``."""

    _zarr_v3_name: ClassVar[str] = "float8_e8m0fnu"


DATA_TYPES: tuple[type[_MLFloat], ...] = (
    BFloat16, Float8E4M3FN, Float8E5M2, Float8E4M3FNUZ, Float8E5M2FNUZ, Float8E8M0FNU,
)


def register() -> None:
    """Register every type here with zarr-python (idempotent; the entry points do this on install)."""
    from zarr.core.dtype import data_type_registry

    for cls in DATA_TYPES:
        data_type_registry.register(cls._zarr_v3_name, cls)


__all__ = [cls.__name__ for cls in DATA_TYPES] + ["DATA_TYPES", "register"]


# zarr-python before 3.4.1 collects the ``zarr.data_type`` entry points but only
# registers them when ``data_type_registry._lazy_load()`` is called, which its
# own read path never does; importing this module is the dependable way.
register()
