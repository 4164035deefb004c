"""Chunk grids: from the regions ranks write to a Zarr grid they can write alone.

Pure functions of shapes and boxes; nothing here touches storage or torch.

Outer chunks ("shards" in Zarr's sharding codec) are aligned to every region
boundary, so each outer chunk lies inside exactly one rank's region and no two
ranks ever write the same file. Zarr grids are regular, so along each dimension
the chunk size is the gcd of the interior boundaries: for torch.chunk-style
splits (FSDP2, Shard(d)) that is the shard size itself, ceil(n / k); irregular
splits (nested Shard(0)+Shard(0), hand-made ShardedTensor specs) get a finer grid
and a rank writes several chunks.

Inner chunks subdivide a large outer chunk so that reading a slice, e.g. a
column block while the checkpoint was saved row-sharded, reads only what it
needs instead of whole shards. :class:`ChunkGrid` is the one place that walks a
grid's chunks (verification, slicing, plotting).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import PlanError

Box = tuple[Sequence[int], Sequence[int]]  # (offsets, sizes)


def check_tiling(name: str, shape: Sequence[int], boxes: Sequence[Box]) -> None:
    """Raise unless the non-empty boxes lie inside ``shape`` and cover it exactly once."""
    nonempty = [(tuple(o), tuple(s)) for o, s in boxes if math.prod(s) > 0]
    for o, s in nonempty:
        if len(o) != len(shape) or len(s) != len(shape) or any(
            oi < 0 or oi + si > n for oi, si, n in zip(o, s, shape)
        ):
            raise PlanError(f"tensor {name!r}: region offsets={list(o)} sizes={list(s)} "
                            f"falls outside its shape {list(shape)}")
    if len(set(nonempty)) != len(nonempty) or sum(math.prod(s) for _, s in nonempty) != math.prod(shape):
        raise PlanError(f"tensor {name!r}: the saved regions do not cover shape {list(shape)} "
                        f"exactly once ({len(nonempty)} regions, duplicates or gaps)")
    for i, (o1, s1) in enumerate(nonempty):
        for o2, s2 in nonempty[i + 1:]:
            if all(a < b + sb and b < a + sa for a, sa, b, sb in zip(o1, s1, o2, s2)):
                raise PlanError(f"tensor {name!r}: regions at {list(o1)} and {list(o2)} overlap")


def aligned_chunk_shape(shape: Sequence[int], boxes: Sequence[Box]) -> tuple[int, ...]:
    """The largest regular chunk shape whose boundaries include every box boundary."""
    chunk = []
    for d, n in enumerate(shape):
        interior = {
            edge
            for o, s in boxes
            if math.prod(s) > 0
            for edge in (o[d], o[d] + s[d])
            if 0 < edge < n
        }
        chunk.append(math.gcd(*interior) if interior else max(n, 1))
    return tuple(chunk)


def inner_chunk_shape(chunk: Sequence[int], itemsize: int, target_bytes: int) -> tuple[int, ...] | None:
    """Subdivide ``chunk`` into inner chunks of at most about ``target_bytes``.

    Returns None when the chunk is small enough to stay one piece. Inner sizes
    must divide the chunk, so the largest dimension is split by its smallest
    prime factor until the target is met; this keeps inner chunks roughly
    square, which serves row and column reads alike. A dimension whose size
    only has large prime factors is left whole rather than cut into slivers.
    """
    if target_bytes <= 0 or math.prod(chunk) * itemsize <= target_bytes:
        return None
    inner = list(chunk)
    while math.prod(inner) * itemsize > target_bytes:
        candidates = [d for d in range(len(inner)) if 1 < _smallest_prime_factor(inner[d]) <= 16]
        if not candidates:
            break
        d = max(candidates, key=lambda i: inner[i])
        inner[d] //= _smallest_prime_factor(inner[d])
    return tuple(inner)


def _smallest_prime_factor(n: int) -> int:
    for p in range(2, math.isqrt(n) + 1):
        if n % p == 0:
            return p
    return n


@dataclass(frozen=True)
class ChunkGrid:
    """How a tensor's array is cut into files (chunks) and, inside them, inner chunks."""

    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    inner_chunk_shape: tuple[int, ...] | None = None

    @property
    def grid_shape(self) -> tuple[int, ...]:
        """Number of chunks along each dimension."""
        return tuple(-(-n // c) for n, c in zip(self.shape, self.chunk_shape))

    @property
    def nchunks(self) -> int:
        return math.prod(self.grid_shape)

    @property
    def read_unit(self) -> tuple[int, ...]:
        """The smallest box a read fetches: the inner chunk when there is one."""
        return self.inner_chunk_shape or self.chunk_shape

    def indices(self) -> Iterator[tuple[int, ...]]:
        """Every chunk's grid index, in row-major order (none for an empty tensor, ``()`` for a 0-d one)."""
        return itertools.product(*(range(g) for g in self.grid_shape))

    def chunk_region(self, index: Sequence[int]) -> tuple[slice, ...]:
        """The box of the tensor held by chunk ``index`` (clipped at the edges)."""
        return tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(index, self.chunk_shape, self.shape))

    def chunks_overlapping(self, region: Sequence[slice]) -> list[tuple[int, ...]]:
        """Indices of the chunks that a box of unit-step slices touches."""
        ranges = [range(s.start // c, (s.stop - 1) // c + 1) if s.stop > s.start else range(0)
                  for s, c in zip(region, self.chunk_shape)]
        return list(itertools.product(*ranges))

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "chunk_shape": list(self.chunk_shape),
                "inner_chunk_shape": list(self.inner_chunk_shape) if self.inner_chunk_shape else None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ChunkGrid:
        inner = d.get("inner_chunk_shape")
        return cls(tuple(d["shape"]), tuple(d["chunk_shape"]), tuple(inner) if inner else None)
