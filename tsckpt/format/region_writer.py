"""One rank's writes of array regions: encoded shards through the kvstore, or TensorStore's array driver.

Arrays with inner chunks and uncompressed data (the default) are encoded by
:mod:`tsckpt.format.shards`, which also yields each inner chunk's crc32c, and
written as whole chunk keys (through a ``uint8`` view of them,
:func:`~tsckpt.format.spec.raw_chunks_metadata`); every other array is
written through TensorStore's ``zarr3`` driver, and its checksums are computed
from the source by the caller.
The DCP writer and :class:`~tsckpt.conversion.builder.CheckpointBuilder` both
write through a :class:`RegionWriter`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import tensorstore as ts

from . import shards, zarr_json
from .batch import RankBatch
from .metadata import ArrayOptions, TensorEntry
from .spec import Store


@dataclass(frozen=True)
class Written:
    """Writes started for one region: their futures, and, when the region was encoded here, its checksums.

    ``pieces``/``crcs``: flat indices in the array's checksum grid and their
    crc32c (None: the caller computes them from the source). ``nbytes``:
    bytes of encoded copies the futures keep alive (0 when the source itself is written).
    """

    futures: tuple[ts.Future, ...]
    pieces: np.ndarray | None = None
    crcs: tuple[int, ...] | None = None
    nbytes: int = 0


class RegionWriter:
    """Writes regions of ``entries``' arrays for rank ``rank`` of a save, through ``batch``.

    Every array (or chunk kvstore) is opened at construction, concurrently.
    """

    def __init__(self, store: Store, entries: Mapping[str, TensorEntry], options: ArrayOptions, rank: int,
                 batch: RankBatch):
        self.batch = batch
        self.entries = entries
        self.formats = {fqn: shards.shard_format(e, options) for fqn, e in entries.items()}
        self.opened = {fqn: self._open(store, e, self.formats[fqn], options, rank) for fqn, e in entries.items()}

    @staticmethod
    def _open(store: Store, entry: TensorEntry, fmt: shards.ShardFormat | None, options: ArrayOptions,
              rank: int) -> ts.Future:
        if fmt is None:
            return store.create(entry.path, zarr_json.tensor_metadata(entry, options), rank)
        return store.create_raw(entry.path, entry.grid.grid_shape, fmt.nbytes, rank)

    def write(self, fqn: str, offsets: Sequence[int], source: np.ndarray) -> Written:
        """Start writing ``source`` (a region aligned to outer chunks) at ``offsets`` of ``fqn``'s array."""
        entry, fmt = self.entries[fqn], self.formats[fqn]
        target = self.batch.bind(self.opened[fqn].result())
        if fmt is None:
            box = tuple(slice(o, o + n) for o, n in zip(offsets, source.shape))
            return Written((target[box].write(source, can_reference_source_data_indefinitely=True),))
        futures, pieces, crcs, nbytes = [], [], [], 0
        for index, data, flat, chunk_crcs in shards.encode_region(fmt, entry.shape, offsets, source):
            at = (*index[:-1], slice(index[-1] * fmt.nbytes, (index[-1] + 1) * fmt.nbytes))
            futures.append(target[at].write(data, can_reference_source_data_indefinitely=True))
            pieces.append(flat)
            crcs += chunk_crcs
            nbytes += data.nbytes
        joined = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
        return Written(tuple(futures), joined, tuple(crcs), nbytes)
