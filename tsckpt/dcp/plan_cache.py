"""DCP's save-plan caching, for a writer whose plans name a new data location on every save.

With ``DefaultSavePlanner(enable_plan_caching=True)`` DCP hands the storage
writer's global planning an empty, ``usable=False`` plan for each rank whose
plan did not change since the last save with that planner class, and that rank
then writes with the plan it received last time, storage data included. tsckpt
cannot let it: that storage data names the last save's data location (a new
staging directory on every save to a local filesystem) and the last writer's
options. So the coordinator sends every rank a usable plan on every save: the
rank's cached plan items with fresh storage data. The items were pickled once,
when they were first sent (:class:`PrepickledPlan`); sending them again copies
bytes, so a repeated save costs the coordinator about what it costs DCP.
tsckpt's own planner does better: it applies this save's orders to the plan
each rank holds (:class:`~tsckpt.dcp.contract.NewOrders`), so a repeated save
sends each rank a few hundred bytes.

The cache is keyed as DCP keys its own (the planner's ``_cached_plans_key``,
its class name) and trusts only what DCP still holds: an entry is used while
DCP's cache holds the very global plans it was made from.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from ..errors import PlanError
from .contract import PlannerNotes, Prepickled, RankPlan
from .global_layout import GlobalLayout


class PrepickledPlan(SavePlan):
    """A rank's plan whose items were pickled before: DCP's scatter copies their bytes, then adds the storage data."""

    @classmethod
    def of(cls, plan: SavePlan, pickled: Prepickled[SavePlan], storage_data: Any) -> PrepickledPlan:
        obj = cls(items=plan.items, storage_data=storage_data, planner_data=plan.planner_data, usable=True)
        object.__setattr__(obj, "_pickled", (plan.items, pickled))
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        items, pickled = self.__dict__.get("_pickled", (None, None))
        if items is not self.items:  # changed since (dataclasses.replace): pickle it as a plain plan
            return (SavePlan, (self.items, self.storage_data, self.planner_data, self.usable))
        return (_with_storage_data, (pickled, self.storage_data))


def _with_storage_data(pickled: Prepickled[SavePlan], storage_data: Any) -> SavePlan:
    return dataclasses.replace(pickled.value, storage_data=storage_data)


def _bare(plan: SavePlan) -> SavePlan:
    """What is pickled once: the plan without its storage data, which changes with every save."""
    return SavePlan(items=plan.items, planner_data=plan.planner_data)


def _dcp_cache() -> dict[str, list[SavePlan]]:
    return getattr(SavePlanner, "_cached_global_plan", None) or {}


@dataclass(frozen=True)
class CachedSave:
    """The last save made from one cached set of DCP global plans."""

    global_plans: list[SavePlan]  # DCP's own cached list: identity says whether DCP moved on since
    pickled: list[Prepickled[SavePlan]]
    layout: GlobalLayout
    sent: list[SavePlan]  # what the ranks were sent: the global plans with replicas' writes spread


class PlanCache:
    """The coordinator's side of DCP's plan cache, one entry per DCP cache key (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, CachedSave] = {}

    @staticmethod
    def full_plans(plans: list[SavePlan], where: str) -> tuple[list[SavePlan], str | None]:
        """Every rank's full global plan, and DCP's cache key when the planner caches (None when it does not).

        DCP's cached global plans hold the very plan objects it passes on for
        ranks whose plans changed, so they tell which cache entry these are.
        When no plan changed, the key tsckpt's planner put in the plans tells,
        or else the one entry for this world size made by another planner.
        """
        cache = _dcp_cache()
        usable = [r for r, p in enumerate(plans) if p.usable]
        if usable:
            for key, cached in cache.items():
                if len(cached) == len(plans) and all(cached[r] is plans[r] for r in usable):
                    return cached, key
            if len(usable) == len(plans):
                return plans, None
            raise PlanError(f"saving {where}: DCP's plan cache sent no plan for some ranks, and its cache holds "
                            f"no global plans that the others belong to")
        tags = {PlannerNotes.of(p).cache_key for p in plans} - {None}
        # tsckpt's planner says whose plans these are; DCP's own does not, but its plans carry no notes.
        keys = [k for k, cached in cache.items() if len(cached) == len(plans)
                and (k in tags if tags else not any(PlannerNotes.found(p) for p in cached[:1]))]
        if len(keys) != 1:
            stale = [r for r, p in enumerate(plans) if not p.usable]
            why = (f"{len(keys)} planner classes have cached plans for {len(plans)} ranks in this process "
                   f"({', '.join(sorted(keys))}), and DCP's own planner does not say which one made these; use "
                   f"tsckpt.SavePlanner, or one caching planner class per process") if keys else \
                "and DCP's cache holds no plans for them"
            raise PlanError(f"saving {where}: DCP's plan cache sent no plan for rank(s) {stale[:8]}: {why}")
        return cache[keys[0]], keys[0]

    @staticmethod
    def ranks_keep_their_plans(plans: list[SavePlan]) -> bool:
        """Whether DCP found no plan changed and tsckpt's planner made them, which updates each rank's cached plan.

        Its ``finish_plan`` then applies :class:`~tsckpt.dcp.contract.NewOrders`
        to the plan the rank holds; DCP's own planner would write with the old orders.
        """
        return all(not p.usable and PlannerNotes.of(p).cache_key is not None for p in plans)

    def layout(self, key: str | None, plans: list[SavePlan],
               inner_chunk_bytes: int) -> tuple[GlobalLayout, list[SavePlan]] | None:
        """The layout made from these very plans, and the plans sent with it, if they were kept."""
        with self._lock:
            entry = self._entries.get(key) if key is not None else None
        if entry is not None and entry.global_plans is plans and entry.layout.inner_chunk_bytes == inner_chunk_bytes:
            return entry.layout, entry.sent
        return None

    def send(self, key: str, plans: list[SavePlan], sent: list[SavePlan], layout: GlobalLayout,
             rank_plans: list[RankPlan]) -> list[SavePlan]:
        """Every rank's plan (``sent``, made from DCP's ``plans``) with its fresh storage data, its items
        pickled at most once per DCP cache entry."""
        with self._lock:
            entry = self._entries.get(key)
        if entry is not None and entry.global_plans is plans and entry.sent is sent:
            pickled = entry.pickled
        else:
            pickled = [Prepickled(_bare(p)) for p in sent]
        with self._lock:
            self._entries[key] = CachedSave(plans, pickled, layout, sent)
        return [PrepickledPlan.of(p, b, rp) for p, b, rp in zip(sent, pickled, rank_plans)]


#: One per process, as DCP's caches are (class attributes of its SavePlanner).
CACHE = PlanCache()
