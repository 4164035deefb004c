"""What callers share within one process: thread pools (made on first use, shut down at exit) and read buffers.

A ``ThreadPoolExecutor`` made at import and copied into a forked child keeps
its parent's record of idle threads that do not exist there: the child's
first task waits forever. A :class:`ProcessPool` forgets its executor in a
forked child (``os.register_at_fork``), so the child makes its own on first
use, and shuts its executor down when the interpreter exits.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np


class ProcessPool:
    """A ``ThreadPoolExecutor`` of this process's own, made by the first :meth:`submit`."""

    def __init__(self, max_workers: int, thread_name_prefix: str):
        self.max_workers, self.thread_name_prefix = max_workers, thread_name_prefix
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forget)
        atexit.register(self.shutdown)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        executor = self._executor
        if executor is None:
            with self._lock:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(self.max_workers, self.thread_name_prefix)
                executor = self._executor
        return executor.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=wait)

    def _forget(self) -> None:
        # In the child: the parent's threads are not here, and its lock may have been held at the fork.
        self._executor = None
        self._lock = threading.Lock()


class ReadBuffers:
    """Read buffers of local files, kept for the next batch of this process, load after load.

    A buffer's pages are faulted in by the kernel the first time a read fills
    them, and a batch keeps up to ``max_inflight`` bytes of requests in flight:
    a process that made its buffers anew for every load (or every round of
    replica reads) paid that again each time. Buffers come in sizes of powers
    of two up to ``max_request``, so a request takes one at most twice its
    length: with one size only, a batch of requests far shorter than
    ``max_request`` held many more buffers than a few of its size, and made
    most of them anew (a column reshard of a local checkpoint: about 100 at
    once, under a tenth of each used). At most ``max_inflight`` bytes, plus
    two of the largest buffers, are kept; the buffers kept longest go first.
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
        """A buffer of :meth:`size_for` ``nbytes`` bytes (``cost``: a
        :class:`~tsckpt.storage.byte_reads.ReadCost`): a kept one if any."""
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
