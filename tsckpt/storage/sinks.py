"""Where one rank's encoded values go in a save (docs/format.md): back to back in its data file, then its chunk
table (packed; on object stores cut into parts, each one object: TensorStore has no multipart upload), or each a
file or object of its own (plain). :meth:`Sink.put` runs on the rank's thread, :meth:`Sink.finish` once after the
last put and returns when everything is durable, :meth:`Sink.abandon` after a failure.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import tensorstore as ts

from ..format import content_hashes
from ..format.data_files import FileRef, RankFiles, Span
from ..format.ocdbt import Ref
from .byte_writes import DEFAULT_PART_BYTES, Blob, Emit, Files, Objects, Value, emit_value, settle

#: A rank's values expected to fill one object of at least this size go into two halves instead, so that the
#: first is on its way while the second is encoded: an upload cannot start before its object is whole.
SPLIT_BYTES = 16 << 20


def data_file(save_id: str, rank: int, part: int | None = None) -> str:
    """The path, relative to the checkpoint, of rank ``rank``'s data file (or its part) in save ``save_id``."""
    return f"d/{save_id}-{rank}" + (f".{part}" if part is not None else "")


def table_file(save_id: str, rank: int) -> str:
    return f"d/{save_id}-{rank}.table"


class Sink:
    """One rank's destination for the values of one save (``packed``: cut into parts of at most ``part_bytes``,
    None: never). With ``hashed`` every value's content hash is taken while it is written: :attr:`digests`."""

    def __init__(self, backend: Files | Objects, save_id: str, rank: int, *, packed: bool, hashed: bool,
                 part_bytes: int | None = None):
        self.backend, self.save_id, self.rank = backend, save_id, rank
        self.packed, self.hashed, self.part_bytes = packed, hashed, part_bytes
        #: The content hash of each value put, in put order (complete once :meth:`finish` calls its table).
        self.digests: list[bytes] = []
        self._refs: list[Ref] = []
        self._parts: list[FileRef] = []  # the data file's parts sent
        self._size = 0  # bytes in the data file (or part) being filled
        #: Where the part being filled is sent: ``part_bytes``, or less for the first half of a split.
        self._limit = part_bytes
        self._pending: list[Future[None]] = []

    @classmethod
    def open(cls, kv: ts.KvStore, local_root: str | None, save_id: str, rank: int, *, packed: bool, sync: bool,
             hashed: bool, threads: int) -> Sink:
        """The sink of rank ``rank``: into files under ``local_root`` where it is a local disk, else into ``kv``."""
        if local_root is None:
            return cls(Objects(kv), save_id, rank, packed=packed, hashed=hashed,
                       part_bytes=DEFAULT_PART_BYTES if packed else None)
        # One thread writes a rank's data file: large sequential writes, while the rank copies from its device.
        return cls(Files(local_root, sync=sync, threads=1 if packed else threads), save_id, rank,
                   packed=packed, hashed=hashed)

    def _path(self) -> str:
        return data_file(self.save_id, self.rank, None if self.part_bytes is None else len(self._parts))

    def put(self, key: str, value: Value, hold: Any = None, background: bool = False) -> Future[None] | None:
        """Store ``value`` under Zarr key ``key``; ``hold`` (its source) stays referenced until it is written.
        ``background``: the caller has other work meanwhile (a device copy), so the write may go to a thread.
        Returns a future done once the value's source is no longer needed (None: it already is)."""
        self.digests.append(b"")
        emit = functools.partial(self._emit, value, slot=len(self.digests) - 1)
        if not self.packed:
            return self._track(self.backend.write(key, value, emit, key=key, background=background, hold=hold))
        if self._size and self._limit is not None and self._size + value.nbytes > self._limit:
            self._send_part()
        at, path = self._size, self._path()
        self._refs.append(Ref(path, at, value.nbytes))
        self._size += value.nbytes
        return self._track(self.backend.write(path, value, emit, at=at, keep_open=True, key=key,
                                              background=background, hold=hold))

    def _track(self, future: Future[None] | None) -> Future[None] | None:
        if future is not None:
            self._pending.append(future)
            if len(self._pending) > 64:  # surface failures early, and keep the list short
                for f in self._pending:
                    if f.done():
                        f.result()
                self._pending = [f for f in self._pending if not f.done()]
        return future

    def _send_part(self) -> None:
        path = self._path()
        self._parts.append(FileRef(path, self._size))
        self.backend.send(path)
        self._size, self._limit = 0, self.part_bytes

    def expect(self, nbytes: int) -> None:
        """Values of about ``nbytes`` in all are about to be put, one after another (a hint; it may be wrong)."""
        total = self._size + nbytes
        if self.packed and self.part_bytes is not None and SPLIT_BYTES <= total <= self.part_bytes:
            self._limit = total // 2

    @property
    def refs(self) -> list[Ref] | None:
        """Where each value put went (in put order, after :meth:`finish`); None where values are keys of their own."""
        return self._refs if self.packed else None

    def finish(self, table: Callable[[], bytes | None]) -> RankFiles:
        """Once every value is written, store the chunk table ``table()`` gives (if any, after a data file's
        values), make everything durable, and say what was written."""
        try:
            for f in self._pending:
                f.result()
            rows = table()
            path, at = (self._path(), self._size) if self.packed else (table_file(self.save_id, self.rank), 0)
            if rows is not None or self.packed:
                written = self.backend.write(path, Blob(rows or b"", checksum=False), at=at, keep_open=self.packed)
                if written is not None:
                    written.result()
            if self.packed:
                self._size += len(rows or b"")
                self._send_part()
            self.backend.finish()
        finally:
            self.backend.close()
        where = None if rows is None else Span(path, at, len(rows))
        gens = self.backend.generations
        return RankFiles(tuple(FileRef(f.path, f.size, gens.get(f.path)) for f in self._parts), where)

    def abandon(self) -> None:
        """After a failure: wait for writes in flight, ignoring their errors, so none outlives its source."""
        settle(self._pending)
        self.backend.close()

    def _emit(self, value: Value, write: Emit, slot: int) -> None:
        """``value``'s bytes to ``write``, its content hash recorded at :attr:`digests` ``[slot]`` when hashed."""
        if not self.hashed:
            return emit_value(value, write)
        state = content_hashes.hasher()

        def tee(view: memoryview) -> None:
            state.update(view)
            write(view)

        emit_value(value, tee)
        self.digests[slot] = state.digest()
