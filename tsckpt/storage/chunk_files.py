"""Chunk files of a plain checkpoint on a local filesystem, read and written with plain file calls.

TensorStore's ``file`` kvstore reads a 32 MiB chunk file from the page cache
at about 0.7 GB/s here (into a cord, then copied into a Python ``bytes``),
where one ``readinto`` runs at 8.8 GB/s (``benchmarks/bench_chunk_reads.py``).
So the verified reads (:mod:`tsckpt.storage.box_reader`) and an incremental
save's base checks read tsckpt's own encoded chunk files with plain file
calls, on a small thread pool (the GIL is released while a file is read).
Everything else still goes through TensorStore.

Saves write the outer chunks tsckpt encodes the same way
(:class:`ChunkFileWriter`), encoding each in small parts into a few reused
buffers, where a write through TensorStore must keep every encoded chunk whole
and alive until it is committed: a fresh copy of the rank's state.

Read failures are reported as TensorStore reports them, as ``ValueError`` with a
status prefix, so callers translate both alike: ``NOT_FOUND`` for a missing
file and ``OUT_OF_RANGE`` for one shorter than a range asked for.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from ..format import shard_encoding
from ..format.shards import ShardFormat
from . import localfs

from .layouts import PLAIN
from .store import Store

T = TypeVar("T")

#: A few threads: enough to keep the page cache or a disk queue busy, few enough for 2-core machines.
_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tsckpt-chunk-read")
#: Whether files may be made durable by one syncfs at the end (Linux) rather than an fsync each.
_DEFER_SYNC = localfs.has_syncfs()
#: Chunk files smaller than this are written on the rank's own thread.
INLINE_BYTES = 1 << 20  # also: smaller chunk files are read whole, not streamed
#: Writes have threads of their own: an fsync waiting on the disk must not hold up reads.
_WRITE_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tsckpt-chunk-write")


def local_directory(store: Store, path: str) -> str | None:
    """The directory holding array ``path``'s chunk files, where ``store`` is a plain checkpoint on a local
    filesystem; None elsewhere (object stores, the packed layout)."""
    if store.location.driver != "file" or store.layout.name != PLAIN:
        return None
    return os.path.join(str(store.location.spec.get("path", ".")), path)


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


def submit(fn: Callable[..., T], *args: Any) -> Future[T]:
    """Run ``fn(*args)`` on the read threads."""
    return _POOL.submit(fn, *args)


def open_read(path: str) -> int:
    """A file descriptor of ``path`` for reading; ``NOT_FOUND`` if it is missing."""
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise _missing(path) from None


def pread_into(fd: int, out: np.ndarray, offset: int, path: str) -> None:
    """Fill ``out`` from ``fd`` at ``offset``; ``OUT_OF_RANGE`` if the file ends first."""
    view, at = memoryview(out), 0
    while at < out.size:
        n = os.preadv(fd, [view[at:]], offset + at)
        if not n:
            raise ValueError(f"OUT_OF_RANGE: {path} ends before byte {offset + out.size} (it was truncated)")
        at += n


def stored_tail(fd: int, path: str, fmt: ShardFormat) -> tuple[int, np.ndarray]:
    """An encoded chunk file's size and its last ``fmt.index_bytes`` bytes (zeros if it is shorter)."""
    size = os.fstat(fd).st_size
    tail = np.zeros(fmt.index_bytes, dtype=np.uint8)
    if size >= fmt.index_bytes:
        pread_into(fd, tail, size - fmt.index_bytes, path)
    return size, tail


def stored_units(fd: int, path: str, fmt: ShardFormat) -> Iterator[tuple[int, np.ndarray]]:
    """An encoded chunk file's units (:mod:`~tsckpt.format.shard_encoding`), one at a time, each read into the
    same scratch buffer (valid until the next): the storage position of its first inner chunk, its bytes."""
    count, nbytes = fmt.pieces // shard_encoding.units(fmt), shard_encoding.unit_bytes(fmt)
    with scratch() as get:
        buffer = get(nbytes)
        for u in range(shard_encoding.units(fmt)):
            pread_into(fd, buffer, u * nbytes, path)
            yield u * count, buffer


def read_whole(path: str) -> Future[np.ndarray]:
    """Start reading a whole file; its bytes (``uint8``)."""
    return _POOL.submit(whole_file, path)


def read_ranges(path: str, ranges: Sequence[tuple[int, int]]) -> Future[np.ndarray]:
    """Start reading the byte ranges ``[start, stop)`` of a file, one after the other into one buffer."""
    return _POOL.submit(_ranges, path, list(ranges))


def whole_file(path: str) -> np.ndarray:
    """The bytes of a whole file (``uint8``), read on the calling thread."""
    try:
        f = open(path, "rb", buffering=0)
    except FileNotFoundError:
        raise _missing(path) from None
    with f:
        data = np.empty(os.fstat(f.fileno()).st_size, dtype=np.uint8)
        view, got = memoryview(data), 0
        while got < data.size:
            n = f.readinto(view[got:])
            if not n:
                break  # shrank since it was opened: the caller's size check refuses it
            got += n
    return data[:got]


def _ranges(path: str, ranges: list[tuple[int, int]]) -> np.ndarray:
    out = np.empty(sum(b - a for a, b in ranges), dtype=np.uint8)
    fd = open_read(path)
    try:
        at = 0
        for start, stop in ranges:
            pread_into(fd, out[at:at + stop - start], start, path)
            at += stop - start
    finally:
        os.close(fd)
    return out


def _missing(path: str) -> ValueError:
    return ValueError(f"NOT_FOUND: {path} is missing")


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
    """

    def __init__(self, *, sync: bool):
        self.sync = sync
        self._dirs: set[str] = set()  # the directories made (or found) for the files written
        self._deferred = False  # a file was left to finish's syncfs

    def finish(self) -> None:
        """Make every file written so far durable (with ``sync``); call once all futures are done."""
        if self._deferred:
            self._deferred = False
            localfs.syncfs_at(next(iter(self._dirs)))  # one filesystem: the save's staging directory

    def write(self, path: str, fmt: ShardFormat, data: np.ndarray) -> Future[list[int]]:
        """Start writing outer chunk ``data`` (its part inside the array) of layout ``fmt`` as file ``path``.

        A small chunk is written at once, on the calling thread: the write
        threads would spend more on taking turns with it for the GIL than on
        its bytes.
        """
        if fmt.nbytes >= INLINE_BYTES:
            return _WRITE_POOL.submit(self._write, path, fmt, data)
        done: Future[list[int]] = Future()
        try:
            done.set_result(self._write(path, fmt, data))
        except Exception as e:  # noqa: BLE001 - reported by the future, as from the write threads
            done.set_exception(e)
        return done

    def _write(self, path: str, fmt: ShardFormat, data: np.ndarray) -> list[int]:
        fd = self._create(path)
        try:
            with scratch() as get:
                crcs = shard_encoding.encode_to(fmt, data, functools.partial(_write_all, fd), get)
            if self.sync:
                # A small file's writeback is left to finish's syncfs: starting it costs
                # a system call per file, and the kernel writes small files in one go anyway.
                if _DEFER_SYNC and (fmt.nbytes < INLINE_BYTES or localfs.start_writeback(fd)):
                    self._deferred = True
                else:
                    os.fsync(fd)
        finally:
            os.close(fd)
        return crcs

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
