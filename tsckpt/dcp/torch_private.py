"""The parts of PyTorch tsckpt relies on that PyTorch does not promise to keep, in one module.

Each name here says what tsckpt takes from torch and what it relies on;
``tests/test_torch_private.py`` checks every one against the installed torch,
so that a release that changes one fails there, by name, rather than somewhere
inside a save or a load.

* :data:`ShardedTensor`, :data:`LocalShard`, :func:`sharded_tensor_like`: the
  ``ShardedTensor`` type lives only in ``torch.distributed._shard``; staging
  rebuilds one around copied shards with its private constructor from local
  shards and global metadata, in the tensor's own process group.
* :data:`StridedShard`: ``placement_types._StridedShard``, the placement
  FSDP2 gives a dimension that tensor parallelism shards too; tsckpt records
  its ``dim`` and ``split_factor``.
* :data:`flatten_state_dict`, :data:`unflatten_state_dict`: DCP's own
  (``checkpoint._nested_dict``), so that a converted ``torch.save`` file's keys
  are the ones ``dcp.save`` gives the same nested state dict.
* :data:`FakeTensorMode` (``torch._subclasses``): tensors with a shape and no
  storage, for ``torch.serialization.skip_data`` to write a file's skeleton.
* :func:`get_element`, :func:`set_element`: tsckpt's own walk of DCP's object
  paths, the values of a DCP planner's public ``mappings`` (tuples of ``str``
  keys and ``int`` list indices, made by DCP's private flattening).
* DCP's plan cache, which ``tsckpt.SavePlanner.finish_plan`` works with:
  :func:`plan_caching_asked` reads ``enable_plan_caching`` from
  ``DefaultSavePlanner``'s arguments (DCP keeps its flag private); with it on,
  a rank whose local plan did not change since the last save sends an empty
  ``SavePlan(usable=False)``, its global plan comes back unusable with the
  writer's storage data, ``DefaultSavePlanner.finish_plan`` returns the plan the
  rank finished last time, and ``global_plan`` holds every rank's full plan.
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

#: A DCP object path: where a flattened key's value sits in the nested state dict.
ObjectPath = tuple[str | int, ...]


def sharded_tensor_like(shards: list[Any], like: ShardedTensor) -> ShardedTensor:
    """A ShardedTensor of ``shards`` (this rank's), with ``like``'s global metadata and process group."""
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, like.metadata(), process_group=like._process_group)


def get_element(root: Any, path: ObjectPath) -> Any:
    """The value at ``path`` in the nested ``root``."""
    for step in path:
        root = root[step]
    return root


def set_element(root: MutableMapping[str, Any], path: ObjectPath, value: Any) -> None:
    """Put ``value`` at ``path`` in the nested ``root``, making the dicts and lists on the way that are missing
    (lists grown with None), as DCP's own unflattening does."""
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

