"""Data types: the one table mapping torch dtypes to Zarr v3 names (TensorStore's: ``bfloat16``,
``float8_e4m3fn``...) and numpy (ml_dtypes for the types numpy lacks). Torch is imported lazily."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

from ..errors import UnsupportedDtypeError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DType:
    """One storable element type, as torch, Zarr and numpy each name it."""

    zarr: str
    torch: str
    numpy: np.dtype
    #: numpy cannot convert this torch dtype itself: go through a same-width int view.
    via_int: bool = False

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize

    @property
    def fill_value(self) -> Any:
        if self.zarr == "bool":
            return False
        if self.zarr.startswith("complex"):
            return [0.0, 0.0]
        return 0


BY_ZARR: dict[str, DType] = {n: DType(n, n, np.dtype(n)) for n in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128")} | {
    n: DType(n, n, np.dtype(getattr(ml_dtypes, n)), via_int=True) for n in (
        "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")}
BY_TORCH_NAME: dict[str, DType] = {d.torch: d for d in BY_ZARR.values()}
_INT_OF_WIDTH = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


def from_zarr(name: str) -> DType:
    """Look up a Zarr data type name, e.g. ``"bfloat16"``."""
    try:
        return BY_ZARR[name]
    except (KeyError, TypeError):
        raise UnsupportedDtypeError(f"unknown data type {name!r}; expected one of {sorted(BY_ZARR)}") from None


def torch_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def from_torch(dtype: torch.dtype) -> DType:
    """Look up a torch dtype; raises for dtypes Zarr cannot hold (complex32, quantized...)."""
    return from_torch_name(torch_name(dtype))


def from_torch_name(name: str) -> DType:
    """Look up a torch dtype by :func:`torch_name`, e.g. ``"bfloat16"``."""
    try:
        return BY_TORCH_NAME[name]
    except (KeyError, TypeError):
        raise UnsupportedDtypeError(f"torch dtype torch.{name} cannot be stored; "
                                    f"supported: {sorted(BY_TORCH_NAME)}") from None


def to_torch_dtype(dt: DType) -> torch.dtype:
    import torch

    return getattr(torch, dt.torch)


def tensor_as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view sharing ``tensor``'s memory (CPU tensors only), any strides."""
    import torch

    dt = from_torch(tensor.dtype)
    if not dt.via_int:
        return tensor.numpy()
    as_int = getattr(torch, _INT_OF_WIDTH[dt.itemsize])
    return tensor.view(as_int).numpy().view(dt.numpy)


def numpy_as_tensor(array: np.ndarray) -> torch.Tensor:
    """A torch tensor sharing ``array``'s memory, for every dtype in the table."""
    import torch

    dt = BY_ZARR.get(array.dtype.name)
    if dt is None:
        raise UnsupportedDtypeError(f"numpy dtype {array.dtype} has no torch equivalent here")
    if not dt.via_int:
        return torch.from_numpy(array)
    ints = array.view(np.dtype(_INT_OF_WIDTH[dt.itemsize]))
    return torch.from_numpy(ints).view(to_torch_dtype(dt))
