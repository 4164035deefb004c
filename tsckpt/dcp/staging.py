"""Staging for ``async_save``: DCP's default stager deep-copies the object graph; this one copies only tensor
bytes into CPU memory and rebuilds the thin DTensor / ShardedTensor wrappers around them."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from .torch_private import LocalShard, ShardedTensor, sharded_tensor_like


class Stager(AsyncStager):
    """An ``AsyncStager`` that copies tensors to CPU memory synchronously.

    Pass it as ``dcp.async_save(..., async_stager=tsckpt.Stager())``; :func:`tsckpt.async_save` and
    ``TensorStoreWriter`` (one itself) need not. Tensors that share storage (tied weights) share one staged
    copy; non-tensor values are deep-copied.

    Args:
        cache_staged_state_dict: keep the staged copies and refill them on the next call while the state dict
            keeps its structure, shapes and dtypes (DCP's option): wait for the previous save before staging
            the next.
    """

    _synchronize_after_execute: bool = False

    def __init__(self, cache_staged_state_dict: bool = False):
        self.cache_staged_state_dict = cache_staged_state_dict
        self._staged: dict[str, Any] | None = None

    def stage(self, state_dict: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        if self.cache_staged_state_dict and self._staged is not None:
            try:
                return _stage(state_dict, self._staged, {})
            except _Changed:
                pass  # the state dict changed shape: stage into fresh memory
        staged = _stage(state_dict, _FRESH, {})
        if self.cache_staged_state_dict:
            self._staged = staged
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` copies before it returns."""

    def close(self) -> None:
        """Release the cached copies, if any."""
        self._staged = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_staged": None}


_FRESH: Any = object()  # where a value has no staged copy to refill


class _Changed(Exception):
    """The state dict no longer matches the cached copies."""


def _stage(obj: Any, cached: Any, memo: dict[tuple[Any, ...], torch.Tensor]) -> Any:
    """``obj`` with its tensors copied to CPU memory: fresh where ``cached`` is :data:`_FRESH`, else into the
    matching tensors of ``cached`` (raising :class:`_Changed` where they do not match)."""
    fresh = cached is _FRESH
    if isinstance(obj, DTensor):
        if fresh:
            return DTensor.from_local(_copy_tensor(obj.to_local(), memo), obj.device_mesh, obj.placements,
                                      run_check=False, shape=obj.shape, stride=obj.stride())
        _check(isinstance(cached, DTensor) and cached.device_mesh == obj.device_mesh
               and cached.placements == obj.placements and cached.shape == obj.shape)
        _refill_tensor(obj.to_local(), cached.to_local())
        return cached
    if isinstance(obj, ShardedTensor):
        if fresh:
            return sharded_tensor_like([LocalShard(_copy_tensor(s.tensor, memo), s.metadata)
                                        for s in obj.local_shards()], obj)
        _check(isinstance(cached, ShardedTensor) and cached.metadata() == obj.metadata()
               and len(cached.local_shards()) == len(obj.local_shards()))
        for src, dst in zip(obj.local_shards(), cached.local_shards()):
            _refill_tensor(src.tensor, dst.tensor)
        return cached
    if isinstance(obj, torch.Tensor):
        if fresh:
            return _copy_tensor(obj, memo)
        _check(isinstance(cached, torch.Tensor) and not isinstance(cached, (DTensor, ShardedTensor)))
        _refill_tensor(obj, cached)
        return cached
    if isinstance(obj, dict):
        _check(fresh or (isinstance(cached, dict) and cached.keys() == obj.keys()))
        return {k: _stage(v, _FRESH if fresh else cached[k], memo) for k, v in obj.items()}
    if isinstance(obj, list) or (isinstance(obj, tuple) and not hasattr(obj, "_fields")):
        kind = list if isinstance(obj, list) else tuple
        _check(fresh or (isinstance(cached, kind) and len(cached) == len(obj)))
        return kind(_stage(v, c, memo) for v, c in zip(obj, [_FRESH] * len(obj) if fresh else cached))
    return copy.deepcopy(obj)


def _check(matches: bool) -> None:
    if not matches:
        raise _Changed


def _copy_tensor(t: torch.Tensor, memo: dict[tuple[Any, ...], torch.Tensor]) -> torch.Tensor:
    t = t.detach()
    key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
    if t.numel() and key in memo:
        return memo[key]
    out = memo[key] = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    out.copy_(t)
    return out


def _refill_tensor(src: torch.Tensor, dst: torch.Tensor) -> None:
    _check(dst.shape == src.shape and dst.dtype == src.dtype)
    dst.copy_(src.detach())
