"""Files a rank writes one per key (the plain layout on a local disk), and the scratch buffers writers share.

Saves write the outer chunks tsckpt encodes each into its own file
(:class:`ChunkFileWriter`), encoding each in small parts into a few reused
buffers (:func:`scratch`), where a write through TensorStore must keep every
encoded chunk whole and alive until it is committed: a fresh copy of the
rank's state. Reads go through :mod:`tsckpt.storage.byte_reads`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import numpy as np

from . import localfs
from .context import DEFAULT_IO_CONCURRENCY
from .pools import ThreadPool

#: Whether files may be made durable by one syncfs at the end (Linux) rather than an fsync each.
_DEFER_SYNC = localfs.has_syncfs()
#: Chunk files smaller than this are written on the rank's own thread.
INLINE_BYTES = 1 << 20


class WriteFailed(Exception):
    """A value that could not be written: its key and the operating system's or store's error."""

    def __init__(self, key: str, cause: BaseException):
        super().__init__(f"{key}: {cause}")
        self.key, self.cause = key, cause


#: Scratch buffers larger than this are not kept between uses.
_KEEP_SCRATCH = 4 << 20
_free_scratch: list[np.ndarray] = []
_scratch_lock = threading.Lock()


@contextlib.contextmanager
def scratch() -> Iterator[Callable[[int], np.ndarray]]:
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


class ChunkFileWriter:
    """One rank's writes of the outer chunks tsckpt encodes, each into its own file, on the write threads.

    Runs on the rank's thread: :meth:`write` starts encoding a chunk and
    writing it to its file, part by part (:func:`~tsckpt.format.shard_encoding.encode_to`)
    through a small scratch buffer. The future gives the chunk's crc32c
    values; the chunk's data must not change until then. With ``sync``,
    :meth:`finish` (after every future) makes the files durable. The scratch
    buffers (:func:`scratch`) are shared with reads.

    Durability: each file's writeback starts as soon as it is written
    (``sync_file_range``), and :meth:`finish` waits for all of them with one
    ``syncfs``: each fsync is a journal commit of its own. On a 2-core VM,
    4 processes writing 116 files of 2 MiB each took 0.74 s so, against 0.92 s
    with an fsync per file (medians of 6, ``python benchmarks/bench_fsync.py
    --ranks 4 --files 116 --mb 2 --reps 6``). Where the kernel has no
    ``syncfs``, each file is fsynced as it is written.

    A file that exists already is replaced, never written into: in an
    incremental save it may be a hard link to a base checkpoint's chunk.

    Large chunks are written on ``threads`` threads of the writer's own (the
    save's ``io_concurrency``, DCP's ``thread_count``), made as writes come
    and ended by :meth:`finish` or :meth:`close`.
    """

    def __init__(self, *, sync: bool, threads: int = DEFAULT_IO_CONCURRENCY):
        self.sync = sync
        self._pool = ThreadPool(threads, thread_name_prefix="tsckpt-chunk-write")
        self._dirs: set[str] = set()  # the directories made (or found) for the files written
        self._deferred = False  # a file was left to finish's syncfs

    def finish(self) -> None:
        """Make every file written so far durable (with ``sync``); call once all futures are done."""
        self.close()
        if self._deferred:
            self._deferred = False
            localfs.syncfs_at(next(iter(self._dirs)))  # one filesystem: the save's staging directory

    def close(self) -> None:
        """End the write threads once the writes started are done (a later write makes new ones)."""
        self._pool.shutdown(wait=True)

    def write(self, path: str, value: Any, key: str = "",
              emit: Callable[[Any, Callable[[memoryview], None]], None] | None = None) -> Future[None]:
        """Start writing ``value`` (:class:`~tsckpt.storage.sinks.Value`: its size and bytes) as file ``path``.

        A small value is written at once, on the calling thread: the write
        threads would spend more on taking turns with it for the GIL than on
        its bytes.
        """
        if value.nbytes >= INLINE_BYTES:
            return self._pool.submit(self._write, path, value, key, emit)
        done: Future[None] = Future()
        try:
            done.set_result(self._write(path, value, key, emit))
        except Exception as e:  # noqa: BLE001 - reported by the future, as from the write threads
            done.set_exception(e)
        return done

    def _write(self, path: str, value: Any, key: str,
               emit: Callable[[Any, Callable[[memoryview], None]], None] | None) -> None:
        try:
            fd = self._create(path)
        except OSError as e:
            raise WriteFailed(key or path, e) from e
        try:
            if emit is not None:  # the caller's way: it hashes what goes by
                emit(value, functools.partial(_write_all, fd))
            else:
                with scratch() as get:
                    value.emit(functools.partial(_write_all, fd), get)
            if self.sync:
                # A small file's writeback is left to finish's syncfs: starting it costs
                # a system call per file, and the kernel writes small files in one go anyway.
                if _DEFER_SYNC and (value.nbytes < INLINE_BYTES or localfs.start_writeback(fd)):
                    self._deferred = True
                else:
                    os.fsync(fd)
        except OSError as e:
            raise WriteFailed(key or path, e) from e
        finally:
            os.close(fd)

    def _create(self, path: str) -> int:
        parent = os.path.dirname(path)
        if parent not in self._dirs:
            os.makedirs(parent, exist_ok=True)
            self._dirs.add(parent)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        try:
            return os.open(path, flags, 0o666)
        except FileExistsError:
            os.unlink(path)  # drops this name only: a base checkpoint's file keeps its own
            return os.open(path, flags, 0o666)


def _write_all(fd: int, data: memoryview) -> None:
    at = 0
    while at < len(data):
        at += os.write(fd, data[at:])
