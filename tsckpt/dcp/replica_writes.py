"""Replicated tensors written by all their replicas: the coordinator spreads each replica group's bytes evenly.

DCP gives each replicated item whole to the plan with the fewest bytes so far, and forgets who else held it.
So each rank's writer attaches its :class:`Holdings` to its local plan; ranks with equal holdings form a
replica group, and :func:`spread` cuts the group's large items into row pieces and gives them to the members
longest first, each to the least loaded (LPT). A piece keeps its item's ``index`` with the sub-box as its
chunk (:func:`piece_of`); chunks are aligned to the pieces (:mod:`tsckpt.format.plan`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem

from ..errors import PlanError
from ..format.inner_chunks import divisors

#: No piece is cut smaller than this: below it, a piece costs more in files and requests than it balances.
MIN_PIECE_BYTES = 1 << 20
#: Items above this fraction of a member's even share of the group's bytes are cut into pieces (greedy
#: assignment then ends within about this fraction of even).
PIECE_FRACTION = 1 / 8


@dataclass(frozen=True)
class Holdings:
    """What a rank's full local plan holds (``digest``: BLAKE2b of its sorted tensor boxes), wrapped around the
    planner's ``storage_data`` (``notes``). Ranks with equal holdings are replicas of each other."""

    digest: bytes
    nbytes: int
    notes: Any = None

    @classmethod
    def of(cls, plan: SavePlan) -> Holdings:
        boxes, total = [], 0
        for item in plan.items:
            td = item.tensor_data
            if td is not None:
                boxes.append((item.index.fqn, tuple(td.chunk.offsets), tuple(td.chunk.sizes), str(td.properties.dtype)))
                total += box_bytes(item)
        boxes.sort()
        return cls(hashlib.blake2b(repr(boxes).encode(), digest_size=16).digest(), total, plan.storage_data)

    @staticmethod
    def attached(plan: SavePlan) -> Holdings | None:
        data = plan.storage_data
        return data if isinstance(data, Holdings) else None

    @staticmethod
    def unwrapped(storage_data: Any) -> Any:
        return storage_data.notes if isinstance(storage_data, Holdings) else storage_data


def box_bytes(item: WriteItem) -> int:
    """Bytes of an item's box (DCP's ``tensor_storage_size`` counts the whole tensor's)."""
    td = item.tensor_data
    return 0 if td is None else math.prod(td.chunk.sizes) * td.properties.dtype.itemsize


def piece_of(data: torch.Tensor, item: WriteItem, where: str) -> torch.Tensor:
    """The part of ``data`` (the tensor ``item`` resolves to, at ``item.index.offset``) that ``item`` writes; a view."""
    chunk = item.tensor_data.chunk
    base = item.index.offset if item.index.offset is not None else (0,) * data.dim()
    start = [c - o for c, o in zip(chunk.offsets, base)]
    if len(start) != data.dim() or any(s < 0 or s + n > d for s, n, d in zip(start, chunk.sizes, data.shape)):
        raise PlanError(f"saving {where}: tensor {item.index.fqn!r}: the planned box offsets={list(chunk.offsets)} "
                        f"sizes={list(chunk.sizes)} does not lie inside this rank's data of shape "
                        f"{list(data.shape)} at {list(base)}")
    return data[tuple(slice(s, s + n) for s, n in zip(start, chunk.sizes))]


def spread(plans: Sequence[SavePlan]) -> list[SavePlan]:
    """Every rank's plan with each replica group's tensor items cut and balanced over the group."""
    groups: dict[tuple[bytes, int], list[int]] = {}
    for r, p in enumerate(plans):
        held = Holdings.attached(p)
        if held is not None and p.usable:
            groups.setdefault((held.digest, held.nbytes), []).append(r)
    replicas = [ranks for ranks in groups.values() if len(ranks) > 1]
    out = list(plans)
    if not replicas:
        return out
    wanted = [_pieces_wanted(plans, ranks) for ranks in replicas]
    counts: dict[str, int] = {}
    for per_item in wanted:
        for (fqn, _), m in per_item.items():
            counts[fqn] = max(counts.get(fqn, 0), m)
    steps = _row_steps(plans, counts)
    for ranks, per_item in zip(replicas, wanted):
        out_items = _assign(plans, ranks, per_item, steps)
        for r, items in zip(ranks, out_items):
            out[r] = dataclasses.replace(plans[r], items=items)
    return out


def _tensor_items(plans: Sequence[SavePlan], ranks: Sequence[int]) -> list[WriteItem]:
    return [item for r in ranks for item in plans[r].items if item.tensor_data is not None]


def _pieces_wanted(plans: Sequence[SavePlan], ranks: Sequence[int]) -> dict[tuple[str, int], int]:
    """How many pieces each large item of a replica group should become, by (key, position in the group's items)."""
    items = _tensor_items(plans, ranks)
    sizes = [box_bytes(item) for item in items]
    threshold = max(MIN_PIECE_BYTES, sum(sizes) / len(ranks) * PIECE_FRACTION)
    wanted = {}
    for i, (item, size) in enumerate(zip(items, sizes)):
        chunk = item.tensor_data.chunk
        if size <= threshold or not len(chunk.sizes):
            continue
        m = min(len(ranks), math.ceil(size / threshold), size // MIN_PIECE_BYTES, chunk.sizes[0])
        if m > 1:
            wanted[(item.index.fqn, i)] = m
    return wanted


def _row_steps(plans: Sequence[SavePlan], counts: dict[str, int]) -> dict[str, int]:
    """Rows per piece of each key to cut into ``counts[key]`` pieces, the same for every item of the key."""
    found: dict[str, list[int]] = {}  # key -> [gcd of the dim-0 boundaries strictly inside, most rows of an item]
    for p in plans:
        for item in p.items:
            fqn = item.index.fqn
            if fqn not in counts:
                continue
            td = item.tensor_data
            n, (lo, size) = td.size[0], (td.chunk.offsets[0], td.chunk.sizes[0])
            seen = found.setdefault(fqn, [0, 0])
            seen[1] = max(seen[1], size)
            for edge in (lo, lo + size) if size else ():
                if 0 < edge < n:
                    seen[0] = math.gcd(seen[0], edge)
    return {fqn: row_step(inner_gcd, rows, counts[fqn]) for fqn, (inner_gcd, rows) in found.items()}


def row_step(inner_gcd: int, rows: int, m: int) -> int:
    """Rows per piece when items of up to ``rows`` rows are cut into about ``m`` pieces: ``ceil(rows / m)`` with
    no region boundary inside dim 0 (``inner_gcd`` 0), else a multiple of the largest divisor of the boundaries'
    gcd that fits, so the chunk grid is cut no finer."""
    target = -(-rows // m)
    if not inner_gcd:
        return target
    unit = max(d for d in divisors(inner_gcd) if d <= target)
    units = -(-rows // unit)
    return -(-units // m) * unit


def _cut(item: WriteItem, step: int) -> list[WriteItem]:
    chunk = item.tensor_data.chunk
    lo, rows = chunk.offsets[0], chunk.sizes[0]
    pieces = []
    for start in range(0, rows, step):
        offsets = torch.Size((lo + start, *chunk.offsets[1:]))
        sizes = torch.Size((min(step, rows - start), *chunk.sizes[1:]))
        td = dataclasses.replace(item.tensor_data, chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes))
        pieces.append(dataclasses.replace(item, tensor_data=td))
    return pieces


def _assign(plans: Sequence[SavePlan], ranks: Sequence[int], wanted: dict[tuple[str, int], int],
            steps: dict[str, int]) -> list[list[WriteItem]]:
    """Each member's items: its non-tensor items, then the group's tensor items and pieces it was given (LPT)."""
    units: list[tuple[int, int, WriteItem]] = []  # (bytes, order, item)
    for i, item in enumerate(_tensor_items(plans, ranks)):
        for piece in _cut(item, steps[item.index.fqn]) if (item.index.fqn, i) in wanted else [item]:
            units.append((box_bytes(piece), len(units), piece))
    units.sort(key=lambda u: (-u[0], u[1]))
    loads = [(0, position) for position in range(len(ranks))]  # a heap of (bytes so far, member)
    given: list[list[tuple[int, WriteItem]]] = [[] for _ in ranks]
    for size, order, piece in units:
        load, position = heapq.heappop(loads)
        given[position].append((order, piece))
        heapq.heappush(loads, (load + size, position))
    out = []
    for r, mine in zip(ranks, given):
        mine.sort(key=lambda g: g[0])  # in the order the group listed them
        out.append([item for item in plans[r].items if item.tensor_data is None] + [piece for _, piece in mine])
    return out
