"""Replicas read once: which rank fetches each region that several ranks of a load need, and whom it feeds.

The coordinator (``prepare_global_plan``) gives each region (tensor, offsets, sizes) that several ranks need
(DDP replicas, HSDP's replica dimension, ``Replicate``) to one of them, evening out the bytes each fetches, and
tells every rank its part in one global order. A shared box is cut into stripes at its chunks along a dimension
it is stored by (:func:`tsckpt.format.band_order.stripe_dims`), so each member reads one run of each file.
Fetching and moving the bytes is :mod:`tsckpt.dcp.shared_reads`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan

from .contract import Prepickled


@dataclass(frozen=True)
class RankNote:
    """A rank's local plan takes part in replica reads, with its rank in the default process group (where the
    transfers run; DCP numbers plans by the group it was given)."""

    rank: int


@dataclass(frozen=True)
class Transfer:
    """One shared region as one rank sees it: ``seq``, its place in the global order (and message tag);
    ``item``, its read item in this rank's plan; ``owner``, who fetches it and sends it to ``receivers``."""

    seq: int
    item: int
    owner: int
    receivers: tuple[int, ...]
    part: tuple[int, int, int] | None = None  # (dim, start, stop) of the item; None: the whole item

    def box(self, offsets: Sequence[int], lengths: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        offsets, lengths = tuple(offsets), tuple(lengths)
        if self.part is None:
            return offsets, lengths
        d, start, stop = self.part
        return (offsets[:d] + (offsets[d] + start,) + offsets[d + 1:],
                lengths[:d] + (stop - start,) + lengths[d + 1:])


@dataclass(frozen=True)
class ReplicaShare:
    """One rank's part of the schedule, in columns (``LoadPlan.storage_data`` after global planning).

    Row ``k`` (in ``seq`` order) is region ``seq[k]``: read item ``item[k]`` (its stripe ``[start[k], stop[k])``
    along ``dim[k]``, all of it where -1), needed by ``groups[group[k]]`` and fetched by ``owner[k]``.
    """

    rank: int
    groups: Prepickled[tuple[tuple[int, ...], ...]]
    seq: np.ndarray  # int64
    item: np.ndarray  # int32
    group: np.ndarray  # int32
    owner: np.ndarray  # int32
    dim: np.ndarray  # int32
    start: np.ndarray  # int64
    stop: np.ndarray  # int64

    @staticmethod
    def of(plan: LoadPlan) -> ReplicaShare | None:
        data = plan.storage_data
        return data if isinstance(data, ReplicaShare) else None

    def transfers(self) -> list[Transfer]:
        groups = self.groups.value
        return [Transfer(s, i, o, tuple(r for r in groups[g] if r != o), None if d < 0 else (d, a, b))
                for s, i, g, o, d, a, b in zip(self.seq.tolist(), self.item.tolist(), self.group.tolist(),
                                               self.owner.tolist(), self.dim.tolist(), self.start.tolist(),
                                               self.stop.tolist())]

Region = tuple[str, tuple[int, ...], tuple[int, ...]]

#: Boxes smaller than this (step counts, norms) are read by every rank that needs them, unless the rank that
#: saved them needs them too: passing them on costs more than fetching them, but less than reading another
#: rank's chunk table and values, two requests, only for them.
MIN_SHARED_BYTES = 4 << 10


def schedule(plans: Sequence[LoadPlan], itemsize: Callable[[str], int],
             cuts: Callable[[str], Sequence[tuple[int, int, int]]],
             writer: Callable[[Region], int | None] | None = None) -> list[ReplicaShare | None]:
    """Each plan's :class:`ReplicaShare` (None where a rank shares nothing or has no :class:`RankNote`).
    Deterministic.

    ``cuts(fqn)``: where a tensor's regions may be cut into stripes, best first, each ``(dim, chunk, extent)``.
    Regions not cut go whole, largest first, each to the member that has fetched the fewest bytes so far (ties
    rotate with the region). ``writer(region)``: the one rank that saved all of a region (None: several, or
    unknown); a region under :data:`MIN_SHARED_BYTES` is shared only when that rank needs it, and fetched by it.
    """
    ranks = [p.storage_data.rank if isinstance(p.storage_data, RankNote) else None for p in plans]
    needers: dict[Region, list[tuple[int, int]]] = {}  # region -> [(plan index, item index)], in first-seen order
    sizes: dict[Region, int] = {}
    fetched = [0] * len(plans)
    small: dict[Region, int] = {}  # small regions their writer needs -> the writer
    for r, plan in enumerate(plans):
        seen: set[Region] = set()
        for i, item in enumerate(plan.items):
            if item.type == LoadItemType.BYTE_IO:
                continue
            fqn = item.storage_index.fqn
            nbytes = math.prod(item.lengths) * itemsize(fqn)
            region = (fqn, tuple(item.storage_offsets), tuple(item.lengths))
            if ranks[r] is None or region in seen or nbytes < MIN_SHARED_BYTES and writer is None:
                fetched[r] += nbytes
                continue
            seen.add(region)
            sizes[region] = nbytes
            needers.setdefault(region, []).append((r, i))
            if nbytes < MIN_SHARED_BYTES and region not in small:
                small[region] = -1 if (w := writer(region)) is None else w  # type: ignore[misc]
    for region, w in small.items():
        who = needers[region]
        if len(who) > 1 and any(ranks[r] == w for r, _ in who):
            continue
        del needers[region]
        for r, _ in who:
            fetched[r] += sizes[region]
    shared = [region for region, who in needers.items() if len(who) > 1]
    for region, who in needers.items():
        if len(who) == 1:
            fetched[who[0][0]] += sizes[region]
    # Large regions in stripes, stripe k to the k-th member; the rest whole, largest first, each to the least loaded.
    parts: list[tuple[Region, tuple[int, int, int] | None]] = []
    owners: list[int] = []
    whole = []
    for k, region in enumerate(shared):
        who = needers[region]
        cut, stripes = (None, None) if region in small else _cut(region, cuts(region[0]) if region[2] else (), len(who))
        if stripes is None:
            whole.append(k)
            continue
        members = sorted(who, key=lambda w: ranks[w[0]])  # type: ignore[arg-type, return-value]
        for member, (start, stop) in stripes:
            r = members[member][0]
            d = cut[0]  # type: ignore[index]
            parts.append((region, (d, start, stop)))
            owners.append(r)
            fetched[r] += sizes[region] * (stop - start) // region[2][d]
    for k in sorted(whole, key=lambda k: -sizes[shared[k]]):
        who = needers[shared[k]]
        _, owner = min((fetched[r], (n - k) % len(who), r) for n, (r, _) in enumerate(who))[1:]
        if shared[k] in small:
            owner = next(r for r, _ in who if ranks[r] == small[shared[k]])
        parts.append((shared[k], None))
        owners.append(owner)
        fetched[owner] += sizes[shared[k]]
    return _shares(plans, ranks, parts, needers, owners)


def _cut(region: Region, cuts: Sequence[tuple[int, int, int]],
         members: int) -> tuple[tuple[int, int, int] | None, list[tuple[int, tuple[int, int]]] | None]:
    """The first of ``cuts`` that gives each of ``members`` a stripe of ``region``, else the one that gives
    most of them one, with its stripes; ``(None, None)``: fetched whole by one member."""
    best: tuple[tuple[int, int, int] | None, list[tuple[int, tuple[int, int]]] | None] = (None, None)
    for cut in cuts:
        stripes = _stripes(region, cut, members)
        if stripes is not None and len(stripes) == members:
            return cut, stripes
        if stripes is not None and (best[1] is None or len(stripes) > len(best[1])):
            best = cut, stripes
    return best


def _stripes(region: Region, cut: tuple[int, int, int], members: int) -> list[tuple[int, tuple[int, int]]] | None:
    """The stripes of ``region`` along ``cut = (dim, chunk, extent)``: ``(member, (start, stop))`` relative to
    the region, member ``k`` taking the chunks that start in ``[k/m, (k+1)/m)`` of the dimension; None: whole."""
    d, chunk, extent = cut
    lo, hi = region[1][d], region[1][d] + region[2][d]
    edges = [lo] + [min(max(-(-k * extent // (chunk * members)) * chunk, lo), hi) for k in range(1, members)] + [hi]
    stripes = [(k, (a - lo, b - lo)) for k, (a, b) in enumerate(zip(edges, edges[1:])) if b > a]
    return stripes if len(stripes) > 1 else None


def _shares(plans: Sequence[LoadPlan], ranks: Sequence[int | None],
            parts: Sequence[tuple[Region, tuple[int, int, int] | None]],
            needers: Mapping[Region, Sequence[tuple[int, int]]], owners: Sequence[int]) -> list[ReplicaShare | None]:
    rows: list[list[tuple[int, int, tuple[int, ...], int, int, int, int]]] = [[] for _ in plans]
    for seq, ((region, part), owner_plan) in enumerate(zip(parts, owners)):
        who = needers[region]
        members = tuple(sorted(ranks[r] for r, _ in who))  # type: ignore[type-var]
        owner = ranks[owner_plan]
        assert owner is not None
        dim, start, stop = part if part is not None else (-1, -1, -1)
        for r, i in who:
            rows[r].append((seq, i, members, owner, dim, start, stop))
    pickled: dict[tuple[tuple[int, ...], ...], Prepickled[tuple[tuple[int, ...], ...]]] = {}
    out: list[ReplicaShare | None] = []
    for r, mine in enumerate(rows):
        if not mine:
            out.append(None)
            continue
        local: dict[tuple[int, ...], int] = {}
        group = [local.setdefault(m[2], len(local)) for m in mine]
        groups = tuple(local)
        if groups not in pickled:
            pickled[groups] = Prepickled(groups)
        rank = ranks[r]
        assert rank is not None
        columns = list(zip(*mine))
        out.append(ReplicaShare(rank, pickled[groups], np.asarray(columns[0], np.int64),
                                np.asarray(columns[1], np.int32), np.asarray(group, np.int32),
                                np.asarray(columns[3], np.int32), np.asarray(columns[4], np.int32),
                                np.asarray(columns[5], np.int64), np.asarray(columns[6], np.int64)))
    return out
