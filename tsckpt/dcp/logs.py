"""The one INFO line tsckpt logs per save and per load, on the coordinator.

Messages go to the standard ``logging`` logger named ``"tsckpt"``. Like
torch's own loggers it has no handler of its own, so nothing is printed until
the application configures logging, e.g. ``logging.basicConfig(level="INFO")``
or ``logging.getLogger("tsckpt").setLevel("INFO")`` with a handler.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..format import dtypes
from ..format.metadata import CheckpointMetadata, TensorEntry
from ..format.names import parent_groups
from ..format.reuse import Reuse
from ..wording import count

logger = logging.getLogger("tsckpt")
logger.addHandler(logging.NullHandler())


def enabled() -> bool:
    """Whether the line would be emitted (so callers skip counting when it would not)."""
    return logger.isEnabledFor(logging.INFO)


def log_transfer(verb: str, url: str, *, nbytes: int, seconds: float, files: int, ranks: int,
                 reuse: Reuse | None = None) -> None:
    """``saved 1203765248 bytes to ckpt/step_1000 in 1.310 s (0.919 GB/s), 412 files, 4 ranks``.

    An incremental save adds ``; wrote 12582912 bytes, reused 1191182336 bytes (96 chunks) of
    ckpt/step_900``. The same figures ride on the record as ``record.tsckpt`` (a dict), for
    handlers that want fields.
    """
    rate = nbytes / 1e9 / seconds if seconds > 0 else 0.0
    fields: dict[str, Any] = {"op": verb, "path": url, "bytes": nbytes, "seconds": seconds, "gb_per_s": rate,
                              "files": files, "ranks": ranks}
    tail = ""
    if reuse is not None:
        fields |= {"base": reuse.base, "bytes_written": reuse.bytes_written, "bytes_reused": reuse.bytes_reused}
        tail = (f"; wrote {reuse.bytes_written} bytes, reused {reuse.bytes_reused} bytes "
                f"({reuse.chunks_reused} chunks) of {reuse.base}" + (f" ({reuse.note})" if reuse.note else ""))
    logger.info("%s %d bytes %s %s in %.3f s (%.3f GB/s), %s, %s%s",
                verb, nbytes, "to" if verb == "saved" else "from", url, seconds, rate, count(files, "file"),
                count(ranks, "rank"), tail,
                extra={"tsckpt": fields})


def log_save(url: str, tensors: Mapping[str, TensorEntry], blob_paths: Sequence[str | None],
             blob_sizes: Iterable[int], *, seconds: float, ranks: int, reuse: Reuse | None = None) -> None:
    """The save line: every chunk and blob file, and every ``zarr.json`` (arrays, groups, root)."""
    nbytes = sum(math.prod(e.shape) * dtypes.from_zarr(e.dtype).itemsize for e in tensors.values())
    arrays = [e.path for e in tensors.values()] + [p for p in blob_paths if p]
    nodes = len(arrays) + sum(1 for g in parent_groups(arrays) if g) + 1
    files = sum(e.grid.nchunks for e in tensors.values()) + len(blob_paths) + nodes
    log_transfer("saved", url, nbytes=nbytes + sum(blob_sizes), seconds=seconds, files=files, ranks=ranks,
                 reuse=reuse)


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
