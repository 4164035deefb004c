"""Where a committed checkpoint's stored values are, and how this process fetches their bytes.

One :class:`ChunkSource` per open checkpoint (a load, a ``tsckpt.open`` handle, a conversion): the layout's
locator, the fetcher (local files or a kvstore) and the ranks' chunk tables, read as far as lookups need.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import crc32c as _crc32c
import numpy as np

from ..errors import ChecksumError
from ..format import zarr_json
from ..format.metadata import CheckpointMetadata, TensorEntry
from .byte_reads import RangeBatch, ReadCost, read_cost
from .fetchers import Fetcher, KvFiles, LocalFiles
from .locator import Locator, RankTables
from .store import Store, read_error


@dataclass
class ChunkSource:
    """A committed checkpoint's stored values as this process reads them: where each is, and how bytes come."""

    store: Store
    metadata: CheckpointMetadata
    locator: Locator
    fetcher: Fetcher
    tables: RankTables = field(init=False)

    def __post_init__(self) -> None:
        # A table or index no larger than what a request's latency could fetch is read whole, in one request.
        cost = read_cost(self.store.location)
        # Bound to the fetcher, not to this source: the source refers to them, and no cycle keeps it alive.
        read = functools.partial(fetch_spans, self.fetcher, cost)
        self.tables = RankTables(self.metadata.data_files, self.store.url, read, cost.gap_bytes)
        self.locator.bind(read, cost.gap_bytes, self.tables)

    @classmethod
    def of(cls, store: Store, metadata: CheckpointMetadata) -> ChunkSource:
        locator = store.layout.locator(store, metadata)
        local = store.location.driver == "file" and locator.kvstore is store.kvstore
        fetcher: Fetcher = (LocalFiles(str(store.location.spec.get("path", ".")), locator.sizes(),
                                       threads=store.io_concurrency) if local
                            else KvFiles(locator.kvstore, locator.generations()))
        return cls(store, metadata, locator, fetcher)

    def digests(self, entry: TensorEntry) -> dict[int, bytes]:
        """The content hash the writing rank recorded for each outer chunk of ``entry``, by flat index."""
        rows = self.tables.rows(entry, self.metadata.world_size) if self.metadata.content_hash else {}
        return {flat: row["digest"].tobytes() for flat, row in rows.items()}

    def writers(self, entry: TensorEntry) -> dict[int, int]:
        """Which rank saved each outer chunk of ``entry``, by flat index."""
        ranks = entry.writer_ranks(self.metadata.world_size, f"tensor {entry.path!r} in {self.store.url}")
        return dict(enumerate(ranks.tolist()))

    def batch(self) -> RangeBatch:
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
        [data] = fetch_spans(self.fetcher, read_cost(self.store.location), [(found.file, found.offset, found.length)])
        return data


def fetch_spans(fetcher: Fetcher, cost: ReadCost, spans: Sequence[tuple[str, int, int]]) -> list[np.ndarray]:
    """The bytes of every ``(file, offset, length)`` of ``spans``, fetched through ``fetcher`` in one batch."""
    batch = RangeBatch(fetcher, cost)
    slots = [batch.want(key, offset, offset + length) for key, offset, length in spans]
    batch.run()
    return [slot.bytes for slot in slots]
