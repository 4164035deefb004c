"""zarr-python data types for bfloat16 and the float8 formats, backed by ml_dtypes.

TensorStore writes these types, for which zarr-python ships none. They are declared as zarr's
``zarr.data_type`` entry points; zarr-python 3.1 lists but never loads those, so ``import tsckpt`` also
registers them (:func:`register`) where zarr has none of those names yet. Two-byte types carry an
endianness (zarr's ``HasEndianness``); one-byte types none, as the ``bytes`` codec must not declare one."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self

import ml_dtypes
import numpy as np
from zarr.core.dtype.common import HasEndianness
from zarr.dtype import ZDType

try:  # zarr >= 3.3; importing it from zarr.dtype still works there, with a deprecation warning
    from zarr.errors import DataTypeValidationError
except ImportError:  # zarr 3.1 and 3.2
    from zarr.dtype import DataTypeValidationError

ZarrFormat = Literal[2, 3]

#: numpy's byte-order characters, as Zarr names them ("=": this machine's).
_BYTE_ORDERS = {"<": "little", ">": "big", "=": sys.byteorder, "|": sys.byteorder}


def _native(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name))


def _float_from_json(data: Any) -> float | None:
    """A JSON number or numeric string (Zarr's ``"NaN"``, ``"Infinity"`` included) as a float, else None."""
    if isinstance(data, bool) or not isinstance(data, (int, float, str)):
        return None
    try:
        return float(data)
    except ValueError:
        return None


@dataclass(frozen=True, kw_only=True)
class _MLFloat(ZDType[np.dtype, np.generic]):
    """Everything an ml_dtypes float needs; :func:`_ml_float`'s classes only name the type. Scalars travel as JSON
    numbers, ``"NaN"``/``"Infinity"``/``"-Infinity"``, or a ``"0x.."`` hex string of the raw bits (Zarr v3's
    rule for floats; the only exact form for e8m0's unusual NaN)."""

    _zarr_v3_name: ClassVar[str]

    @classmethod
    def _scalar_type(cls) -> type[np.generic]:
        return getattr(ml_dtypes, cls._zarr_v3_name)

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
    def _from_json_v2(cls, data: Any) -> Self:
        # Zarr v2 has no name for these types; say "not me" so matching moves on.
        raise DataTypeValidationError(f"{cls._zarr_v3_name} has no Zarr v2 representation")

    @classmethod
    def _from_json_v3(cls, data: Any) -> Self:
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
        return isinstance(data, str) and _float_from_json(data) is not None

    def cast_scalar(self, data: object) -> np.generic:
        if not self._check_scalar(data):
            raise TypeError(f"Cannot convert {data!r} ({type(data).__name__}) to a {self._zarr_v3_name} scalar")
        return self.to_native_dtype().type(float(data))  # type: ignore[arg-type]

    def default_scalar(self) -> np.generic:
        return self.to_native_dtype().type(0)

    def from_json_scalar(self, data: Any, *, zarr_format: ZarrFormat) -> np.generic:
        if isinstance(data, str) and data.startswith("0x"):
            return self._from_hex(data)
        value = _float_from_json(data)
        if value is not None:
            return self.to_native_dtype().type(value)
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
        if math.isinf(as_float):
            return "Infinity" if as_float > 0 else "-Infinity"
        return as_float


@dataclass(frozen=True, kw_only=True)
class _TwoByteFloat(_MLFloat, HasEndianness):
    """A two-byte type: the ``bytes`` codec picks its byte order."""

    @classmethod
    def _from_checked_native(cls, dtype: np.dtype) -> Self:
        return cls(endianness=_BYTE_ORDERS[dtype.byteorder])  # type: ignore[arg-type]

    def to_native_dtype(self) -> np.dtype:
        return _native(self._zarr_v3_name).newbyteorder("<" if self.endianness == "little" else ">")


def _ml_float(class_name: str, zarr_name: str) -> type[_MLFloat]:
    """The class of one ml_dtypes float, named for its entry point (``tsckpt.format.zarr_dtypes:BFloat16``)."""
    native = _native(zarr_name)
    base = _TwoByteFloat if native.itemsize > 1 else _MLFloat
    return type(class_name, (base,), {
        "__module__": __name__, "__qualname__": class_name,
        "__doc__": f"``torch.{zarr_name}``, as ``ml_dtypes.{zarr_name}``.",
        "_zarr_v3_name": zarr_name, "dtype_cls": type(native),
    })


BFloat16 = _ml_float("BFloat16", "bfloat16")
Float8E4M3FN = _ml_float("Float8E4M3FN", "float8_e4m3fn")
Float8E5M2 = _ml_float("Float8E5M2", "float8_e5m2")
Float8E4M3FNUZ = _ml_float("Float8E4M3FNUZ", "float8_e4m3fnuz")
Float8E5M2FNUZ = _ml_float("Float8E5M2FNUZ", "float8_e5m2fnuz")
#: Exponent only: no zero, and a NaN that only a hex fill value names exactly.
Float8E8M0FNU = _ml_float("Float8E8M0FNU", "float8_e8m0fnu")

DATA_TYPES: tuple[type[_MLFloat], ...] = (
    BFloat16, Float8E4M3FN, Float8E5M2, Float8E4M3FNUZ, Float8E5M2FNUZ, Float8E8M0FNU,
)


def register() -> None:
    """Register every type here with zarr-python's data-type registry, where no type has its name yet."""
    from zarr.dtype import data_type_registry

    for cls in DATA_TYPES:
        try:
            data_type_registry.get(cls._zarr_v3_name)
        except KeyError:
            data_type_registry.register(cls._zarr_v3_name, cls)


__all__ = [cls.__name__ for cls in DATA_TYPES] + ["DATA_TYPES", "register"]
