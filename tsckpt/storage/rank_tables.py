"""Each rank's chunk table of one checkpoint (:mod:`tsckpt.format.chunk_table`), as this process reads it: only
the blocks it looks up. One per open checkpoint, shared by its locator and by what reads content hashes.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import numpy as np

from ..errors import MetadataError
from ..format import chunk_table
from ..format.chunk_table import ChunkTable, TableReader
from ..format.data_files import DataFiles
from ..format.metadata import TensorEntry
from .kvio import storage_error
from .locator import ReadSpans


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
        """The ranks whose tables were read (in part or whole)."""
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
