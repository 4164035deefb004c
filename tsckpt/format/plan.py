"""Array layout of a save: each tensor's path, chunk grid and inner chunks, from the regions written.
DCP saves and conversions both plan through :func:`plan_tensor`, so they lay out a tensor alike."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from ..errors import PlanError
from . import dtypes, grid, inner_chunks
from .metadata import Placement, TensorEntry
from .names import KeyPath, zarr_path

#: The smallest inner chunk (sharding codec) a writer cuts by default: below it,
#: TensorStore's cost per inner chunk outweighs the bytes a finer cut saves.
DEFAULT_INNER_CHUNK_BYTES = 16 << 10
#: The largest inner chunk: a partial read never fetches more than this per piece.
MAX_INNER_CHUNK_BYTES = 16 << 20


def plan_tensor(fqn: str, key_path: KeyPath, shape: Sequence[int], dtype: str, boxes: Sequence[grid.Box] | np.ndarray,
                *, inner_chunk_bytes: int = DEFAULT_INNER_CHUNK_BYTES, placement: Placement | None = None,
                bands: bool = False) -> TensorEntry:
    """The array of one tensor written as ``boxes`` (the ranks' ``(offsets, sizes)``, or an int array
    ``(len(boxes), 2, ndim)``): checked to tile ``shape``, chunks aligned to them. ``dtype``: a Zarr data type
    name; ``bands``: outer chunks cut into bands (:func:`~tsckpt.format.inner_chunks.choose`)."""
    dt = dtypes.from_zarr(dtype)
    shape = tuple(shape)
    if len(boxes) > grid.FEW_BOXES:  # converted once for both checks below
        boxes = np.asarray(boxes, dtype=np.int64).reshape(len(boxes), 2, len(shape))
    grid.check_tiling(fqn, shape, boxes)
    chunk, inner = inner_chunks.choose(shape, grid.aligned_chunk_shape(shape, boxes), dt.itemsize,
                                       min_bytes=inner_chunk_bytes, max_bytes=MAX_INNER_CHUNK_BYTES, bands=bands)
    return TensorEntry(key_path=tuple(key_path), path=zarr_path(key_path), shape=shape, dtype=dt.zarr,
                       chunk_shape=chunk, inner_chunk_shape=inner, placement=placement)


def check_unique_paths(paths: Iterable[str], where: str) -> None:
    """Refuse two state-dict keys whose key paths escape to the same array path."""
    seen: set[str] = set()
    for path in paths:
        if path in seen:
            raise PlanError(f"two state-dict keys map to the same array path {path!r} in {where}")
        seen.add(path)
