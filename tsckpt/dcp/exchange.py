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

from ..storage.layouts import PLAIN
from ..format.metadata import TensorEntry
from ..storage.location import Location


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

    def add(self, fqn: str, indices: list[int], crcs: list[int]) -> None:
        """Record the outer chunks of ``fqn`` this rank wrote (flat grid indices) and their crc32c, if any."""
        self.chunk += indices
        self.crc += crcs
        self.tensor += [self.ids[fqn]] * len(indices)

    def packed(self) -> dict[str, Any]:
        return {"rank": self.rank, "placements": self.placements, "objects": self.objects,
                "tensor": np.asarray(self.tensor, dtype=np.int32), "chunk": np.asarray(self.chunk, dtype=np.int64),
                "crc": np.asarray(self.crc, dtype=np.uint32)}

    @staticmethod
    def merge(summaries: list[dict[str, Any]], names: list[str]) -> dict[str, tuple[np.ndarray, ...]]:
        """Each tensor's (chunk indices, crc32c values, writing ranks), from every rank's summary."""
        tensor = np.concatenate([s["tensor"] for s in summaries] or [np.zeros(0, np.int32)])
        chunk = np.concatenate([s["chunk"] for s in summaries] or [np.zeros(0, np.int64)])
        crcs = [s["crc"] for s in summaries]
        crc = np.concatenate(crcs) if crcs and all(len(c) == len(t["tensor"]) for c, t in zip(crcs, summaries)) \
            else np.zeros(len(chunk), np.uint32)
        rank = np.repeat([s["rank"] for s in summaries], [len(s["tensor"]) for s in summaries]).astype(np.int64)
        order = np.argsort(tensor, kind="stable")
        bounds = np.searchsorted(tensor[order], np.arange(len(names) + 1))
        return {fqn: (chunk[order[a:b]], crc[order[a:b]], rank[order[a:b]])
                for fqn, a, b in zip(names, bounds[:-1], bounds[1:])}
