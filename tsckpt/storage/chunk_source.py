"""Where a committed checkpoint's stored values are, and how this process fetches their bytes.

One :class:`ChunkSource` per open checkpoint (a load, a ``tsckpt.open``
handle, a conversion): the layout's locator (which file and byte range holds
each Zarr key), the fetcher (local files or a kvstore), and the per-rank
digest tables, read once on first use. :mod:`tsckpt.storage.box_reader` plans
every tensor read against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import crc32c as _crc32c
import numpy as np

from ..errors import ChecksumError
from ..format import zarr_json
from ..format.digest_table import DigestTable
from ..format.metadata import CheckpointMetadata, TensorEntry
from .byte_reads import RangeBatch, read_cost
from .fetchers import Fetcher, KvFiles, LocalFiles
from .kvio import storage_error
from .layouts import Locator
from .store import Store, read_error


@dataclass
class ChunkSource:
    """A committed checkpoint's stored values as this process reads them: where each is, and how bytes come."""

    store: Store
    metadata: CheckpointMetadata
    locator: Locator
    fetcher: Fetcher
    #: Which rank saved each chunk and its content hash, by array path and flat index (read on first use).
    _saved: dict[str, dict[int, tuple[int, bytes]]] | None = None

    @classmethod
    def of(cls, store: Store, metadata: CheckpointMetadata) -> ChunkSource:
        locator = store.layout.locator(store, metadata)
        local = store.location.driver == "file" and locator.kvstore is store.kvstore
        fetcher: Fetcher = (LocalFiles(str(store.location.spec.get("path", ".")), locator.sizes()) if local
                            else KvFiles(locator.kvstore, locator.generations()))
        source = cls(store, metadata, locator, fetcher)
        # An index no larger than what a request's latency could fetch is read whole, in one request.
        locator.bind(source.read_ranges, read_cost(store.location).gap_bytes)
        return source

    def _tables(self) -> dict[str, dict[int, tuple[int, bytes]]]:
        """Every rank's digest table, read once: (rank, content hash) of each chunk, by array path and flat index."""
        if self._saved is None:
            self._saved = {}
            files = self.metadata.data_files
            for rank, record in enumerate(files.ranks if files is not None else ()):
                if record.digests is None:
                    continue
                span = record.digests
                what = f"the digest table of rank {rank} in {self.store.url}"
                try:
                    data = self.read_range(span.path, span.offset, span.length)
                except ValueError as e:
                    raise storage_error(e, f"reading {what} failed") from None
                table = DigestTable.decode(data, what)
                for path, chunks in table.by_array().items():
                    self._saved.setdefault(path, {}).update({c: (rank, d) for c, d in chunks.items()})
        return self._saved

    def digests(self, entry: TensorEntry) -> dict[int, bytes]:
        """The content hash each rank recorded for each outer chunk of ``entry``, by flat index."""
        return {flat: digest for flat, (_, digest) in self._tables().get(entry.path, {}).items()}

    def writers(self, entry: TensorEntry) -> dict[int, int]:
        """Which rank saved each outer chunk of ``entry`` (by flat index), from the ranks' digest tables
        (where a save recorded none, from which rank's data file holds it, packed)."""
        files = self.metadata.data_files
        if files is None:
            return {}
        found = self._tables().get(entry.path)
        if found is not None or not files.index:
            return {flat: rank for flat, (rank, _) in (found or {}).items()}
        rank_of = {f.path: r for r, record in enumerate(files.ranks) for f in record.files}
        out = {}
        for flat in range(entry.grid.nchunks):
            index = tuple(int(i) for i in np.unravel_index(flat, entry.grid.grid_shape)) if entry.shape else ()
            where = self.locator.locate(f"{entry.path}/{zarr_json.chunk_key(index)}")
            if where is not None and where.file in rank_of:
                out[flat] = rank_of[where.file]
        return out

    def read_range(self, key: str, offset: int, length: int) -> np.ndarray:
        """``length`` bytes at ``offset`` of file ``key``, read at once."""
        [data] = self.read_ranges([(key, offset, length)])
        return data

    def read_ranges(self, spans: Sequence[tuple[str, int, int]]) -> list[np.ndarray]:
        """The bytes of every ``(file, offset, length)`` of ``spans``, fetched together, merged by the cost model."""
        batch = self.batch()
        slots = [batch.want(key, offset, offset + length) for key, offset, length in spans]
        batch.run()
        return [slot.bytes for slot in slots]

    def batch(self) -> RangeBatch:
        """A new batch of reads, merged by the location's cost model."""
        return RangeBatch(self.fetcher, read_cost(self.store.location))

    def read_blob(self, name: str, path: str) -> bytes:
        """The bytes of value blob ``name`` stored at array ``path``, checked against its crc32c."""
        key = f"{path}/{zarr_json.chunk_key((0,))}"
        where = f"value {name!r} in {self.store.url}"
        try:
            data = self.read_value(key, where)
        except ValueError as e:
            raise read_error(name, self.store.url, e) from None
        body, crc = data[:-4], data[-4:]
        if data.size < 4 or _crc32c.crc32c(body) != int.from_bytes(crc.tobytes(), "little"):
            raise ChecksumError(f"{where}: its blob does not match its stored crc32c (key {key}; the data "
                                f"changed after it was written)")
        return body.tobytes()

    def read_value(self, key: str, what: str) -> np.ndarray:
        """The whole stored value of ``key`` (a value blob's chunk), or a clear error naming ``what``."""
        found = self.locator.locate(key)
        if found is None:
            raise ValueError(f"NOT_FOUND: {what} is missing ({key})")
        if found.inline is not None:
            return np.frombuffer(found.inline, dtype=np.uint8)
        if found.length is None:
            result = self.locator.kvstore.read(found.file).result()
            if result.state != "value":
                raise ValueError(f"NOT_FOUND: {what} is missing ({key})")
            return np.frombuffer(result.value, dtype=np.uint8)
        return self.read_range(found.file, found.offset, found.length)
