"""The plain layout's sinks: each value a file or an object of its own, the chunk table one more.

The :class:`~tsckpt.storage.sinks.Sink` contract (which method runs where, and
when) is in :mod:`tsckpt.storage.sinks`, with the packed layout's sinks.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import tensorstore as ts

from ..format.data_files import RankFiles, Span
from . import chunk_files
from .context import DEFAULT_IO_CONCURRENCY
from .sinks import Blob, Sink, Value, table_file, settle


class KeyFiles(Sink):
    """The plain layout on a local disk: each value a file of its own (:class:`~tsckpt.storage.chunk_files.ChunkFileWriter`)."""

    def __init__(self, root: str, save_id: str, rank: int, *, sync: bool, hashed: bool,
                 threads: int = DEFAULT_IO_CONCURRENCY):
        super().__init__(hashed)
        self.root, self.save_id, self.rank = root, save_id, rank
        self._writer = chunk_files.ChunkFileWriter(sync=sync, threads=threads)
        self._pending: list[Future[None]] = []

    def put(self, key: str, value: Value, hold: Any = None, background: bool = False) -> Future[None]:
        at = self._slot()
        future = self._writer.write(os.path.join(self.root, key), value, key,
                                    lambda v, w: self._emit(v, w, at))
        self._pending.append(future)
        return future

    def finish(self, table: Callable[[], bytes | None]) -> RankFiles:
        for f in self._pending:
            f.result()
        rows, where = table(), None
        if rows is not None:
            path = table_file(self.save_id, self.rank)
            self._writer.write(os.path.join(self.root, path), Blob(rows, checksum=False), path).result()
            where = Span(path, 0, len(rows))
        self._writer.finish()
        return RankFiles((), where)

    def abandon(self) -> None:
        settle(self._pending)
        self._writer.close()


class KeyObjects(Sink):
    """The plain layout on object stores and in memory: each value an object of its own."""

    def __init__(self, kv: ts.KvStore, save_id: str, rank: int, *, hashed: bool):
        super().__init__(hashed)
        self.kv, self.save_id, self.rank = kv, save_id, rank
        self._pending: list[Any] = []
        self._lock = threading.Lock()

    def put(self, key: str, value: Value, hold: Any = None,
            background: bool = False) -> None:  # copied at once: nothing to wait for
        out = bytearray()
        self._emit(value, out.extend, self._slot())
        self._pending.append(self.kv.write(key, bytes(out)))

    def finish(self, table: Callable[[], bytes | None]) -> RankFiles:
        rows, where = table(), None
        if rows is not None:
            path = table_file(self.save_id, self.rank)
            self._pending.append(self.kv.write(path, rows))
            where = Span(path, 0, len(rows))
        for f in self._pending:
            f.result()
        return RankFiles((), where)

    def abandon(self) -> None:
        settle(self._pending)
