"""What the coordinator and each rank tell each other during a save, beyond DCP's own plans.

The coordinator sends every rank a :class:`RankPlan` (where to write, each
array's layout) in its plan's ``storage_data``; each rank answers with one
:class:`RankSummary` of what it wrote, on its first write result. Both are
O(tensors) per rank, so the coordinator's work grows with ranks + tensors,
not ranks x tensors.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..base_chunks import BaseChoice
from ..format import content_hashes
from ..storage.layouts import PLAIN
from ..format.metadata import TensorEntry
from ..storage.location import Location
from ..rank_writer import WrittenChunks


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """What the coordinator tells one rank: where this save writes, its arrays' layout and its values' paths.

    ``describe``: the rank's plan carried no placement records (DCP's own
    planner), so the rank reports them with its write results.
    ``storage_layout``: the coordinator's storage layout, which every rank
    writes in whatever its own writer was told (the metadata records only one).
    """

    arrays: dict[str, TensorEntry]
    objects: dict[str, str]
    describe: bool = False
    location: Location | None = None
    storage_layout: str = PLAIN
    #: The base of an incremental save, when one was given.
    base: BaseChoice | None = None


class RankSummary:
    """What one rank wrote, as the coordinator's ``finish`` needs it: columns, not per-item records.

    Tensors are numbered in the order of the layouts the coordinator sent, so
    a rank reports integers and the coordinator groups a whole job's chunks
    with one sort instead of a Python loop over ranks x tensors.
    """

    def __init__(self, rank: int, names: list[str], placements: dict[str, Any]):
        self.rank = rank
        self.ids = {fqn: i for i, fqn in enumerate(names)}
        self.placements = placements
        self.objects: dict[str, Any] = {}
        self.tensor: list[int] = []
        self.chunk: list[int] = []
        self.crc: list[int] = []
        self.digests: list[bytes] = []
        self.reused: list[bool] = []

    def add(self, fqn: str, chunks: WrittenChunks) -> None:
        """Record the outer chunks of ``fqn`` this rank saved: indices, checksums, and which it took from the base."""
        self.chunk += chunks.indices
        self.crc += chunks.crcs
        self.digests += chunks.digests
        self.reused += chunks.reused or [False] * len(chunks.indices)
        self.tensor += [self.ids[fqn]] * len(chunks.indices)

    def packed(self) -> dict[str, Any]:
        return {"rank": self.rank, "placements": self.placements, "objects": self.objects,
                "tensor": np.asarray(self.tensor, dtype=np.int32), "chunk": np.asarray(self.chunk, dtype=np.int64),
                "crc": np.asarray(self.crc, dtype=np.uint32),
                "digest": np.frombuffer(b"".join(self.digests), dtype=np.uint8).reshape(-1, content_hashes.WIDTH),
                "reused": np.asarray(self.reused, dtype=bool)}

    @staticmethod
    def merge(summaries: list[dict[str, Any]], names: list[str]) -> dict[str, MergedChunks]:
        """Each tensor's chunks from every rank's summary, grouped with one sort."""
        tensor = np.concatenate([s["tensor"] for s in summaries] or [np.zeros(0, np.int32)])
        chunk = np.concatenate([s["chunk"] for s in summaries] or [np.zeros(0, np.int64)])
        crc = _column(summaries, "crc", np.zeros((len(chunk),), np.uint32))
        digest = _column(summaries, "digest", np.zeros((len(chunk), content_hashes.WIDTH), np.uint8))
        reused = np.concatenate([s["reused"] for s in summaries] or [np.zeros(0, bool)])
        rank = np.repeat([s["rank"] for s in summaries], [len(s["tensor"]) for s in summaries]).astype(np.int64)
        order = np.argsort(tensor, kind="stable")
        bounds = np.searchsorted(tensor[order], np.arange(len(names) + 1))
        return {fqn: MergedChunks(chunk[o], crc[o], digest[o], rank[o], reused[o])
                for fqn, a, b in zip(names, bounds[:-1], bounds[1:]) for o in [order[a:b]]}


def _column(summaries: list[dict[str, Any]], name: str, missing: np.ndarray) -> np.ndarray:
    """One column of every summary, or ``missing`` when a rank recorded none (checksums off)."""
    parts = [s[name] for s in summaries]
    if parts and all(len(p) == len(s["tensor"]) for p, s in zip(parts, summaries)):
        return np.concatenate(parts)
    return missing


@dataclasses.dataclass(frozen=True)
class MergedChunks:
    """One tensor's chunks as every rank reported them: indices, checksums, writers, which were taken."""

    indices: np.ndarray
    crcs: np.ndarray
    digests: np.ndarray
    ranks: np.ndarray
    reused: np.ndarray
