"""Where a committed checkpoint's values are: what a layout's locator answers, :meth:`Locator.prefetch` with every
key a read needs, then :meth:`Locator.locate` for each.

A packed checkpoint's chunks and blobs are found in the chunk tables of the ranks that wrote them (the writers
its metadata records), so a reader reads only the table blocks holding the chunks it reads, never anything that
grows with ranks x tensors; the B+tree (:mod:`tsckpt.storage.packed`) answers the other keys (documents).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import tensorstore as ts

from ..errors import MetadataError, TsckptError
from ..format import chunk_table, object_values, ocdbt
from ..format.chunk_table import ChunkTable, TableReader
from ..format.data_files import DataFiles
from ..format.metadata import CheckpointMetadata, TensorEntry
from .context import OpenedLocation
from .kvio import storage_error
from .packed import BTreeIndex

#: Reads ``(file, offset, length)`` spans, all at once, merged by the reader's cost model: their bytes, in order.
ReadSpans = Callable[[Sequence[tuple[str, int, int]]], list[np.ndarray]]


@dataclass(frozen=True)
class Located:
    """Where a key's value is: ``length`` bytes (None: the whole file) at ``offset`` of file ``file``,
    relative to the checkpoint, or ``inline`` bytes (the value itself)."""

    file: str
    offset: int = 0
    length: int | None = None
    inline: bytes | None = None


class Locator(ABC):
    """A committed checkpoint's keys, as a reader finds them (see :meth:`KvLayout.locator`)."""

    #: The kvstore files are read from: the location's own.
    kvstore: ts.KvStore

    @abstractmethod
    def locate(self, key: str) -> Located | None:
        """Where ``key`` (relative to the checkpoint) is stored; None if the checkpoint has no such key."""

    def prefetch(self, keys: Iterable[str]) -> None:
        """Find ``keys`` together, so that each :meth:`locate` of them after reads nothing more. A failed lookup is
        raised by :meth:`locate` of each key it was for, never here."""

    def bind(self, read: ReadSpans, whole_up_to: int, tables: RankTables | None = None) -> None:
        """Read what locating needs (``tables``, index nodes) through ``read``, merged with the reader's other
        ranges (a table or index of at most ``whole_up_to`` bytes whole)."""

    def everything(self) -> Mapping[str, Located]:
        """Every key of an index and where its value is, every node read and checked (``verify``)."""
        return {}

    def sizes(self) -> Mapping[str, int]:
        """Files whose size is known from the root document: a file of another size is damaged."""
        return {}

    def generations(self) -> Mapping[str, bytes]:
        """Objects whose generation (ETag) the root document records: read as another generation, damaged."""
        return {}


class RankTables:
    """The chunk tables of a checkpoint whose data files are ``files``, read through ``read`` (a table of at
    most ``whole_up_to`` bytes at once); ``url`` names the checkpoint in errors."""

    def __init__(self, files: DataFiles | None, url: str, read: ReadSpans, whole_up_to: int):
        self.files, self.url = files, url
        self._read, self._whole_up_to = read, whole_up_to
        self._readers: dict[int, TableReader] = {}

    def reader(self, rank: int) -> TableReader:
        """Rank ``rank``'s table, as read so far."""
        if rank not in self._readers:
            ranks = self.files.ranks if self.files is not None else ()
            span = ranks[rank].table if 0 <= rank < len(ranks) else None
            if span is None:
                raise MetadataError(f"{self.url}: rank {rank} saved chunks but recorded no chunk table")
            self._readers[rank] = TableReader(span.length, f"the chunk table of rank {rank} in {self.url}/{span.path}",
                                              self._whole_up_to)
        return self._readers[rank]

    @property
    def ranks_read(self) -> list[int]:
        return sorted(self._readers)

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self._readers.values())

    def look_up(self, wanted: Mapping[int, Collection[tuple[int, int]]]) -> dict[int, ChunkTable]:
        """The rows holding each rank's keys (``(array key, chunk)``), every table's reads together."""
        assert self.files is not None
        readers = {self.reader(rank): rank for rank in wanted}

        def read(parts: Sequence[tuple[TableReader, int, int]]) -> list[np.ndarray]:
            spans = []
            for reader, offset, length in parts:
                span = self.files.ranks[readers[reader]].table
                assert span is not None
                spans.append((span.path, span.offset + offset, length))
            return self._read(spans)

        try:
            found = chunk_table.look_up({r: wanted[rank] for r, rank in readers.items()}, read)
        except ValueError as e:  # how the stores report a missing, cut or replaced file
            tables = ", ".join(r.where for r in readers)
            raise storage_error(e, f"reading {tables} failed") from None
        return {rank: found[r] for r, rank in readers.items()}

    def everything(self, rank: int) -> ChunkTable:
        """Every row of rank ``rank``'s table, every block read and checked."""
        self.look_up({rank: ()})  # its front: where the blocks begin
        return self.look_up({rank: self.reader(rank).every_key()})[rank]

    def rows(self, entry: TensorEntry, world_size: int) -> dict[int, np.void]:
        """Every row the writers' tables hold for ``entry``'s outer chunks, by flat index."""
        ranks = entry.writer_ranks(world_size, f"tensor at {entry.path!r}")
        key = chunk_table.array_key(entry.path)
        wanted: dict[int, list[tuple[int, int]]] = {}
        for flat, rank in enumerate(ranks.tolist()):
            wanted.setdefault(rank, []).append((key, flat))
        out = {}
        for rank, rows in self.look_up(wanted).items():
            for _, flat in wanted[rank]:
                row = rows.get_key(key, flat)
                if row is not None:
                    out[flat] = row
        return out


def _chunk_index(name: str) -> tuple[int, ...] | None:
    """The grid index a chunk key's last part names (``c``, ``c.1.0``); None for any other name."""
    parts = name.split(".")
    if parts[0] != "c" or not all(p.isdigit() for p in parts[1:]):
        return None
    return tuple(int(p) for p in parts[1:])


def _located(v: bytes | ocdbt.Ref) -> Located:
    return Located(v.path, v.offset, v.length) if isinstance(v, ocdbt.Ref) else Located("", inline=v)


class PackedLocator(Locator):
    """A packed checkpoint's values, found through its ranks' chunk tables (its documents through its index)."""

    def __init__(self, store: OpenedLocation, metadata: CheckpointMetadata):
        assert metadata.data_files is not None
        self.kvstore = store.kvstore
        self.metadata = metadata
        self.files = metadata.data_files
        self._url = store.url
        self._read: ReadSpans = self._read_one_by_one
        self._whole_up_to = 0
        self.tables = RankTables(self.files, self._url, self._read, 0)
        self._index: BTreeIndex | None = None
        self._found: dict[str, Located | None] = {}
        self._failed: dict[str, Exception] = {}
        self._allowed = frozenset(f.path for f in self.files.files)
        self._arrays: dict[str, TensorEntry | int] = {e.path: e for e in metadata.tensors.values()}
        self._arrays |= {o.path: o.writer for o in metadata.objects.values()
                         if o.encoding == object_values.TORCH and o.path is not None and o.writer is not None}

    def bind(self, read: ReadSpans, whole_up_to: int, tables: RankTables | None = None) -> None:
        self._read, self._whole_up_to = read, whole_up_to
        self.tables = tables if tables is not None else RankTables(self.files, self._url, read, whole_up_to)
        self._index = None

    def prefetch(self, keys: Iterable[str]) -> None:
        """Look ``keys`` up: chunks and blobs in their writers' tables, documents in the index."""
        wanted: dict[int, dict[str, tuple[int, int]]] = {}  # rank -> key -> (array key, chunk)
        documents = []
        decoded: dict[str, np.ndarray] = {}
        for key in keys:
            if key in self._found:
                continue
            path, _, name = key.rpartition("/")
            target = self._arrays.get(path)
            index = _chunk_index(name)
            if target is None or index is None:
                documents.append(key)
                continue
            if isinstance(target, int):  # a value blob: its one chunk
                flat, rank = (0, target) if index == (0,) else (None, None)
            else:
                grid = target.grid.grid_shape
                inside = len(index) == len(grid) and all(0 <= i < g for i, g in zip(index, grid))
                flat = target.grid.flat_index(index) if inside else None
                if flat is not None:
                    if path not in decoded:
                        decoded[path] = target.writer_ranks(self.metadata.world_size, f"tensor at {path!r}")
                    rank = int(decoded[path][flat])
            if flat is None or rank is None:
                self._found[key] = None
                continue
            wanted.setdefault(rank, {})[key] = (chunk_table.array_key(path), flat)
        # A failed lookup is raised where each key it was for is located, so that its reader names its tensor.
        if wanted:
            try:
                self._look_up(wanted)
            except (ValueError, TsckptError) as e:
                self._failed.update((k, e) for keys in wanted.values() for k in keys)
        if documents:
            try:
                self._look_up_documents(documents)
            except (ValueError, TsckptError) as e:
                self._failed.update((k, e) for k in documents)

    def locate(self, key: str) -> Located | None:
        if key not in self._found and key not in self._failed:
            self.prefetch((key,))
        if key in self._failed:
            raise self._failed[key]
        return self._found[key]

    def everything(self) -> Mapping[str, Located]:
        index = self._tree()
        return {k: _located(v) for k, v in (index.everything() if index is not None else {}).items()}

    def sizes(self) -> Mapping[str, int]:
        return {f.path: f.size for f in self.files.files}

    def generations(self) -> Mapping[str, bytes]:
        return {f.path: bytes.fromhex(f.generation) for f in self.files.files if f.generation is not None}

    def _look_up(self, wanted: Mapping[int, Mapping[str, tuple[int, int]]]) -> None:
        found = self.tables.look_up({rank: list(keys.values()) for rank, keys in wanted.items()})
        for rank, keys in wanted.items():
            rows = found[rank]
            for key, (array, chunk) in keys.items():
                row = rows.get_key(array, chunk)
                if row is None:
                    self._found[key] = None
                    continue
                path = rows.files[int(row["file"])]
                if path not in self._allowed:
                    raise MetadataError(f"{self.tables.reader(rank).where}: a value is stored in {path!r}, which "
                                        "is not one of the checkpoint's data files")
                self._found[key] = Located(path, int(row["offset"]), int(row["length"]))

    def _look_up_documents(self, documents: Sequence[str]) -> None:
        index = self._tree()
        if index is None:
            self._found.update((k, None) for k in documents)
            return
        index.lookup(documents)
        self._found.update((k, None if index.values[k] is None else _located(index.values[k])) for k in documents)

    def _tree(self) -> BTreeIndex | None:
        if self._index is None and self.files.index is not None:
            self._index = BTreeIndex(self.files.index, self._read, self._allowed, f"the index of {self._url}",
                                     self._whole_up_to)
        return self._index

    def _read_one_by_one(self, spans: Sequence[tuple[str, int, int]]) -> list[np.ndarray]:
        """Spans read through the kvstore, one request each (a locator no reader has bound)."""
        out = []
        for path, offset, length in spans:
            try:
                result = self.kvstore.read(path, byte_range=slice(offset, offset + length)).result()
            except ValueError as e:
                raise storage_error(e, f"reading {self._url}/{path} failed") from None
            if result.state != "value":
                raise MetadataError(f"{self._url}/{path} is missing")
            out.append(np.frombuffer(result.value, dtype=np.uint8))
        return out
