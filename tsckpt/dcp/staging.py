"""Staging for ``async_save``: one plain copy of the state dict's tensor data.

``dcp.async_save`` returns once the state dict is staged, so staging is all the
training loop waits for. DCP's default stager deep-copies the state dict object
graph (meshes, placements, storages) on the way; this one copies only tensor
bytes into fresh CPU memory and rebuilds the thin DTensor / ShardedTensor
wrappers around them, so the wait is about one ``memcpy`` of the local data.
Non-tensor values are deep-copied (they are small, and training mutates them).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import Shard as LocalShard
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor


class Stager(AsyncStager):
    """An ``AsyncStager`` that copies tensors to CPU memory synchronously.

    Pass it as ``dcp.async_save(..., async_stager=tsckpt.Stager())``;
    :func:`tsckpt.async_save` does so itself. Tensors that share storage in the
    source (tied weights) share one copy in the staged state dict.
    """

    _synchronize_after_execute: bool = False

    def stage(self, state_dict: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        return _copy(state_dict, {})

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` copies before it returns."""

    def close(self) -> None:
        """No threads or pinned buffers to release."""


def _copy(obj: Any, memo: dict[tuple[Any, ...], torch.Tensor]) -> Any:
    if isinstance(obj, DTensor):
        return DTensor.from_local(_copy_tensor(obj.to_local(), memo), obj.device_mesh, obj.placements,
                                  run_check=False, shape=obj.shape, stride=obj.stride())
    if isinstance(obj, ShardedTensor):
        shards = [LocalShard(_copy_tensor(s.tensor, memo), s.metadata) for s in obj.local_shards()]
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, obj.metadata(), process_group=obj._process_group)
    if isinstance(obj, torch.Tensor):
        return _copy_tensor(obj, memo)
    if isinstance(obj, dict):
        return {k: _copy(v, memo) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy(v, memo) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_copy(v, memo) for v in obj)
    return copy.deepcopy(obj)


def _copy_tensor(t: torch.Tensor, memo: dict[tuple[Any, ...], torch.Tensor]) -> torch.Tensor:
    t = t.detach()
    key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
    if t.numel() and key in memo:
        return memo[key]
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    out.copy_(t)
    memo[key] = out
    return out
