"""How a save's bytes reach storage: values that emit their bytes in order, written to local files or objects.

A :class:`Value` knows its stored size before it is written and emits its bytes in small parts through a reused
scratch buffer, never whole. :class:`Files` writes values into files on a local disk, :class:`Objects` gathers
them into objects of an object store (or memory); :class:`~tsckpt.storage.sinks.Sink` decides what goes where.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import crc32c as _crc32c
import numpy as np
import tensorstore as ts

from . import localfs
from .context import ThreadPool

#: A writer's scratch buffers: ``get(n)`` returns ``n`` reusable bytes.
Scratch = Callable[[int], np.ndarray]
Emit = Callable[[memoryview], None]

#: Bytes written to a file between two starts of its writeback: the disk works while the rank encodes,
#: and the final fsync waits for the last stretch only.
WRITEBACK_BYTES = 64 << 20
#: The largest object a rank writes on an object store (one PUT, held in memory until sent).
DEFAULT_PART_BYTES = 1 << 30
#: Values smaller than this are written on the rank's own thread: the write threads would spend more on
#: taking turns with it for the GIL than on their bytes.
INLINE_BYTES = 1 << 20
#: Scratch buffers larger than this are not kept between uses.
_KEEP_SCRATCH = 4 << 20
_free_scratch: list[np.ndarray] = []
_scratch_lock = threading.Lock()
#: Whether files may be made durable by one syncfs at the end (Linux) rather than an fsync each.
_DEFER_SYNC = localfs.has_syncfs()


@contextlib.contextmanager
def scratch() -> Iterator[Scratch]:
    """A reusable buffer for one thread's work: ``get(n)`` returns ``n`` bytes of it (grown as needed)."""
    with _scratch_lock:
        held = [_free_scratch.pop() if _free_scratch else np.empty(0, dtype=np.uint8)]

    def get(nbytes: int) -> np.ndarray:
        if held[0].size < nbytes:
            held[0] = np.empty(nbytes, dtype=np.uint8)
        return held[0][:nbytes]
    try:
        yield get
    finally:
        if held[0].size <= _KEEP_SCRATCH:
            with _scratch_lock:
                _free_scratch.append(held[0])


class WriteFailed(Exception):
    """A value that could not be written: its key and the operating system's error."""

    def __init__(self, key: str, cause: BaseException):
        super().__init__(f"{key}: {cause}")
        self.key, self.cause = key, cause


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


def settle(futures: list[Any]) -> None:
    """After a failure: wait for every write in ``futures`` so that none outlives its source, ignoring their
    errors (the failure that got here is the one reported)."""
    for f in futures:
        with contextlib.suppress(Exception):
            f.result()


class Files:
    """A local disk: each file created new, its values written with ``pwrite`` where they go.

    A file that exists already is replaced, never written into: in an incremental save it may be a hard link to
    a base checkpoint's chunk. Values of :data:`INLINE_BYTES` or more, and those whose source waits for a device
    copy (``background``), are written on ``threads`` threads of the writer's own; the rest on the caller's.

    Durability (with ``sync``): a file kept open across values (a data file) has its writeback started every
    :data:`WRITEBACK_BYTES` and is fsynced when sent. A file written in one go is made durable with the rest by
    one ``syncfs`` in :meth:`finish`, each fsync being a journal commit of its own: 4 processes writing 116 files
    of 2 MiB took 0.74 s so, 0.92 s with an fsync per file (``benchmarks/bench_fsync.py``). Without ``syncfs``,
    each is fsynced.
    """

    generations: dict[str, str] = {}  # files have none

    def __init__(self, root: str, *, sync: bool, threads: int):
        self.root, self.sync = root, sync
        self._pool = ThreadPool(threads, thread_name_prefix="tsckpt-file-write")
        self._open: dict[str, list[int]] = {}  # files kept open: [fd, bytes since their writeback started]
        self._dirs: set[str] = set()
        self._deferred = False  # a file was left to finish's syncfs
        self._lock = threading.Lock()

    def write(self, path: str, value: Value, emit: Callable[[Emit], None] | None = None, *, at: int = 0,
              keep_open: bool = False, key: str = "", background: bool = False,
              hold: Any = None) -> Future[None] | None:
        """Write ``value`` at offset ``at`` of file ``path`` through ``emit(write)`` (default: its bytes as they
        are), keeping the file open for more (``keep_open``). A future where it is written on a thread (``hold``
        stays referenced until then), else None."""
        args = (path, value.nbytes, emit or functools.partial(emit_value, value), at, keep_open, key or path, hold)
        if background or value.nbytes >= INLINE_BYTES:
            return self._pool.submit(self._write, *args)
        self._write(*args)
        return None

    def _write(self, path: str, nbytes: int, emit: Callable[[Emit], None], at: int, keep_open: bool,
               key: str, hold: Any) -> None:
        where = [at]
        try:
            fd = self._fd(path, keep_open)
            try:
                emit(functools.partial(_pwrite, fd, where))
                if not keep_open and self.sync:
                    # A small file's writeback is left to syncfs: starting it costs a system call per file,
                    # and the kernel writes small files in one go anyway.
                    if _DEFER_SYNC and (nbytes < INLINE_BYTES or localfs.start_writeback(fd)):
                        self._deferred = True
                    else:
                        os.fsync(fd)
            finally:
                if not keep_open:
                    os.close(fd)
        except OSError as e:
            raise WriteFailed(key, e) from e
        if where[0] - at != nbytes:
            raise RuntimeError(f"{path}: a value emitted {where[0] - at} bytes, not the {nbytes} it declared")
        if keep_open and self.sync:
            with self._lock:
                state = self._open[path]
                state[1] += nbytes
                start = state[1] >= WRITEBACK_BYTES
                if start:
                    state[1] = 0
            if start:
                localfs.start_writeback(fd)

    def _fd(self, path: str, keep_open: bool) -> int:
        with self._lock:
            if path in self._open:
                return self._open[path][0]
            full = os.path.join(self.root, path)
            if os.path.dirname(full) not in self._dirs:
                os.makedirs(os.path.dirname(full), exist_ok=True)
                self._dirs.add(os.path.dirname(full))
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
            try:
                fd = os.open(full, flags, 0o666)
            except FileExistsError:
                os.unlink(full)  # drops this name only: a base checkpoint's file keeps its own
                fd = os.open(full, flags, 0o666)
            if keep_open:
                self._open[path] = [fd, 0]
            return fd

    def send(self, path: str) -> None:
        """Close file ``path``, kept open until now, once every write into it is done (fsynced, with ``sync``)."""
        fd = self._open.pop(path)[0]
        try:
            if self.sync:
                os.fsync(fd)
        except OSError as e:
            raise WriteFailed(path, e) from e
        finally:
            os.close(fd)

    def finish(self) -> None:
        """Once every file is written and sent: make them durable."""
        self.close()
        if self._deferred:
            self._deferred = False
            localfs.syncfs_at(next(iter(self._dirs)))  # one filesystem: the save's staging directory

    def close(self) -> None:
        """End the write threads once the writes started are done, and close every file, durable or not."""
        self._pool.shutdown(wait=True)
        while self._open:
            os.close(self._open.popitem()[1][0])


def emit_value(value: Value, write: Emit) -> None:
    with scratch() as get:
        value.emit(write, get)


def _pwrite(fd: int, at: list[int], view: memoryview) -> None:
    """Write ``view`` at offset ``at[0]`` of ``fd`` (advanced past it): positional, so that threads writing
    into one file cannot interleave."""
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], at[0] + done)
    at[0] += len(view)


class Objects:
    """An object store (or memory): each object gathered in memory and written in one request, at most
    ``2 * DEFAULT_PART_BYTES`` in flight; keeps the generation the store gave each object
    (:attr:`FileRef.generation <tsckpt.format.data_files.FileRef>`)."""

    def __init__(self, kv: ts.KvStore):
        self.kv = kv
        self._buffers: dict[str, bytearray] = {}
        self._inflight: collections.deque[tuple[str, int, Any]] = collections.deque()
        self._inflight_bytes = 0
        self.generations: dict[str, str] = {}

    def write(self, path: str, value: Value, emit: Callable[[Emit], None] | None = None, *, at: int = 0,
              keep_open: bool = False, **_: Any) -> None:
        """Copy ``value`` to the end of object ``path`` (offset ``at``), sent now unless ``keep_open``."""
        buffer = self._buffers.setdefault(path, bytearray())
        assert len(buffer) == at, "an object is gathered in order"
        (emit or functools.partial(emit_value, value))(buffer.extend)
        if not keep_open:
            self.send(path)

    def send(self, path: str) -> None:
        data = bytes(self._buffers.pop(path, b""))
        while self._inflight and self._inflight_bytes + len(data) > 2 * DEFAULT_PART_BYTES:
            self._settle()  # taken off only once done: an interrupted wait forgets no upload
        self._inflight.append((path, len(data), self.kv.write(path, data)))
        self._inflight_bytes += len(data)

    def finish(self) -> None:
        """Wait for every upload; the first failure is raised once all are done."""
        failure: BaseException | None = None
        while self._inflight:
            try:
                self._settle()
            except Exception as e:  # noqa: BLE001 - raised after the others are waited for
                failure = failure or e
                self._inflight_bytes -= self._inflight.popleft()[1]
        if failure is not None:
            raise failure

    def close(self) -> None:
        settle([f for _, _, f in self._inflight])

    def _settle(self) -> None:
        path, nbytes, future = self._inflight[0]
        self.generations[path] = future.result().generation.hex()
        self._inflight.popleft()
        self._inflight_bytes -= nbytes
