"""DCP's save-plan caching, for a writer whose plans name a new data location on every save.

With ``enable_plan_caching=True`` a rank whose plan did not change gets an empty, ``usable=False`` plan and
writes with its last one, storage data (the last save's location) included. So the coordinator sends every rank
a usable plan on every save: its cached items, pickled once (:class:`PrepickledPlan`), with fresh storage data;
with tsckpt's own planner, only this save's orders (:class:`~tsckpt.dcp.contract.NewOrders`). The full plans
come from tsckpt's planner (:class:`~tsckpt.dcp.contract.GlobalPlans`), or from another planner's
``global_plan``, noted by weak reference (:meth:`PlanCache.note`); two live sets for as many ranks cannot be
told apart, and the save is refused.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.planner import SavePlan

from ..errors import PlanError
from .contract import GlobalPlans, Prepickled, RankPlan
from .global_layout import GlobalLayout

#: The cache entry of saves planned by a planner other than tsckpt's, which names no cache key.
RECALLED = "recalled"


@dataclass(frozen=True)
class PrepickledPlan(SavePlan):
    """A rank's plan whose items were pickled before: DCP's scatter copies their bytes, then adds the storage data."""

    pickled: Prepickled[SavePlan] | None = None  # the plan without its storage data, pickled when first sent

    @classmethod
    def of(cls, plan: SavePlan, pickled: Prepickled[SavePlan], storage_data: Any) -> PrepickledPlan:
        return cls(items=plan.items, storage_data=storage_data, planner_data=plan.planner_data, usable=True,
                   pickled=pickled)

    def __reduce__(self) -> tuple[Any, ...]:
        bare = self.pickled.value if self.pickled is not None else None
        if bare is None or bare.items is not self.items or bare.planner_data is not self.planner_data:
            # changed since (dataclasses.replace): pickled as a plain plan
            return (SavePlan, (self.items, self.storage_data, self.planner_data, self.usable))
        return (_with_storage_data, (self.pickled, self.storage_data))


def _with_storage_data(pickled: Prepickled[SavePlan], storage_data: Any) -> SavePlan:
    return dataclasses.replace(pickled.value, storage_data=storage_data)


def _same_objects(a: list[SavePlan], b: list[SavePlan]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _same_items(a: list[SavePlan], b: list[SavePlan]) -> bool:
    return len(a) == len(b) and all(x is y or x.items == y.items for x, y in zip(a, b))


@dataclass(frozen=True)
class CachedSave:
    """The last save made from one set of full plans."""

    global_plans: list[SavePlan]  # every rank's full plan: the same objects mean the same save plan
    pickled: list[Prepickled[SavePlan]]
    layout: GlobalLayout
    sent: list[SavePlan]  # what the ranks were sent: the global plans with replicas' writes spread


class PlanCache:
    """The coordinator's side of DCP's plan cache (thread-safe), one entry per cache key (or :data:`RECALLED`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, CachedSave] = {}
        self._noted: list[list[weakref.ref[SavePlan]]] = []

    def note(self, planner: Any) -> None:
        """Coordinator, in ``write_data``: weak references to ``planner.global_plan``, every rank's full plan."""
        plans = getattr(planner, "global_plan", None)
        if not isinstance(plans, list) or not plans or not all(isinstance(p, SavePlan) for p in plans):
            return
        with self._lock:
            held = [s for s in self._held() if not _same_objects(s, plans)]
            self._noted = [[weakref.ref(p) for p in s] for s in held] + [[weakref.ref(p) for p in plans]]

    def _held(self) -> list[list[SavePlan]]:
        """The noted sets of plans still alive, as strong references (under the lock)."""
        alive = ([r() for r in refs] for refs in self._noted)
        return [plans for plans in alive if all(p is not None for p in plans)]

    def full_plans(self, plans: list[SavePlan], where: str) -> tuple[list[SavePlan], str | None]:
        """Every rank's full plan from what DCP's global planning returned (unusable where DCP's cache found a
        plan unchanged), and the key of the cache entry to keep for it (None: keep none)."""
        handed = GlobalPlans.found(plans)
        if handed is not None:
            return handed.plans, handed.cache_key
        stale = [r for r, p in enumerate(plans) if not p.usable]
        with self._lock:
            if not stale:
                # Every plan is new: what was recalled before is no longer what DCP's cache holds.
                self._entries.pop(RECALLED, None)
                return plans, None
            held = [s for s in self._held() if len(s) == len(plans)]
        distinct: list[list[SavePlan]] = []
        for s in held:
            if not any(_same_items(s, d) for d in distinct):
                distinct.append(s)
        if len(distinct) != 1:
            why = (f"{len(distinct)} planners in this process have cached different plans for {len(plans)} "
                   f"ranks, and DCP's own planner does not say which one made these; use tsckpt.SavePlanner, or "
                   f"one caching planner class per process") if distinct else \
                f"and no plans for {len(plans)} ranks that DCP's cache holds were made in this process's saves"
            raise PlanError(f"saving {where}: DCP's plan cache sent no plan for rank(s) {stale[:8]}, {why}")
        return [p if p.usable else old for p, old in zip(plans, distinct[0])], RECALLED

    @staticmethod
    def ranks_keep_their_plans(plans: list[SavePlan]) -> bool:
        """Whether DCP found no plan changed and tsckpt's planner made them (which take ``NewOrders``)."""
        return GlobalPlans.found(plans) is not None and not any(p.usable for p in plans)

    def layout(self, key: str | None, plans: list[SavePlan], inner_chunk_bytes: int,
               bands: bool) -> tuple[GlobalLayout, list[SavePlan]] | None:
        """The layout made from these very plans, and the plans sent with it, if they were kept."""
        with self._lock:
            entry = self._entries.get(key) if key is not None else None
        if (entry is not None and _same_objects(entry.global_plans, plans)
                and entry.layout.inner_chunk_bytes == inner_chunk_bytes and entry.layout.bands == bands):
            return entry.layout, entry.sent
        return None

    def send(self, key: str, plans: list[SavePlan], sent: list[SavePlan], layout: GlobalLayout,
             rank_plans: list[RankPlan]) -> list[SavePlan]:
        """Every rank's plan (``sent``) with fresh storage data, its items pickled at most once per cache entry."""
        with self._lock:
            entry = self._entries.get(key)
        if entry is not None and _same_objects(entry.global_plans, plans) and entry.sent is sent:
            pickled = entry.pickled
        else:
            pickled = [Prepickled(SavePlan(items=p.items, planner_data=p.planner_data)) for p in sent]
        with self._lock:
            self._entries[key] = CachedSave(plans, pickled, layout, sent)
        return [PrepickledPlan.of(p, b, rp) for p, b, rp in zip(sent, pickled, rank_plans)]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._noted.clear()


#: One per process, as DCP's caches are (class attributes of its SavePlanner).
CACHE = PlanCache()
