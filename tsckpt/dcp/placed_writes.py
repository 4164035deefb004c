"""Which rank writes which box of a DTensor, computed from its placements alone, the same on every rank.

A DTensor whose placements are ``Shard(d)`` and ``Replicate()`` on a device
mesh tells every rank the whole layout: each mesh coordinate's local shard
(``torch.chunk`` splits, applied mesh dimension by mesh dimension, as DTensor
does) and which coordinates hold the same shard (those differing only along
``Replicate`` dimensions). So such a tensor never travels in a save plan:
tsckpt's planner sends one record of it (from the lowest rank of its mesh),
the coordinator lays out its array from :func:`boxes`, and each rank finds
its own writes with :func:`own_boxes`. What the coordinator gathers and
scatters then grows with tensors plus ranks, not with their product.

Replicas share the writing: a shard of at least two :data:`MIN_PIECE_BYTES`
is cut into row pieces given to its replicas in turn, and a smaller one goes
whole to one replica; the turn starts at a replica chosen by a hash of the
key, so that many small tensors spread over the replicas. The chunk grid is
then aligned to the pieces (:func:`~tsckpt.format.grid.aligned_chunk_shape`),
so no two ranks ever write one chunk.

Pure functions of shapes, placements and keys; nothing here moves bytes.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .replica_writes import MIN_PIECE_BYTES, row_step

#: Placement record types (:func:`tsckpt.dcp.planner.describe`) whose layout follows from the record alone.
SIMPLE_PLACEMENTS = frozenset({"shard", "replicate"})


@dataclass(frozen=True)
class Placed:
    """What fixes a DTensor's layout: global shape, bytes per element, mesh shape and each mesh dim's placement.

    ``placements[i]`` is the sharded tensor dimension of mesh dimension ``i``,
    or -1 where that mesh dimension replicates.
    """

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
            # One dimension split over several mesh dimensions: torch versions have placed uneven splits
            # differently, so these stay in the plans, where DCP says where each shard is.
            return None
        return cls(tuple(int(n) for n in shape), int(itemsize), mesh_shape, dims)


@dataclass(frozen=True)
class Pieces:
    """Every box a placed tensor is written as, with the mesh coordinate (row-major index) that writes it.

    ``boxes``: int64 ``[n, 2, ndim]`` (offsets, sizes), no empty box;
    ``shard_writer``: the row-major mesh index of the first replica holding
    each box's shard; ``turn``: each box's position among its shard's pieces;
    ``replica_offsets[j]``: what replica ``j``'s coordinate adds to that index.
    """

    boxes: np.ndarray
    shard_writer: np.ndarray
    turn: np.ndarray
    replica_offsets: np.ndarray

    def writers(self, key: str) -> np.ndarray:
        """The row-major mesh index writing each box, for the tensor saved under ``key``."""
        g = len(self.replica_offsets)
        if g == 1:
            return self.shard_writer
        start = zlib.crc32(key.encode("utf-8", "surrogatepass")) % g
        return self.shard_writer + self.replica_offsets[(start + self.turn) % g]


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
        boxes = np.stack([offsets, sizes], axis=1)
        return Pieces(boxes, shard_writer, np.zeros(len(boxes), np.int64), replica_offsets)
    counts = -(-sizes[:, 0] // step)
    owner = np.repeat(np.arange(len(sizes)), counts)
    turn = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
    lo = offsets[owner].copy()
    hi = sizes[owner].copy()
    lo[:, 0] += turn * step
    hi[:, 0] = np.minimum(step, sizes[owner, 0] - turn * step)
    return Pieces(np.stack([lo, hi], axis=1), shard_writer[owner], turn, replica_offsets)


def _piece_rows(placed: Placed, offsets: np.ndarray, sizes: np.ndarray, replicas: int) -> int | None:
    """Rows per piece when the shards are cut for their replicas; None when they are written whole.

    Pieces never cut the chunk grid finer than the shards' own row boundaries
    allow: their height is a multiple of the largest divisor of those
    boundaries' gcd that fits (as :mod:`tsckpt.dcp.replica_writes` cuts).
    """
    if replicas < 2 or not placed.shape or not len(sizes):
        return None
    rows = int(sizes[:, 0].max())
    nbytes = int(sizes.prod(axis=1).max()) * placed.itemsize
    m = min(replicas, nbytes // MIN_PIECE_BYTES, rows)
    if m < 2:
        return None
    edges = np.concatenate([offsets[:, 0], offsets[:, 0] + sizes[:, 0]])
    inner = 0
    for edge in np.unique(edges[(edges > 0) & (edges < placed.shape[0])]).tolist():
        inner = math.gcd(inner, edge)
    return row_step(inner, rows, m)


def own_boxes(placed: Placed, key: str, coordinate: Sequence[int]) -> np.ndarray:
    """The boxes the mesh coordinate ``coordinate`` writes of the tensor saved under ``key``: int64 ``[n, 2, ndim]``."""
    index = sum(c * math.prod(placed.mesh_shape[i + 1:]) for i, c in enumerate(coordinate))
    found = pieces(placed)
    return found.boxes[found.writers(key) == index]


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
