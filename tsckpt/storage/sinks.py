"""Where one rank's encoded values go in a save: a data file of its own, or a file or object per key.

Every save writes through one path: the rank encodes each outer chunk (or
value blob) as a :class:`Value`, which knows its stored size and emits its
bytes in order, and hands it to its :class:`Sink` with the Zarr key it is
stored under. The layout decides the sink:

* :class:`RankFile`, the packed layout on a local disk: every value back to
  back in one file, ``d/<save id>-<rank>``, written by one thread in large
  sequential writes, its writeback started as it goes and one ``fsync`` at
  the end; where each value landed is reported for the index.
* :class:`RankObjects`, the packed layout on object stores: values back to
  back in parts of at most ``part_bytes``, each part one object
  ``d/<save id>-<rank>.<part>`` written in one request (TensorStore has no
  multipart upload), two parts in memory at most.
* :class:`~tsckpt.storage.key_sinks.KeyFiles` and
  :class:`~tsckpt.storage.key_sinks.KeyObjects`, the plain layout: one file or
  object per key.

Each rank also stores its chunk table (:mod:`tsckpt.format.chunk_table`):
at the end of its data file, or as ``d/<save id>-<rank>.table``.
Which method runs where: :meth:`Sink.put` on the rank's thread, in any order;
:meth:`Sink.finish` once, after the last put, returns when everything is
durable; :meth:`Sink.abandon` after a failure.
"""

from __future__ import annotations

import functools
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import crc32c as _crc32c
import numpy as np
import tensorstore as ts

from ..format import content_hashes
from ..format.data_files import FileRef, RankFiles, Span
from ..format.ocdbt import Ref
from . import chunk_files, localfs
from .chunk_files import WriteFailed

#: A writer's scratch buffers: ``get(n)`` returns ``n`` reusable bytes.
Scratch = Callable[[int], np.ndarray]
Emit = Callable[[memoryview], None]

#: Bytes written to a rank's data file between two starts of its writeback: the disk works while
#: the rank encodes, and the final fsync waits for the last stretch only.
WRITEBACK_BYTES = 64 << 20
#: The largest object a rank writes on an object store (one PUT, held in memory until sent).
DEFAULT_PART_BYTES = 1 << 30
#: A rank's values expected to fill one object of at least this size go into two halves instead, so that the
#: first is on its way while the second is encoded: an upload cannot start before its object is whole.
SPLIT_BYTES = 16 << 20


class Value(ABC):
    """One stored value: its size, known before it is written, and its bytes, emitted in order."""

    nbytes: int

    @abstractmethod
    def emit(self, write: Emit, scratch: Scratch) -> None:
        """Pass the value's bytes to ``write`` in order (each part valid only during its call)."""


@dataclass
class Blob(Value):
    """Bytes stored as they are, followed by their crc32c (a value blob's one chunk, a chunk table)."""

    payload: bytes | memoryview | np.ndarray
    checksum: bool = True

    def __post_init__(self) -> None:
        self.nbytes = memoryview(self.payload).nbytes + (4 if self.checksum else 0)

    def emit(self, write: Emit, scratch: Scratch) -> None:
        view = memoryview(self.payload).cast("B")
        write(view)
        if self.checksum:
            write(memoryview(_crc32c.crc32c(view).to_bytes(4, "little")))


def data_file(save_id: str, rank: int, part: int | None = None) -> str:
    """The path, relative to the checkpoint, of rank ``rank``'s data file (or its part) in save ``save_id``."""
    return f"d/{save_id}-{rank}" + (f".{part}" if part is not None else "")


def table_file(save_id: str, rank: int) -> str:
    """Where the plain layout keeps a rank's chunk table."""
    return f"d/{save_id}-{rank}.table"


class Sink(ABC):
    """One rank's destination for the values of one save; see the module docstring.

    With ``hashed`` (the save records content hashes) every value's content
    hash (:func:`~tsckpt.format.content_hashes.hasher`, over the bytes stored)
    is taken while it is written, from the same buffers: :attr:`digests`.
    """

    def __init__(self, hashed: bool):
        self.hashed = hashed
        #: The content hash of each value put, in put order (complete once :meth:`finish` calls its table).
        self.digests: list[bytes] = []

    @abstractmethod
    def put(self, key: str, value: Value, hold: Any = None, background: bool = False) -> Future[None] | None:
        """Store ``value`` under Zarr key ``key``; ``hold`` (its source) stays referenced until it is written.

        ``background``: the caller has other work meanwhile (a device copy to
        make), so the write may go to a thread of the sink's. Returns a future
        done once the value's source is no longer needed (None: it already is).
        """

    @abstractmethod
    def finish(self, table: Callable[[], bytes | None]) -> RankFiles:
        """Once every value is written, store the chunk table ``table()`` gives (if any), make everything
        durable, and say what was written."""

    @property
    def refs(self) -> list[Ref] | None:
        """Where each value put went (in put order, after :meth:`finish`); None where values are keys of their own."""
        return None

    def expect(self, nbytes: int) -> None:
        """Values of about ``nbytes`` in all are about to be put, one after another (a hint; it may be wrong)."""

    def abandon(self) -> None:
        """After a failure: wait for writes in flight, ignoring their errors, so none outlives its source."""

    def _emit(self, value: Value, write: Emit, at: int) -> None:
        """``value``'s bytes to ``write``, its content hash recorded at :attr:`digests` ``[at]`` when hashed."""
        with chunk_files.scratch() as get:
            if not self.hashed:
                value.emit(write, get)
                return
            state = content_hashes.hasher()

            def tee(view: memoryview) -> None:
                state.update(view)
                write(view)

            value.emit(tee, get)
        self.digests[at] = state.digest()

    def _slot(self) -> int:
        self.digests.append(b"")
        return len(self.digests) - 1


def settle(futures: list[Any]) -> None:
    """After a failure: wait for every write in ``futures``, ignoring their errors (the failure that got here is
    the one reported), so that none outlives its source."""
    for f in futures:
        try:
            f.result()
        except Exception:  # noqa: BLE001 - see above
            pass


def _write_all(fd: int, at: list[int], view: memoryview) -> None:
    """Write ``view`` at offset ``at[0]`` of ``fd`` (advanced past it): positional, so values written by
    several threads into one file cannot interleave."""
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], at[0] + done)
    at[0] += len(view)


class RankFile(Sink):
    """The packed layout on a local disk: every value back to back in one file.

    A value's place in the file is fixed when it is put, so values are
    written where they go whatever the order: on the rank's own thread
    (sources in host memory: no thread to hand them to, as DCP's writer with
    one thread), or with ``background`` on the rank file's writing thread,
    so that the rank copies the next device tensor to host memory meanwhile.
    """

    def __init__(self, root: str, save_id: str, rank: int, *, sync: bool, hashed: bool):
        super().__init__(hashed)
        self.path = data_file(save_id, rank)
        self.sync = sync
        full = os.path.join(root, self.path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        self._fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        self._size = 0
        self._refs: list[Ref] = []
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []
        self._since_writeback = 0
        self._lock = threading.Lock()

    def put(self, key: str, value: Value, hold: Any = None, background: bool = False) -> Future[None] | None:
        at = self._size
        self._refs.append(Ref(self.path, at, value.nbytes))
        self._size += value.nbytes
        slot = self._slot()
        if not background:
            self._write(key, value, at, slot)
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tsckpt-rank-file")
        future = self._pool.submit(self._write, key, value, at, slot, hold)
        self._pending.append(future)
        if len(self._pending) > 64:  # surface failures early, and keep the list short
            for f in self._pending:
                if f.done():
                    f.result()
            self._pending = [f for f in self._pending if not f.done()]
        return future

    def _write(self, key: str, value: Value, at: int, slot: int, hold: Any = None) -> None:
        where = [at]
        try:
            self._emit(value, functools.partial(_write_all, self._fd, where), slot)
        except OSError as e:
            raise WriteFailed(key, e) from e
        if where[0] - at != value.nbytes:
            raise RuntimeError(f"{self.path}: a value emitted {where[0] - at} bytes, not the {value.nbytes} it declared")
        with self._lock:
            self._since_writeback += value.nbytes
            start = self.sync and self._since_writeback >= WRITEBACK_BYTES
            if start:
                self._since_writeback = 0
        if start:
            localfs.start_writeback(self._fd)

    @property
    def refs(self) -> list[Ref]:
        return self._refs

    def finish(self, table: Callable[[], bytes | None]) -> RankFiles:
        try:
            for f in self._pending:
                f.result()
            rows, where = table(), None
            if rows is not None:
                where = Span(self.path, self._size, len(rows))
                _write_all(self._fd, [self._size], memoryview(rows))
                self._size += len(rows)
            if self.sync:
                os.fsync(self._fd)
        finally:
            self._close()
        return RankFiles((FileRef(self.path, self._size),), where)

    def abandon(self) -> None:
        settle(self._pending)
        self._close()

    def _close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _Parts:
    """Bytes gathered into one object at a time, each written in one request; two in flight at most. Keeps the
    generation the store gave each object (:attr:`FileRef.generation <tsckpt.format.data_files.FileRef>`)."""

    def __init__(self, kv: ts.KvStore):
        self.kv = kv
        self.inflight: list[tuple[str, Any]] = []
        self.generations: dict[str, str] = {}

    def send(self, key: str, data: bytes) -> None:
        while len(self.inflight) >= 2:
            self._settle()  # taken off only once done: an interrupted wait forgets no upload
        self.inflight.append((key, self.kv.write(key, data)))

    def wait(self) -> None:
        """Wait for every upload; the first failure is raised once all are done."""
        failure: BaseException | None = None
        while self.inflight:
            try:
                self._settle()
            except Exception as e:  # noqa: BLE001 - raised after the others are waited for
                failure = failure or e
                self.inflight.pop(0)
        if failure is not None:
            raise failure

    def _settle(self) -> None:
        key, future = self.inflight[0]
        self.generations[key] = future.result().generation.hex()
        self.inflight.pop(0)


class RankObjects(Sink):
    """The packed layout on an object store: values back to back in parts of at most ``part_bytes``."""

    def __init__(self, kv: ts.KvStore, save_id: str, rank: int, *, hashed: bool,
                 part_bytes: int = DEFAULT_PART_BYTES):
        super().__init__(hashed)
        self.kv, self.save_id, self.rank, self.part_bytes = kv, save_id, rank, part_bytes
        self._parts = _Parts(kv)
        self._buffer = bytearray()
        self._files: list[FileRef] = []
        self._refs: list[Ref] = []
        #: Where the object being filled is sent: ``part_bytes``, or less for the first half of a split.
        self._limit = part_bytes

    def _path(self) -> str:
        return data_file(self.save_id, self.rank, len(self._files))

    def put(self, key: str, value: Value, hold: Any = None,
            background: bool = False) -> None:  # copied at once: nothing to wait for
        if self._buffer and len(self._buffer) + value.nbytes > self._limit:
            self._send()
        self._refs.append(Ref(self._path(), len(self._buffer), value.nbytes))
        self._emit(value, self._buffer.extend, self._slot())

    def _send(self) -> None:
        path = self._path()
        self._files.append(FileRef(path, len(self._buffer)))
        self._parts.send(path, bytes(self._buffer))
        self._buffer = bytearray()
        self._limit = self.part_bytes

    def expect(self, nbytes: int) -> None:
        total = len(self._buffer) + nbytes
        if SPLIT_BYTES <= total <= self.part_bytes:
            self._limit = total // 2

    @property
    def refs(self) -> list[Ref]:
        return self._refs

    def finish(self, table: Callable[[], bytes | None]) -> RankFiles:
        rows, where = table(), None
        if rows is not None:
            where = Span(self._path(), len(self._buffer), len(rows))
            self._buffer += rows
        if self._buffer or not self._files:
            self._send()
        self._parts.wait()
        files = tuple(FileRef(f.path, f.size, self._parts.generations.get(f.path)) for f in self._files)
        return RankFiles(files, where)

    def abandon(self) -> None:
        try:
            self._parts.wait()
        except Exception:  # noqa: BLE001 - the failure that got here is already being reported
            pass
