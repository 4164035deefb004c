"""Thread pools, each owned by the one writer or fetcher that uses it, and the read buffers loads share.

A :class:`ThreadPool` makes its threads as work comes and ends them with :meth:`ThreadPool.shutdown` or, at the
latest, when its owner is freed. A pool used before a fork is not its forked child's: the child's copy counts idle
threads that do not exist there, and its first task would wait forever; so a pool notices it is in another
process and makes its threads anew.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np


class ThreadPool:
    """A ``ThreadPoolExecutor`` of at most ``max_workers`` threads, made by the first :meth:`submit`."""

    def __init__(self, max_workers: int, thread_name_prefix: str):
        if max_workers < 1:
            raise ValueError(f"a thread pool needs at least 1 thread, not {max_workers}")
        self.max_workers, self.thread_name_prefix = max_workers, thread_name_prefix
        self._executor: ThreadPoolExecutor | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        if self._pid != os.getpid():
            # A forked child: the parent's threads are not here, and its lock may have been held at the fork.
            self._executor, self._lock, self._pid = None, threading.Lock(), os.getpid()
        executor = self._executor
        if executor is None:
            with self._lock:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(self.max_workers, self.thread_name_prefix)
                executor = self._executor
        return executor.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True) -> None:
        """End the threads once the work submitted is done (waiting for it with ``wait``); a later
        :meth:`submit` makes new ones."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None and self._pid == os.getpid():
            executor.shutdown(wait=wait)


class ReadBuffers:
    """Read buffers of local files, kept for the next batch of this process, load after load.

    A buffer's pages are faulted in the first time a read fills them: with buffers of each load's own, a repeated
    load of 64 MiB from the page cache took 0.09-0.14 s, not 0.06-0.07 s. Sizes are powers of two up to
    ``max_request``, so a request takes one at most twice its length (with one size only, a column reshard held
    about 100 at once, under a tenth of each used). At most ``max_inflight`` bytes, plus two of the largest
    buffers, are kept; the buffers kept longest go first.
    """

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self._kept: list[int] = []  # the size of each kept buffer, oldest first
        self._bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def size_for(nbytes: int, cost: Any) -> int:
        """The size of buffer a read of ``nbytes`` (at most ``cost.max_request``) takes."""
        return min(1 << max(nbytes - 1, 0).bit_length(), max(cost.max_request, nbytes))

    def take(self, nbytes: int, cost: Any) -> np.ndarray:
        """A buffer of :meth:`size_for` ``nbytes`` bytes (``cost``: a :class:`~tsckpt.storage.byte_reads.ReadCost`),
        a kept one if any."""
        size = self.size_for(nbytes, cost)
        with self._lock:
            free = self._free.get(size)
            if free:
                self._kept.remove(size)
                self._bytes -= size
                return free.pop()
        return np.empty(size, dtype=np.uint8)

    def give(self, buffer: np.ndarray, cost: Any) -> None:
        """Keep ``buffer`` for a later :meth:`take`, dropping the oldest kept ones beyond the bound."""
        limit = cost.max_inflight + 2 * cost.max_request
        with self._lock:
            if buffer.size > limit:
                return
            self._free.setdefault(buffer.size, []).insert(0, buffer)
            self._kept.append(buffer.size)
            self._bytes += buffer.size
            while self._bytes > limit:
                size = self._kept.pop(0)
                self._free[size].pop()
                self._bytes -= size
