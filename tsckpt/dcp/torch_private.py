"""The parts of PyTorch tsckpt relies on that PyTorch does not promise to keep, each checked against the
installed torch by ``tests/test_torch_private.py``: ``torch.distributed._shard``'s ShardedTensor (staging
rebuilds one with its private constructor), ``_StridedShard``, ``checkpoint._nested_dict`` (a converted
``torch.save`` file's keys are the ones ``dcp.save`` gives), ``FakeTensorMode`` (for ``skip_data``), DCP's
object paths (a planner's ``mappings``), and DCP's plan cache: with ``enable_plan_caching``, a rank whose plan
did not change sends ``SavePlan(usable=False)``, gets back an unusable plan with the writer's storage data,
``finish_plan`` returns its last plan, and ``global_plan`` holds every rank's full plan.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, MutableMapping
from typing import Any

from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._shard.sharded_tensor import Shard as LocalShard
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard

__all__ = ["FakeTensorMode", "LocalShard", "ShardedTensor", "StridedShard", "flatten_state_dict", "get_element",
           "plan_caching_asked", "set_element", "sharded_tensor_like", "unflatten_state_dict"]

ObjectPath = tuple[str | int, ...]  # where a flattened key's value sits in the nested state dict


def sharded_tensor_like(shards: list[Any], like: ShardedTensor) -> ShardedTensor:
    """A ShardedTensor of ``shards`` (this rank's), with ``like``'s global metadata and process group."""
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, like.metadata(), process_group=like._process_group)


def get_element(root: Any, path: ObjectPath) -> Any:
    for step in path:
        root = root[step]
    return root


def set_element(root: MutableMapping[str, Any], path: ObjectPath, value: Any) -> None:
    """Put ``value`` at ``path`` in the nested ``root``, making what is missing on the way, as DCP does."""
    container: Any = root
    for step, following in zip(path, path[1:]):
        fresh: Any = {} if isinstance(following, str) else []
        if isinstance(container, Mapping):
            container = container.setdefault(step, fresh)
            continue
        _grow(container, step)
        if container[step] is None:
            container[step] = fresh
        container = container[step]
    last = path[-1]
    if isinstance(last, int):
        _grow(container, last)
    container[last] = value


def _grow(items: list[Any], index: int) -> None:
    items.extend([None] * (index + 1 - len(items)))


def plan_caching_asked(*args: Any, **kwargs: Any) -> bool:
    """Whether ``DefaultSavePlanner(*args, **kwargs)`` turns DCP's plan cache on."""
    given = inspect.signature(DefaultSavePlanner.__init__).bind(None, *args, **kwargs).arguments
    return bool(given.get("enable_plan_caching", False))

