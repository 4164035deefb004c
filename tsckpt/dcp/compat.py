"""DCP's ``FileSystemWriter``/``FileSystemReader`` arguments, turned into tsckpt's own options.

``TensorStoreWriter`` and ``TensorStoreReader`` take every argument DCP's
file-system classes take (torch 2.13 to 2.15), in the same positions; each has
a meaning here, or is refused with a message that says why.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist

from ..errors import OptionError
from ..storage.layouts import PACKED, PLAIN, default_layout, get_layout
from ..storage.context import DEFAULT_IO_CONCURRENCY

#: DCP stream extensions tsckpt honours, by registry name: the Zarr codec that does the same job.
EXTENSION_CODECS: Mapping[str, str] = {"stream.zstd": "zstd"}


def resolve_io_concurrency(thread_count: int | None, io_concurrency: int | None) -> int:
    """The per-rank I/O concurrency from DCP's ``thread_count`` or tsckpt's ``io_concurrency``."""
    for name, value in (("thread_count", thread_count), ("io_concurrency", io_concurrency)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise OptionError(f"{name}={value!r}: expected a whole number >= 1")
    if thread_count is not None and io_concurrency is not None and thread_count != io_concurrency:
        raise OptionError(f"thread_count={thread_count} and io_concurrency={io_concurrency} both set the "
                          "number of concurrent file operations; give one of them")
    return thread_count or io_concurrency or DEFAULT_IO_CONCURRENCY


def resolve_layout(single_file_per_rank: bool | None, layout: str | None) -> str:
    """The storage layout from DCP's ``single_file_per_rank`` or tsckpt's ``layout``."""
    wanted = layout
    if single_file_per_rank is not None:
        implied = PACKED if single_file_per_rank else PLAIN
        if layout is not None and layout != implied:
            raise OptionError(f"single_file_per_rank={single_file_per_rank} means layout={implied!r}, "
                              f"but layout={layout!r} was given; give one of them")
        wanted = implied
    return get_layout(wanted or default_layout()).name


def resolve_compression(extensions: Sequence[Any] | None, compression: str | None) -> str | None:
    """The compression codec from DCP's ``_extensions`` or tsckpt's ``compression``.

    ``ZStandard()`` becomes the Zarr ``zstd`` codec; any other extension is
    refused (arbitrary stream transforms would make arrays Zarr readers cannot decode).
    """
    codecs = []
    for ext in extensions or ():
        name = _registry_name(ext)
        if name not in EXTENSION_CODECS:
            raise OptionError(
                f"_extensions: tsckpt cannot honour {type(ext).__name__} (registry name {name!r}); "
                f"it supports {', '.join(sorted(EXTENSION_CODECS))} (torch's ZStandard()), "
                "which it stores as the Zarr codec of the same name")
        codecs.append(EXTENSION_CODECS[name])
    if len(set(codecs)) > 1:
        raise OptionError(f"_extensions: only one compression codec can be used, got {codecs}")
    implied = codecs[0] if codecs else None
    if implied and compression is not None and compression != implied:
        raise OptionError(f"_extensions={[type(e).__name__ for e in extensions or ()]} means compression={implied!r}, "
                          f"but compression={compression!r} was given; give one of them")
    return implied or compression


def _registry_name(ext: Any) -> str | None:
    try:
        return str(ext.registry_name())
    except Exception:
        return None


def check_serialization_format(serialization_format: Any) -> None:
    """Accept DCP's default ``torch_save`` format (tensors are never pickled here); refuse ``safetensors``."""
    if serialization_format is None:
        return
    value = getattr(serialization_format, "value", serialization_format)
    if value != "torch_save":
        raise OptionError(f"serialization_format={serialization_format!r}: tsckpt writes Zarr v3 arrays, not "
                          "safetensors files; leave serialization_format at its default")


def refuse_rank_local_saves(use_collectives: bool, where: str) -> None:
    """``dcp.save(..., use_collectives=False)`` works in one process; on several ranks it cannot commit."""
    if use_collectives or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return
    raise OptionError(
        f"saving {where}: TensorStoreWriter cannot save with use_collectives=False on "
        f"{dist.get_world_size()} ranks: a tsckpt checkpoint is committed once, by the coordinator, after "
        "every rank's data is written, which needs the ranks to coordinate. Save with use_collectives=True "
        "(the default), or save each rank's state to its own path with no_dist=True")
