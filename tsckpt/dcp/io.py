"""What the DCP writer and reader share: :class:`TensorStoreIO` (a location whose store is opened on first use,
and dropped when pickled by ``dcp.async_save``'s process mode); DCP's ``FileSystemWriter``/``Reader`` arguments
(torch 2.13 to 2.15) turned into tsckpt's options or refused with why; the one INFO line per save and load, on
the coordinator, to the ``logging`` logger ``"tsckpt"`` (no handler of its own).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import tensorstore as ts
import torch.distributed as dist
from torch.futures import Future

from ..errors import LocationError, OptionError, TsckptError
from ..format import dtypes
from ..format.metadata import CheckpointMetadata, TensorEntry
from ..format.names import parent_groups
from ..format.reuse import Reuse
from ..wording import count
from ..storage.context import DEFAULT_IO_CONCURRENCY
from ..storage.layouts import PACKED, PLAIN, default_layout, get_layout
from ..storage.store import Store
from ..storage.location import Location, LocationLike, parse_location


def done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


class TensorStoreIO:
    """What the writer and reader share: a location and, made on first use, its :class:`Store`."""

    def __init__(self, path: LocationLike | None, io_concurrency: int):
        self.location: Location | None = parse_location(path) if path is not None else None
        self.io_concurrency = io_concurrency
        self._store: Store | None = None
        self._started = time.perf_counter()

    @property
    def checkpoint_id(self) -> str | None:
        return self.location.url if self.location else None

    def _reset(self, checkpoint_id: LocationLike | None) -> None:
        if checkpoint_id is not None:
            location = parse_location(checkpoint_id)
            if location != self.location:
                self.location, self._store = location, None
        if self.location is None:
            raise LocationError("no checkpoint location: pass a path to the constructor or checkpoint_id=")

    @property
    def store(self) -> Store:
        if self._store is None:
            assert self.location is not None
            self._store = self._open_store(self.location)
        return self._store

    def _open_store(self, location: Location) -> Store:
        return Store.open(location, io_concurrency=self.io_concurrency)

    @property
    def context(self) -> ts.Context:
        return self.store.context

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_store": None, "_target": None, "_data_store": None}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: LocationLike) -> bool:
        try:
            parse_location(checkpoint_id)
        except TsckptError:
            return False
        return True


#: DCP stream extensions tsckpt honours, by registry name: the Zarr codec that does the same job.
EXTENSION_CODECS: Mapping[str, str] = {"stream.zstd": "zstd"}


def resolve_io_concurrency(thread_count: int | None, io_concurrency: int | None) -> int:
    for name, value in (("thread_count", thread_count), ("io_concurrency", io_concurrency)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise OptionError(f"{name}={value!r}: expected a whole number >= 1")
    if thread_count is not None and io_concurrency is not None and thread_count != io_concurrency:
        raise OptionError(f"thread_count={thread_count} and io_concurrency={io_concurrency} both set the "
                          "number of concurrent file operations; give one of them")
    return thread_count or io_concurrency or DEFAULT_IO_CONCURRENCY


def resolve_layout(single_file_per_rank: bool | None, layout: str | None) -> str:
    wanted = layout
    if single_file_per_rank is not None:
        implied = PACKED if single_file_per_rank else PLAIN
        if layout is not None and layout != implied:
            raise OptionError(f"single_file_per_rank={single_file_per_rank} means layout={implied!r}, "
                              f"but layout={layout!r} was given; give one of them")
        wanted = implied
    return get_layout(wanted or default_layout()).name


def resolve_compression(extensions: Sequence[Any] | None, compression: str | None) -> str | None:
    """``ZStandard()`` in DCP's ``_extensions`` is Zarr's ``zstd``; other extensions are refused (Zarr can't decode)."""
    codecs = []
    for ext in extensions or ():
        try:
            name = str(ext.registry_name())
        except Exception:
            name = None
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


logger = logging.getLogger("tsckpt")
logger.addHandler(logging.NullHandler())


def logging_on() -> bool:
    return logger.isEnabledFor(logging.INFO)


def log_transfer(verb: str, url: str, *, nbytes: int, seconds: float, files: int, ranks: int,
                 reuse: Reuse | None = None) -> None:
    """``saved 1203765248 bytes to ckpt/step_1000 in 1.310 s (0.919 GB/s), 412 files, 4 ranks``; an incremental
    save adds ``; wrote 12582912 bytes, reused 1191182336 bytes (96 chunks) of ckpt/step_900``. The figures
    ride on the record as ``record.tsckpt`` (a dict)."""
    rate = nbytes / 1e9 / seconds if seconds > 0 else 0.0
    fields: dict[str, Any] = {"op": verb, "path": url, "bytes": nbytes, "seconds": seconds, "gb_per_s": rate,
                              "files": files, "ranks": ranks}
    tail = ""
    if reuse is not None:
        fields |= {"base": reuse.base, "bytes_written": reuse.bytes_written, "bytes_reused": reuse.bytes_reused}
        tail = (f"; wrote {reuse.bytes_written} bytes, reused {reuse.bytes_reused} bytes "
                f"({reuse.chunks_reused} chunks) of {reuse.base}" + (f" ({reuse.note})" if reuse.note else ""))
    where = "to" if verb == "saved" else "from"
    logger.info("%s %d bytes %s %s in %.3f s (%.3f GB/s), %s, %s%s", verb, nbytes, where, url, seconds, rate,
                count(files, "file"), count(ranks, "rank"), tail, extra={"tsckpt": fields})


def log_save(url: str, tensors: Mapping[str, TensorEntry], blob_paths: Sequence[str | None],
             blob_sizes: Iterable[int], *, seconds: float, ranks: int, reuse: Reuse | None = None) -> None:
    """The save line: every chunk and blob file, and every ``zarr.json`` (arrays, groups, root)."""
    nbytes = sum(math.prod(e.shape) * dtypes.from_zarr(e.dtype).itemsize for e in tensors.values())
    arrays = [e.path for e in tensors.values()] + [p for p in blob_paths if p]
    nodes = len(arrays) + sum(1 for g in parent_groups(arrays) if g) + 1
    files = sum(e.grid.nchunks for e in tensors.values()) + len(blob_paths) + nodes
    log_transfer("saved", url, nbytes=nbytes + sum(blob_sizes), seconds=seconds, files=files, ranks=ranks, reuse=reuse)


def load_totals(metadata: CheckpointMetadata, plans: Sequence[Any]) -> tuple[int, int]:
    """Bytes and files every rank's load plan reads: chunk and blob files, their ``zarr.json``, the root."""
    nbytes = 0
    cells: dict[str, set[tuple[int, ...]]] = {}
    blobs: set[str] = set()
    for plan in plans:
        for item in plan.items:
            fqn = item.storage_index.fqn
            entry = metadata.tensors.get(fqn)
            if entry is None:
                if metadata.objects[fqn].path is not None:
                    blobs.add(fqn)
                continue
            nbytes += math.prod(item.lengths) * dtypes.from_zarr(entry.dtype).itemsize
            box = [slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths)]
            cells.setdefault(fqn, set()).update(entry.grid.chunks_overlapping(box))
    files = sum(len(c) for c in cells.values()) + 2 * len(blobs) + len(cells) + 1
    return nbytes, files
