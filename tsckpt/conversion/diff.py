"""Compare two checkpoints of any supported formats, key by key and bit by bit.

Both sides stream through :mod:`tsckpt.conversion.sources`: one tensor of each
checkpoint is in memory at a time, so checkpoints larger than RAM compare.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import ConversionError, OptionError
from ..format.names import flat_key
from ..progress import progress_bar
from .sources import Source, TensorInfo, open_source

#: Elements compared per step, so diffing a huge tensor needs little extra memory.
_DIFF_BLOCK = 1 << 22


@dataclass(frozen=True)
class EntryDiff:
    """How one key compares between two checkpoints.

    ``status`` is one of ``equal`` (bit-identical), ``close`` (same shape and
    dtype, different bits, every element within the tolerances), ``values``
    (same shape and dtype, different values), ``shape``, ``dtype``, ``kind``
    (tensor on one side, value on the other), ``only_a`` or ``only_b``.
    ``value_a`` / ``value_b`` are the ``repr`` of plain (non-tensor) values.
    """

    key: str
    status: str
    kind: str  # "tensor" or "object"
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    dtype_a: str | None = None
    dtype_b: str | None = None
    max_abs_diff: float | None = None
    value_a: str | None = None
    value_b: str | None = None

    @property
    def equal(self) -> bool:
        return self.status == "equal"

    @property
    def matches(self) -> bool:
        """Equal, or within the tolerances the diff was asked for."""
        return self.status in ("equal", "close")


@dataclass(frozen=True)
class DiffResult:
    """Every key of two checkpoints compared; ``identical`` when all are equal."""

    a: str
    b: str
    format_a: str
    format_b: str
    entries: tuple[EntryDiff, ...] = field(default_factory=tuple)

    @property
    def identical(self) -> bool:
        return all(e.equal for e in self.entries)

    @property
    def differences(self) -> tuple[EntryDiff, ...]:
        """Entries that differ beyond the tolerances (``close`` ones are not differences)."""
        return tuple(e for e in self.entries if not e.matches)


def diff(a: Any, b: Any, *, trust_pickle: bool = False, progress: bool = False,
         rtol: float = 0.0, atol: float = 0.0) -> DiffResult:
    """Compare two checkpoints of any supported formats, key by key.

    Keys are matched by their flat (dotted) names, so a nested tsckpt or DCP
    checkpoint compares against the safetensors file made from it. Tensors are
    equal only when bit-identical (NaNs with the same bits are equal); for a
    numeric difference the largest absolute difference is reported. With
    ``rtol`` or ``atol``, tensors of the same shape and dtype whose every
    element satisfies ``|a - b| <= atol + rtol * |b|`` (NaN where both are
    NaN) are ``close``, which :attr:`DiffResult.differences` does not count.
    """
    if not (rtol >= 0 and atol >= 0):
        raise OptionError(f"diff: rtol and atol must be non-negative numbers, got rtol={rtol!r}, atol={atol!r}")
    with open_source(a, trust_pickle=trust_pickle) as sa, open_source(b, trust_pickle=trust_pickle) as sb:
        ta = {flat_key(i.key_path): k for k, i in sa.tensors.items()}
        tb = {flat_key(i.key_path): k for k, i in sb.tensors.items()}
        oa = {flat_key(p): v for p, v in sa.objects.values()}
        ob = {flat_key(p): v for p, v in sb.objects.values()}
        keys = list(dict.fromkeys([*ta, *oa, *tb, *ob]))
        total = sum(sa.tensors[ta[k]].nbytes for k in ta if k in tb)
        entries = []
        with progress_bar(progress, total, "diff") as advance:
            for key in keys:
                if key in ta and key in tb:
                    entries.append(_diff_tensor(key, sa, ta[key], sb, tb[key], rtol, atol))
                    advance(sa.tensors[ta[key]].nbytes)
                elif key in oa and key in ob:
                    entries.append(EntryDiff(key, "equal" if _same_value(oa[key], ob[key], key) else "values", "object",
                                             value_a=_repr(oa, key), value_b=_repr(ob, key)))
                elif (key in ta or key in oa) and (key in tb or key in ob):
                    entries.append(EntryDiff(key, "kind", "tensor" if key in ta else "object",
                                             value_a=_repr(oa, key), value_b=_repr(ob, key)))
                else:
                    entries.append(_one_sided(key, "only_a" if key in ta or key in oa else "only_b",
                                              sa.tensors.get(ta.get(key, "")) or sb.tensors.get(tb.get(key, "")),
                                              _repr(oa, key) or _repr(ob, key)))
        return DiffResult(str(a), str(b), sa.format, sb.format, tuple(entries))


def _one_sided(key: str, status: str, info: TensorInfo | None, value: str | None) -> EntryDiff:
    side = status[-1]  # only_a, only_b
    if info is None:
        return EntryDiff(key, status, "object", **{f"value_{side}": value})
    return EntryDiff(key, status, "tensor", **{f"shape_{side}": info.shape, f"dtype_{side}": _name(info.dtype)})


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _repr(values: Mapping[str, Any], key: str) -> str | None:
    return repr(values[key]) if key in values else None


def _diff_tensor(key: str, sa: Source, ka: str, sb: Source, kb: str, rtol: float, atol: float) -> EntryDiff:
    """One pass over both tensors, a block at a time: blocks with the same bits are skipped, the others
    checked against the tolerances and their largest |a - b| taken (NaN where only one side is NaN)."""
    ia, ib = sa.tensors[ka], sb.tensors[kb]
    meta = dict(kind="tensor", shape_a=ia.shape, shape_b=ib.shape, dtype_a=_name(ia.dtype), dtype_b=_name(ib.dtype))
    if ia.shape != ib.shape:
        return EntryDiff(key, "shape", **meta)  # type: ignore[arg-type]
    x, y = sa.read(ka).reshape(-1), sb.read(kb).reshape(-1)
    wide = torch.complex128 if (x.dtype.is_complex or y.dtype.is_complex) else torch.float64
    bits_equal, within, worst = ia.dtype == ib.dtype, bool(rtol or atol), 0.0
    for i in range(0, x.numel(), _DIFF_BLOCK):
        u, v = x[i:i + _DIFF_BLOCK], y[i:i + _DIFF_BLOCK]
        if bits_equal and torch.equal(_bits(u), _bits(v)):
            continue
        bits_equal = False
        u, v = u.to(wide), v.to(wide)
        within = within and bool(torch.isclose(u, v, rtol=rtol, atol=atol, equal_nan=True).all())
        same = (u == v) | (torch.isnan(u) & torch.isnan(v))
        m = float(torch.where(same, torch.zeros((), dtype=torch.float64), (u - v).abs()).max())
        worst = m if math.isnan(m) or math.isnan(worst) else max(worst, m)
    status = "equal" if bits_equal else ("values" if ia.dtype == ib.dtype else "dtype")
    if status == "values" and within:
        status = "close"
    return EntryDiff(key, status, max_abs_diff=worst, **meta)  # type: ignore[arg-type]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.bool else t


def _same_value(x: Any, y: Any, key: str) -> bool:
    """Whether two plain values are equal: by content for tensors, arrays and containers of them.

    A comparison that fails is an error, not a difference: "values" would
    claim the checkpoints differ where nothing says they do.
    """
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype and \
            x.shape == y.shape and (torch.equal(x, y) or torch.equal(_bits(x.reshape(-1).contiguous()),
                                                                   _bits(y.reshape(-1).contiguous())))
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        return isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and x.dtype == y.dtype and \
            x.shape == y.shape and (x.dtype.hasobject and _same_value(x.tolist(), y.tolist(), key)
                                    or not x.dtype.hasobject and x.tobytes() == y.tobytes())
    if type(x) is not type(y):
        return False
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_same_value(u, v, key) for u, v in zip(x, y))
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_same_value(x[k], y[k], key) for k in x)
    if isinstance(x, float) and math.isnan(x):
        return math.isnan(y)  # a NaN loss saved twice is the same value
    try:
        return bool(x == y)
    except Exception as e:  # noqa: BLE001 - a value's own __eq__ may raise anything
        raise ConversionError(f"diff: cannot compare the values of {key!r} ({type(x).__name__}): "
                          f"{type(e).__name__}: {e}") from None
