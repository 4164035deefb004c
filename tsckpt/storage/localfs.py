"""Local-filesystem primitives the commit needs and TensorStore does not give: syncfs, exchange, locks.

Linux only where a call says so (``syncfs``, ``renameat2``); elsewhere each reports that it cannot.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import os
import sys
import weakref
from collections.abc import Callable
from typing import Any

import tensorstore as ts

from ..errors import StorageError
from .context import context_spec, open_kvstore, process_context
from .location import Location

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
#: Errors that mean "this filesystem or kernel cannot do that", not "it failed".
UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOLCK}


def unsynced_nodes(location: Location) -> tuple[ts.KvStore, Callable[[], None]] | None:
    """A kvstore that skips per-file fsync, and the one call that makes its writes durable.

    Only for local paths on Linux, where ``syncfs`` flushes the whole filesystem in one journal commit: hundreds
    of small ``zarr.json`` files with an fsync each cost more than the commit's data. None elsewhere.
    """
    if location.driver != "file" or not has_syncfs():
        return None
    kv = open_kvstore(location, ts.Context(context_spec(location=location, sync=False), parent=process_context()))
    root = str(location.spec.get("path", "."))

    def flush() -> None:
        try:
            syncfs_at(root)
        except OSError as e:
            raise StorageError(f"syncfs on {location.url} failed: {e.strerror}") from None

    return kv, flush


@functools.cache
def libc() -> Any:
    return ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


@functools.cache
def _libc_call(name: str, *argtypes: Any) -> Any:
    fn = getattr(libc(), name, None)
    if fn is not None and argtypes:
        fn.argtypes = list(argtypes)
    return fn


def has_syncfs() -> bool:
    """Whether :func:`syncfs_at` can flush a whole filesystem here (Linux)."""
    return _libc_call("syncfs") is not None


_SYNC_FILE_RANGE_WRITE = 2  # start writing the range's dirty pages back, without waiting


def start_writeback(fd: int) -> bool:
    """Start writing ``fd``'s dirty pages to the device without waiting; False where the kernel cannot."""
    fn = _libc_call("sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return fn is not None and fn(fd, 0, 0, _SYNC_FILE_RANGE_WRITE) == 0


def syncfs_at(path: str) -> bool:
    """Make everything written to the filesystem holding ``path`` durable; False where ``syncfs`` is missing."""
    fn = _libc_call("syncfs")
    if fn is None:
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        if fn(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
    finally:
        os.close(fd)
    return True


def exchange(a: str, b: str) -> bool:
    """Atomically swap two paths; False where the kernel or filesystem cannot."""
    fn = getattr(libc(), "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), a, None, b)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DirLock:
    """An exclusive ``flock`` on a directory, held until released or this object is collected."""

    def __init__(self, fd: int):
        self.fd = fd
        self._finalizer = weakref.finalize(self, os.close, fd)

    @classmethod
    def try_acquire(cls, path: str) -> DirLock | bool | None:
        """The lock; False if another process holds it; None if this filesystem has no locks (FileNotFoundError if
        ``path`` is gone)."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            if e.errno in UNSUPPORTED:
                return None
            raise
        return cls(fd)

    @property
    def still_linked(self) -> bool:
        return os.fstat(self.fd).st_nlink > 0

    def release(self) -> None:
        self._finalizer()


class Turn:
    """An exclusive ``flock`` on a target directory, waited for: publications into it take turns. False (retry)
    when the target went or was replaced while waiting; True without a lock where the filesystem has none, or the
    target is not a directory (the classification then refuses it)."""

    def __init__(self, path: str):
        self.path, self.fd = path, -1

    def __enter__(self) -> bool:
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return False
        except NotADirectoryError:
            return True
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno not in UNSUPPORTED:
                raise
            return True
        try:
            here, now = os.fstat(self.fd), os.stat(self.path)
        except FileNotFoundError:
            return False
        return (here.st_dev, here.st_ino) == (now.st_dev, now.st_ino)

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the lock
            self.fd = -1


def liveness(path: str) -> bool | None:
    """True if a running save holds ``path``'s lock, False if none does, None if unknown."""
    try:
        lock = DirLock.try_acquire(path)
    except FileNotFoundError:
        return False
    if isinstance(lock, DirLock):
        lock.release()
        return False
    return None if lock is None else True
