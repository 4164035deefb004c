"""How a checkpoint's files are fetched, one byte range at a time: :class:`Fetcher`.

:class:`LocalFiles` (``preadv`` on a few threads, each file's size checked once against what was written) or
:class:`KvFiles` (TensorStore ranged reads: object stores, memory). Which ranges to fetch, merged how, is
:mod:`tsckpt.storage.byte_reads`.
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import numpy as np
import tensorstore as ts

from .context import DEFAULT_IO_CONCURRENCY, ThreadPool


class Fetcher(ABC):
    """Reads ``[start, stop)`` of a checkpoint file, named by its key relative to the checkpoint."""

    @abstractmethod
    def fetch(self, key: str, start: int, stop: int, into: np.ndarray | None = None) -> Any:
        """Start the read; a future whose ``result()`` is the bytes as a ``uint8`` array (``into`` when given),
        or raises ValueError worded as TensorStore words it (``NOT_FOUND``, ``OUT_OF_RANGE``, ``DATA_LOSS``)."""


class LocalFiles(Fetcher):
    """Files under a local directory, read with ``preadv`` on ``threads`` threads of its own; ``sizes`` (key ->
    bytes written) are checked once per file, so a file cut short or grown fails every read of it."""

    def __init__(self, root: str, sizes: Mapping[str, int] | None = None, *, threads: int = DEFAULT_IO_CONCURRENCY):
        self.root, self.sizes = root, dict(sizes or {})
        self._pool = ThreadPool(threads, thread_name_prefix="tsckpt-read")
        self._checked: dict[str, str | None] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    def expect(self, key: str, size: int) -> None:
        """Read ``key`` only if it is ``size`` bytes long."""
        self.sizes.setdefault(key, size)

    def fetch(self, key: str, start: int, stop: int, into: np.ndarray | None = None) -> Future[np.ndarray]:
        return self._pool.submit(self._read, key, start, stop, into)

    def _read(self, key: str, start: int, stop: int, into: np.ndarray | None) -> np.ndarray:
        path = os.path.join(self.root, key)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise ValueError(f"NOT_FOUND: {path} is missing") from None
        try:
            self._check_size(key, fd, path)
            out = np.empty(stop - start, dtype=np.uint8) if into is None else into
            view, at = memoryview(out), 0
            while at < out.size:
                n = os.preadv(fd, [view[at:]], start + at)
                if not n:
                    raise ValueError(f"OUT_OF_RANGE: {path} ends before byte {stop} (it was truncated)")
                at += n
            return out
        finally:
            os.close(fd)

    def _check_size(self, key: str, fd: int, path: str) -> None:
        expected = self.sizes.get(key)
        if expected is None:
            return
        with self._lock:
            known = key in self._checked
            problem = self._checked.get(key)
        if not known:
            size = os.fstat(fd).st_size
            problem = None if size == expected else (
                f"DATA_LOSS: {path} is {size} bytes, not the {expected} written (truncated or replaced)")
            with self._lock:
                self._checked[key] = problem
        if problem is not None:
            raise ValueError(problem)


class KvFiles(Fetcher):
    """Keys of a TensorStore kvstore, read by byte range (object stores, memory, older OCDBT databases).

    ``generations`` (key -> the generation the store gave the object when written, its ETag on S3): every read of
    such a key must come from that generation, so an object truncated or rewritten since is refused.
    """

    def __init__(self, kv: ts.KvStore, generations: Mapping[str, bytes] | None = None):
        self.kv, self.generations = kv, dict(generations or {})

    def fetch(self, key: str, start: int, stop: int, into: np.ndarray | None = None) -> Any:
        promise, out = ts.Promise.new()

        def done(f: Any) -> None:
            try:
                result = f.result()
                if result.state != "value":
                    raise ValueError(f"NOT_FOUND: {key} is missing")
                expected = self.generations.get(key)
                if expected is not None and result.stamp.generation != expected:
                    raise ValueError(f"DATA_LOSS: {key} is not the object written (it was truncated or replaced "
                                     "since)")
                data = np.frombuffer(result.value, dtype=np.uint8)
                if data.size != stop - start:
                    raise ValueError(f"OUT_OF_RANGE: {key} ends before byte {stop} (it was truncated)")
                if into is not None:
                    np.copyto(into, data)
                    data = into
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                promise.set_exception(e)
                return
            promise.set_result(data)

        self.kv.read(key, byte_range=slice(start, stop)).add_done_callback(done)
        return out
