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

from ..format.layouts import PLAIN
from ..format.metadata import TensorEntry
from ..location import Location


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
    with one sort instead of a Python loop over ranks x tensors. Two columns
    of records: the outer chunks the rank wrote (who wrote what), and the
    crc32c of every checksummed piece of them (inner chunks).
    """

    def __init__(self, rank: int, names: list[str], placements: dict[str, Any]):
        self.rank = rank
        self.ids = {fqn: i for i, fqn in enumerate(names)}
        self.placements = placements
        self.objects: dict[str, Any] = {}
        self.tensor: list[int] = []
        self.chunk: list[int] = []
        self.crc_tensor: list[int] = []
        self.piece: list[int] = []
        self.crc: list[int] = []

    def wrote(self, fqn: str, entry: TensorEntry, offsets: Any, shape: Any) -> None:
        """Record the outer chunks of a region of ``shape`` written at ``offsets``."""
        grid = entry.grid
        indices = [grid.flat_index(i) for i, _ in grid.chunks_within(offsets, shape)]
        self.chunk += indices
        self.tensor += [self.ids[fqn]] * len(indices)

    def checksummed(self, fqn: str, pieces: Any, crcs: Any) -> None:
        """Record the crc32c of pieces of ``fqn``'s checksum grid (flat indices)."""
        pieces = [int(p) for p in pieces]
        self.piece += pieces
        self.crc += [int(c) for c in crcs]
        self.crc_tensor += [self.ids[fqn]] * len(pieces)

    def packed(self) -> dict[str, Any]:
        return {"rank": self.rank, "placements": self.placements, "objects": self.objects,
                "tensor": np.asarray(self.tensor, dtype=np.int32), "chunk": np.asarray(self.chunk, dtype=np.int64),
                "crc_tensor": np.asarray(self.crc_tensor, dtype=np.int32),
                "piece": np.asarray(self.piece, dtype=np.int64), "crc": np.asarray(self.crc, dtype=np.uint32)}

    @staticmethod
    def merge(summaries: list[dict[str, Any]], names: list[str]) -> dict[str, tuple[np.ndarray, ...]]:
        """Each tensor's (outer chunk indices, writing ranks, checksummed piece indices, crc32c values)."""
        chunks = _group(summaries, names, "tensor", "chunk", rank=True)
        crcs = _group(summaries, names, "crc_tensor", "piece", "crc")
        return {fqn: chunks[fqn] + crcs[fqn] for fqn in names}


def _group(summaries: list[dict[str, Any]], names: list[str], by: str, *columns: str,
           rank: bool = False) -> dict[str, tuple[np.ndarray, ...]]:
    """Every summary's ``columns`` (and, with ``rank``, the reporting rank), grouped by tensor id ``by``."""
    def joined(key: str, dtype: Any) -> np.ndarray:
        return np.concatenate([np.asarray(s[key], dtype=dtype) for s in summaries] or [np.zeros(0, dtype)])

    ids = joined(by, np.int32)
    data = [joined(c, np.uint32 if c == "crc" else np.int64) for c in columns]
    if rank:
        data.append(np.repeat([s["rank"] for s in summaries], [len(s[by]) for s in summaries]).astype(np.int64))
    order = np.argsort(ids, kind="stable")
    bounds = np.searchsorted(ids[order], np.arange(len(names) + 1))
    return {fqn: tuple(col[order[a:b]] for col in data) for fqn, a, b in zip(names, bounds[:-1], bounds[1:])}
