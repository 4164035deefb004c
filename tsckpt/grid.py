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
needs instead of whole shards.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .errors import PlanError

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


def chunk_count(shape: Sequence[int], chunk: Sequence[int]) -> int:
    return math.prod(-(-n // c) for n, c in zip(shape, chunk))


def chunks_in(offsets: Sequence[int], sizes: Sequence[int], chunk: Sequence[int]) -> list[tuple[int, ...]]:
    """Grid indices of the chunks that a (chunk-aligned) box covers."""
    ranges = [range(o // c, -(-(o + s) // c)) for o, s, c in zip(offsets, sizes, chunk)]
    out: list[tuple[int, ...]] = [()]
    for r in ranges:
        out = [idx + (i,) for idx in out for i in r]
    return out if math.prod(sizes) > 0 else []
