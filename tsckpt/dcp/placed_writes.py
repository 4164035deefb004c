"""Which rank writes which box of a DTensor, computed from its placements alone, the same on every rank.

A DTensor placed by ``Shard(d)`` and ``Replicate()`` tells every rank each mesh coordinate's shard and which
coordinates hold the same one. So it never travels in a save plan: one rank sends its record, the coordinator
lays out its array from :func:`pieces`, and each rank finds its own writes with :func:`own_boxes`, replicas
sharing the writing in row pieces aligned with the chunk grid.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .replica_writes import MIN_PIECE_BYTES, row_step

#: Placement record types (:func:`tsckpt.dcp.planner.describe`) whose layout follows from the record alone.
SIMPLE_PLACEMENTS = frozenset({"shard", "replicate"})


@dataclass(frozen=True)
class Placed:
    """What fixes a DTensor's layout: global shape, bytes per element, mesh shape and, per mesh dimension,
    the tensor dimension it shards (-1: it replicates)."""

    shape: tuple[int, ...]
    itemsize: int
    mesh_shape: tuple[int, ...]
    placements: tuple[int, ...]

    @classmethod
    def from_record(cls, shape: Sequence[int], itemsize: int, record: Mapping[str, Any]) -> Placed | None:
        """From a DTensor's placement record; None unless its layout follows from the record alone."""
        if record.get("kind") != "dtensor" or any(p.get("type") not in SIMPLE_PLACEMENTS
                                                   for p in record["placements"]):
            return None
        dims = tuple(int(p["dim"]) if p["type"] == "shard" else -1 for p in record["placements"])
        mesh_shape = tuple(int(n) for n in record["mesh"]["shape"])
        if len(dims) != len(mesh_shape) or any(not -len(shape) <= d < len(shape) for d in dims if d != -1):
            return None
        dims = tuple(d % len(shape) if d != -1 else -1 for d in dims)
        sharded = [d for d in dims if d != -1]
        if len(set(sharded)) != len(sharded):
            # One dimension split over several mesh dimensions: torch versions place uneven splits differently,
            # so these stay in the plans, where DCP says where each shard is.
            return None
        return cls(tuple(int(n) for n in shape), int(itemsize), mesh_shape, dims)


@dataclass(frozen=True)
class Pieces:
    """Every box a placed tensor is written as, and who holds it."""

    boxes: np.ndarray  # int64 [n, 2, ndim], none empty
    shard: np.ndarray  # row-major mesh index of the first replica holding each box's shard
    replica_offsets: np.ndarray  # what replica j's coordinate adds to that index


@functools.lru_cache(maxsize=256)
def pieces(placed: Placed) -> Pieces:
    """The boxes of ``placed`` and who writes them (cached: a model's tensors share a few layouts)."""
    mesh = placed.mesh_shape
    ndim = len(placed.shape)
    strides = np.array([math.prod(mesh[i + 1:]) for i in range(len(mesh))], np.int64)
    sharding = [i for i, d in enumerate(placed.placements) if d != -1]
    replicating = [i for i, d in enumerate(placed.placements) if d == -1]
    # One coordinate per distinct shard: every replicating mesh dimension at 0.
    shard_mesh = [mesh[i] for i in sharding]
    coords = np.indices(shard_mesh, dtype=np.int64).reshape(len(sharding), -1).T if sharding \
        else np.zeros((1, 0), np.int64)
    offsets = np.zeros((len(coords), ndim), np.int64)
    sizes = np.tile(np.asarray(placed.shape, np.int64), (len(coords), 1))
    for j, i in enumerate(sharding):  # in mesh order, each split of what the earlier ones left (as DTensor does)
        d, k, c = placed.placements[i], mesh[i], coords[:, j]
        local = sizes[:, d]
        per = -(-local // k)
        start = np.minimum(c * per, local)
        offsets[:, d] += start
        sizes[:, d] = np.minimum(start + per, local) - start
    shard_writer = coords @ strides[sharding] if sharding else np.zeros(1, np.int64)
    replica_coords = np.indices([mesh[i] for i in replicating], dtype=np.int64).reshape(len(replicating), -1).T \
        if replicating else np.zeros((1, 0), np.int64)
    replica_offsets = replica_coords @ strides[replicating] if replicating else np.zeros(1, np.int64)
    keep = sizes.prod(axis=1) > 0 if ndim else np.ones(len(coords), bool)
    offsets, sizes, shard_writer = offsets[keep], sizes[keep], shard_writer[keep]
    step = _piece_rows(placed, offsets, sizes, len(replica_offsets))
    if step is None:
        return Pieces(np.stack([offsets, sizes], axis=1), shard_writer, replica_offsets)
    counts = -(-sizes[:, 0] // step)
    owner = np.repeat(np.arange(len(sizes)), counts)
    turn = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
    lo = offsets[owner].copy()
    hi = sizes[owner].copy()
    lo[:, 0] += turn * step
    hi[:, 0] = np.minimum(step, sizes[owner, 0] - turn * step)
    return Pieces(np.stack([lo, hi], axis=1), shard_writer[owner], replica_offsets)


def _piece_rows(placed: Placed, offsets: np.ndarray, sizes: np.ndarray, replicas: int) -> int | None:
    """Rows per piece when the shards are cut for their replicas (as ``replica_writes`` cuts); None: whole."""
    if replicas < 2 or not placed.shape or not len(sizes):
        return None
    rows = int(sizes[:, 0].max())
    nbytes = int(sizes.prod(axis=1).max()) * placed.itemsize
    m = min(replicas, nbytes // MIN_PIECE_BYTES, rows)
    if m < 2:
        return None
    edges = np.concatenate([offsets[:, 0], offsets[:, 0] + sizes[:, 0]])
    return row_step(math.gcd(*np.unique(edges[(edges > 0) & (edges < placed.shape[0])]).tolist()), rows, m)


@dataclass(frozen=True)
class Held:
    """A placed tensor as one rank holds it: its key, layout, the rank's mesh coordinate and the mesh's ranks."""

    key: str
    placed: Placed
    coordinate: tuple[int, ...]
    ranks: tuple[int, ...]  # row-major, as the mesh lists them


def own_boxes(held: Sequence[Held]) -> dict[str, np.ndarray]:
    """The boxes this rank writes of each tensor it holds: int64 ``[n, 2, ndim]`` per key. The pieces of
    replicated shards are balanced per replica group: largest first (ties by key and position), each to the
    least loaded replica (ties: the first), so every member computes the same assignment from what it holds."""
    groups: dict[tuple[int, ...], list[tuple[str, np.ndarray, int]]] = {}
    me: dict[tuple[int, ...], int] = {}
    out: dict[str, np.ndarray] = {}
    for h in held:
        found = pieces(h.placed)
        mesh = h.placed.mesh_shape
        index = sum(c * math.prod(mesh[i + 1:]) for i, c in enumerate(h.coordinate))
        base = index - sum(c * math.prod(mesh[i + 1:]) for i, c in enumerate(h.coordinate)
                           if h.placed.placements[i] == -1)
        mine = found.boxes[found.shard == base]
        if len(found.replica_offsets) == 1:
            out[h.key] = mine
            continue
        members = tuple(h.ranks[base + int(o)] for o in found.replica_offsets)
        groups.setdefault(members, []).append((h.key, mine, h.placed.itemsize))
        me[members] = members.index(h.ranks[index])
    for members, tensors in groups.items():
        units = sorted((-int(box[1].prod()) * itemsize, key, t)
                       for key, boxes, itemsize in tensors for t, box in enumerate(boxes))
        loads = [(0, j) for j in range(len(members))]
        given: dict[str, list[int]] = {key: [] for key, _, _ in tensors}
        for neg, key, t in units:
            load, j = heapq.heappop(loads)
            if j == me[members]:
                given[key].append(t)
            heapq.heappush(loads, (load - neg, j))
        for key, boxes, _ in tensors:
            out[key] = boxes[sorted(given[key])]
    return out


def shard_box(placed: Placed, coordinate: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The local shard of mesh coordinate ``coordinate``: (offsets, sizes), as DTensor computes it."""
    offsets, sizes = [0] * len(placed.shape), list(placed.shape)
    for i, d in enumerate(placed.placements):
        if d == -1:
            continue
        per = -(-sizes[d] // placed.mesh_shape[i])
        start = min(coordinate[i] * per, sizes[d])
        offsets[d] += start
        sizes[d] = min(start + per, sizes[d]) - start
    return tuple(offsets), tuple(sizes)
