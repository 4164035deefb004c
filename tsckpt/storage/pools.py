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
    replica reads) paid that again each time. At most enough buffers for one
    batch's requests in flight, and two more, are kept, per buffer size.
    """

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def take(self, cost: Any) -> np.ndarray:
        """A buffer of ``cost.max_request`` bytes (a :class:`~tsckpt.storage.byte_reads.ReadCost`): a kept one if any."""
        with self._lock:
            free = self._free.get(cost.max_request)
            if free:
                return free.pop()
        return np.empty(cost.max_request, dtype=np.uint8)

    def give(self, buffer: np.ndarray, cost: Any) -> None:
        """Keep ``buffer`` for a later :meth:`take`, unless enough of its size are kept already."""
        with self._lock:
            free = self._free.setdefault(buffer.size, [])
            if len(free) < cost.max_inflight // max(cost.max_request, 1) + 2:
                free.append(buffer)
