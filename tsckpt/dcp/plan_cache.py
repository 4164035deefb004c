"""DCP's save-plan caching, made safe for a writer that lays out arrays from every rank's plan.

With ``DefaultSavePlanner(enable_plan_caching=True)`` DCP sends the storage
writer's global planning an empty, ``usable=False`` plan for each rank whose
plan did not change since the last save, and that rank later writes with its
own cached plan, storage data included. TensorStoreWriter chooses every array's
chunk grid from all ranks' regions, so it needs the full plans: the coordinator
keeps the last full plans of a save whose planner caches (DCP keeps the same
objects in its own caches) and puts them back in place of the empty ones. A
planner that does not cache leaves both caches alone. Every rank then gets
a usable plan with fresh storage data, so no rank writes with a layout planned
for another save, by another writer or with other options.
"""

from __future__ import annotations

import threading

from torch.distributed.checkpoint.planner import SavePlan

from ..errors import PlanError

_lock = threading.Lock()
_last: list[SavePlan] | None = None


def expand(plans: list[SavePlan], where: str) -> list[SavePlan]:
    """``plans`` with every cached (unusable) plan replaced by that rank's last full plan."""
    if all(p.usable for p in plans):
        return plans
    stale = [rank for rank, p in enumerate(plans) if not p.usable]
    with _lock:
        last = _last
    if last is None or len(last) != len(plans):
        raise PlanError(
            f"saving {where}: DCP's plan cache sent no plan for rank(s) {stale}, and this process has no "
            "earlier plan for them (the cache was filled by a save with another storage writer or world "
            "size); save once with a planner that does not cache, or use a new planner class")
    return [p if p.usable else last[rank] for rank, p in enumerate(plans)]


def remember(plans: list[SavePlan] | None, planner: object) -> None:
    """Keep the full plans of a save whose planner caches (or may cache) its plans."""
    global _last
    if plans is None or getattr(planner, "_enable_plan_caching", True) is False:
        return  # a planner that does not cache leaves DCP's caches alone, and so this one
    with _lock:
        _last = list(plans)
