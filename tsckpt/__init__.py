"""tsckpt: PyTorch distributed checkpoints as Zarr v3 arrays written by TensorStore.

The DCP integration (writer, reader, planners, save/load) needs torch and is
imported on first use, so inspecting a checkpoint with numpy alone never
imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    LoadMismatchError,
    MetadataError,
    PlanError,
    TsckptError,
    UnsafeObjectError,
    UnsupportedDtypeError,
)

__version__ = "0.1.0"

_LAZY = {
    "TensorStoreWriter": "storage",
    "TensorStoreReader": "storage",
    "SavePlanner": "planner",
    "LoadPlanner": "planner",
    "save": "api",
    "load": "api",
    "async_save": "api",
}

__all__ = [
    *_LAZY,
    "TsckptError", "IncompleteCheckpointError", "CheckpointNotFoundError", "CheckpointExistsError",
    "MetadataError", "PlanError", "LoadMismatchError", "UnsafeObjectError", "UnsupportedDtypeError",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'tsckpt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
