"""Convert a checkpoint from one format to another (:mod:`tsckpt.conversion.sources`), one tensor at a time.

One tensor of the source is in memory at a time (plus bounded write-behind for tsckpt targets), so
checkpoints larger than RAM convert.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import OptionError, StorageError
from ..progress import progress_bar
from .sources import Options, Sink, open_source
from .targets import TARGETS


class ConversionWarning(UserWarning):
    """The target format cannot hold part of the source (named in the message)."""


@dataclass(frozen=True)
class ConvertResult:
    """What a conversion did: ``tensors`` and ``objects`` count what was written."""

    source_format: str
    target_format: str
    tensors: int
    objects: int
    nbytes: int
    seconds: float
    warnings: tuple[str, ...] = ()

    @property
    def mb_per_s(self) -> float:
        return self.nbytes / 1e6 / self.seconds if self.seconds > 0 else math.inf


def convert(src: Any, dst: Any, *, to: str | None = None, source_format: str | None = None,
            trust_pickle: bool = False, overwrite: bool = False, max_shard_size: int | None = None,
            progress: bool = False, layout: str | None = None) -> ConvertResult:
    """Convert the checkpoint at ``src`` into format ``to`` at ``dst``.

    Args:
        src: a tsckpt checkpoint, DCP FileSystemWriter directory, torch.save file,
            safetensors file or HF sharded safetensors directory (detected).
        dst: the path to write. For ``to="safetensors"`` a path ending in
            ``.safetensors`` is one file; anything else is an HF-style directory
            of shards with ``model.safetensors.index.json``.
        to: one of ``tsckpt``, ``dcp``, ``torch``, ``safetensors``; by default
            chosen from ``dst`` (see :func:`default_target`).
        source_format: skip detection and read ``src`` as this format.
        trust_pickle: allow unpickling that can run code from ``src`` (required
            for DCP sources, whose ``.metadata`` is a pickle).
        overwrite: replace what is at ``dst``.
        max_shard_size: safetensors shard size limit in bytes (implies a directory).
        progress: show a progress bar on stderr.
        layout: storage layout of a tsckpt target, ``"plain"`` or ``"packed"``
            (``None``: ``$TSCKPT_LAYOUT``, else packed).

    Entries the target cannot hold (safetensors: non-tensor values, some dtypes)
    are skipped with a :class:`ConversionWarning` naming them, and listed in
    the result's ``warnings``.
    """
    to = to or default_target(dst, max_shard_size)
    if to not in TARGETS:
        raise OptionError(f"unknown target format {to!r}; expected one of {sorted(TARGETS)}")
    notes: list[str] = []

    def warn(message: str) -> None:
        notes.append(message)
        warnings.warn(message, ConversionWarning, stacklevel=3)

    start = time.perf_counter()
    with open_source(src, format=source_format, trust_pickle=trust_pickle) as source:
        total = sum(i.nbytes for i in source.tensors.values())
        _make_parent(dst)
        with progress_bar(progress, total, f"{source.format} -> {to}") as advance:
            sink = Sink(advance=advance, warn=warn)
            TARGETS[to](source, dst, Options(overwrite, trust_pickle, max_shard_size, layout), sink)
        return ConvertResult(source.format, to, len(source.tensors) - sink.skipped_tensors,
                             len(source.objects) - sink.skipped_objects, total, time.perf_counter() - start,
                             tuple(notes))


def _make_parent(dst: Any) -> None:
    """Create the directory a local ``dst`` goes in, as ``tsckpt.save`` does for its target."""
    if isinstance(dst, Mapping) or "://" in (text := os.fspath(dst)):
        return
    parent = os.path.dirname(os.path.abspath(text))
    try:
        os.makedirs(parent, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        above = [parent, *map(str, Path(parent).parents)][::-1]
        blocker = next((p for p in above if os.path.lexists(p) and not os.path.isdir(p)), parent)
        raise StorageError(f"cannot create the directory {parent} for {text}: {blocker} is a file") from None
    except OSError as e:
        raise StorageError(f"cannot create the directory {e.filename or parent} for {text}: {e.strerror}") from None


def default_target(dst: Any, max_shard_size: int | None = None) -> str:
    """The target format implied by a destination: ``.safetensors`` or a shard size
    means safetensors, ``.pt``/``.pth``/``.bin``/``.ckpt`` torch.save, anything else tsckpt."""
    if isinstance(dst, Mapping):
        return "tsckpt"
    text = os.fspath(dst)
    if text.endswith(".safetensors") or max_shard_size is not None:
        return "safetensors"
    if text.endswith((".pt", ".pth", ".bin", ".ckpt")):
        return "torch"
    return "tsckpt"
