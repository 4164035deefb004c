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
    ChecksumError,
    ConcurrentSaveError,
    ConversionError,
    DamagedValueError,
    FileInTheWayError,
    ForeignContentError,
    IncompleteCheckpointError,
    LoadMismatchError,
    LocationError,
    MetadataError,
    NotACheckpointError,
    OptionError,
    PlanError,
    SaveFailedError,
    StorageError,
    TsckptError,
    UnsafeObjectError,
    UnsupportedDtypeError,
    UnsupportedVersionError,
)

__version__ = "0.2.0"

try:
    # zarr-python reads bfloat16/float8 arrays only once these types are registered, and 3.1 lists the
    # entry points tsckpt declares for them without loading them.
    from .format.zarr_dtypes import register as _register_zarr_dtypes
except ImportError:  # zarr missing or incompatible: tsckpt itself does not need it
    pass
else:
    _register_zarr_dtypes()

_LAZY = {
    "TensorStoreWriter": "dcp.storage",
    "TensorStoreReader": "dcp.reader",
    "SavePlanner": "dcp.planner",
    "LoadPlanner": "dcp.load_planner",
    "save": "dcp.api",
    "load": "dcp.api",
    "async_save": "dcp.api",
    "Stager": "dcp.staging",
    "convert": "conversion.convert",
    "diff": "conversion.diff",
    "CheckpointBuilder": "conversion.builder",
    # torch-free: reading a checkpoint into numpy never imports torch
    "open": "read.checkpoint",
    "Checkpoint": "read.checkpoint",
    "TensorHandle": "read.checkpoint",
    "verify": "read.verify",
    "zarr_store": "read.zarr_store",
    # torch-free chores on a directory of step checkpoints
    "latest": "steps",
    "prune": "steps",
    "clean": "commit.protocol",
    "leftovers": "commit.protocol",
}

__all__ = [
    *_LAZY,
    "TsckptError", "IncompleteCheckpointError", "CheckpointNotFoundError", "CheckpointExistsError",
    "ForeignContentError", "FileInTheWayError", "ConcurrentSaveError", "NotACheckpointError",
    "MetadataError", "UnsupportedVersionError", "PlanError", "LoadMismatchError", "UnsafeObjectError",
    "UnsupportedDtypeError", "ChecksumError", "DamagedValueError", "StorageError", "OptionError", "LocationError",
    "ConversionError", "SaveFailedError",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'tsckpt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
