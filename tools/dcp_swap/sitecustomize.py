"""Swap DCP's FileSystemWriter/FileSystemReader for tsckpt's classes in every process of a test run.

``tools/pytorch_dcp_suite.py`` puts this folder first on ``PYTHONPATH``, so Python
imports this module at start-up in the pytest process and in every rank that
PyTorch's test harness spawns: they all see the same swap. Nothing happens
unless one of these variables is set:

``TSCKPT_DCP_SWAP``
    ``exact``: the DCP names *are* ``tsckpt.TensorStoreWriter`` / ``TensorStoreReader``,
    called with the arguments exactly as the tests pass them.
    ``path``: tsckpt's classes built from the path alone (every other argument dropped).
    ``path-overwrite``: the path plus ``overwrite`` as DCP would resolve it (default True).
``TSCKPT_DCP_CPU=1``
    Run GPU-only tests on CPU when no CUDA device exists: ``.cuda()`` on modules and
    tensors returns them unchanged and ``skip_if_lt_x_gpu`` lets CPU runs through.
    The runner applies this to the DCP baseline too, so both sides run the same code.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any

_NAMES = ("FileSystemWriter", "FileSystemReader")
# Modules that subclass DCP's classes must be imported before the swap, so
# their base classes stay DCP's own.
_IMPORT_FIRST = (
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint._storage_utils",
    "torch.distributed.checkpoint.format_utils",
    "torch.distributed.checkpoint.hf_storage",
    "torch.distributed.checkpoint._fsspec_filesystem",
)


def _dcp_arguments(cls: type, path: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments a DCP constructor call binds to, defaults included."""
    bound = inspect.signature(cls.__init__).bind(None, path, *args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _replacements(mode: str, originals: dict[str, type]) -> dict[str, type]:
    import tsckpt

    writer, reader = tsckpt.TensorStoreWriter, tsckpt.TensorStoreReader
    if mode == "exact":
        return {"FileSystemWriter": writer, "FileSystemReader": reader}
    if mode not in ("path", "path-overwrite"):
        raise SystemExit(f"TSCKPT_DCP_SWAP={mode!r}: expected exact, path or path-overwrite")
    keep_overwrite = mode == "path-overwrite"

    class PathWriter(writer):  # type: ignore[misc, valid-type]
        def __init__(self, path: Any = None, *args: Any, **kwargs: Any) -> None:
            options = {}
            if keep_overwrite:
                options["overwrite"] = _dcp_arguments(originals["FileSystemWriter"], path, args, kwargs)["overwrite"]
            super().__init__(path, **options)

    class PathReader(reader):  # type: ignore[misc, valid-type]
        def __init__(self, path: Any = None, *args: Any, **kwargs: Any) -> None:
            super().__init__(path)

    return {"FileSystemWriter": PathWriter, "FileSystemReader": PathReader}


def _swap(mode: str) -> None:
    for name in _IMPORT_FIRST:
        try:
            importlib.import_module(name)
        except ImportError:  # optional dependencies (fsspec) may be missing
            pass
    fs = sys.modules["torch.distributed.checkpoint.filesystem"]
    originals = {name: getattr(fs, name) for name in _NAMES}
    new = _replacements(mode, originals)
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith("torch.distributed.checkpoint"):
            continue
        for name in _NAMES:
            if getattr(module, name, None) is originals[name]:
                setattr(module, name, new[name])


def _adapt_to_cpu() -> None:
    import torch

    if torch.cuda.is_available():
        return
    torch.nn.Module.cuda = lambda self, device=None: self  # type: ignore[method-assign]
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    from torch.testing._internal import common_distributed

    gpu_only = common_distributed.skip_if_lt_x_gpu

    def skip_if_lt_x_gpu(x: int, *, allow_cpu: bool = True) -> Any:
        return gpu_only(x, allow_cpu=allow_cpu)

    common_distributed.skip_if_lt_x_gpu = skip_if_lt_x_gpu
    # common_dtensor re-exports the decorator under its own name.
    from torch.testing._internal.distributed._tensor import common_dtensor

    common_dtensor.skip_if_lt_x_gpu = skip_if_lt_x_gpu


def _install() -> None:
    if os.environ.get("TSCKPT_DCP_CPU") == "1":
        _adapt_to_cpu()
    mode = os.environ.get("TSCKPT_DCP_SWAP")
    if mode:
        _swap(mode)


_install()
