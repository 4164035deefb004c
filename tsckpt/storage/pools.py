"""Thread pools shared by a module's callers, one per process, made on first use and shut down at exit.

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
