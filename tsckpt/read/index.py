"""numpy-style indices of a stored tensor: checked, made non-negative, and parsed from text."""

from __future__ import annotations

import re
from types import EllipsisType
from typing import Any

import numpy as np

from ..errors import TsckptError

Index = int | slice | EllipsisType | tuple[int | slice | EllipsisType, ...]


class SelectionError(TsckptError, IndexError):
    """A slice that does not fit the tensor's shape (also an ``IndexError``)."""


def normalize_index(index: Index, shape: tuple[int, ...], key: str = "") -> tuple[int | slice, ...]:
    """numpy-style ``index`` as non-negative, in-range ints and slices (TensorStore reads negative coordinates
    literally, so numpy's "count from the end" is resolved here)."""
    items = index if isinstance(index, tuple) else (index,)
    if sum(i is Ellipsis for i in items) > 1:
        raise SelectionError(f"tensor {key!r}: an index can only have one '...'")
    if Ellipsis in items:
        at = next(n for n, i in enumerate(items) if i is Ellipsis)
        fill = len(shape) - (len(items) - 1)
        items = items[:at] + (slice(None),) * max(fill, 0) + items[at + 1:]
    if len(items) > len(shape):
        raise SelectionError(f"tensor {key!r}: {len(items)} indices for a tensor of shape {list(shape)}")
    out: list[int | slice] = []
    for dim, (item, n) in enumerate(zip(items, shape)):
        if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            i = int(item) + n if item < 0 else int(item)
            if not 0 <= i < n:
                raise SelectionError(f"tensor {key!r}: index {item} is out of range for dim {dim} of size {n}")
            out.append(i)
        elif isinstance(item, slice):
            start, stop, step = item.indices(n)
            if step <= 0:
                raise SelectionError(f"tensor {key!r}: slice steps must be positive (dim {dim}), as in torch")
            out.append(slice(start, max(start, stop), step))
        else:
            raise SelectionError(f"tensor {key!r}: unsupported index {item!r} (ints, slices and ... only)")
    return tuple(out)


def parse_index(text: str) -> tuple[int | slice, ...]:
    """``"0:4,2"`` -> ``(slice(0, 4), 2)``; the command-line form of an index."""
    out: list[Any] = []
    for part in (p.strip() for p in text.split(",")):
        if part in ("...", "…"):
            out.append(Ellipsis)
        elif ":" in part:
            bits = part.split(":")
            if len(bits) > 3 or not all(re.fullmatch(r"-?\d*", b.strip()) for b in bits):
                raise SelectionError(f"cannot parse {part!r} in index {text!r}: expected start:stop[:step]")
            out.append(slice(*(int(b) if b.strip() else None for b in bits)))
        elif re.fullmatch(r"-?\d+", part):
            out.append(int(part))
        else:
            raise SelectionError(f"cannot parse {part!r} in index {text!r}: expected an integer or start:stop")
    return tuple(out)


def bounding_box(index: tuple[int | slice, ...], shape: tuple[int, ...]) -> tuple[tuple[slice, ...], tuple[int | slice, ...]]:
    """A normalized index as the unit-step box it reads (so every chunk it covers is checked against its
    checksum before integers drop dimensions and steps skip elements), and the selection to apply to it."""
    full = index + tuple(slice(0, n, 1) for n in shape[len(index):])
    box = tuple(slice(i, i + 1) if isinstance(i, int) else slice(i.start, i.stop) for i in full)
    rest = tuple(0 if isinstance(i, int) else slice(None, None, i.step) for i in full)
    return box, rest
