"""Host copies in flight (GPU tensors' host copies, encoded inner chunks, stored bytes before their check):
the writer and the reader pass each through one :class:`CopyWindow`, which bounds a rank's extra host memory."""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import OptionError

#: Default bytes of host copies a rank keeps in flight (``per_thread_copy_ahead``). On an H100 host
#: (``benchmarks/bench_cuda.py``, 6 GB of bf16), 1 GiB loaded in 6.1 s against 7.3 s with 256 MiB and 5.3 s
#: unbounded, with a host peak of 2.5 GB against 4.7 GB unbounded.
DEFAULT_COPY_AHEAD = 1 << 30


def check_copy_ahead(per_thread_copy_ahead: int | None) -> int | None:
    if per_thread_copy_ahead is not None and (
            isinstance(per_thread_copy_ahead, bool) or not isinstance(per_thread_copy_ahead, int)
            or per_thread_copy_ahead < 0):
        raise OptionError(f"per_thread_copy_ahead={per_thread_copy_ahead!r}: expected a byte count >= 0 or None")
    return per_thread_copy_ahead


class CopyWindow:
    """At most ``limit`` bytes of host copies whose transfer still runs, plus the one being admitted.

    ``admit(n)`` before making an ``n``-byte copy finishes the oldest transfers until ``n`` more fit;
    ``add(n, finish, hold)`` records it (``hold`` referenced until ``finish()`` ran); ``drain()`` finishes the
    rest. ``limit`` None never waits; 0 moves one tensor at a time.
    """

    def __init__(self, limit: int | None):
        self.limit, self.bytes = limit, 0
        self.inflight: collections.deque[tuple[int, Callable[[], None], Any]] = collections.deque()

    def admit(self, nbytes: int) -> None:
        while self.limit is not None and self.inflight and self.bytes + nbytes > self.limit:
            self._finish_oldest()

    def add(self, nbytes: int, finish: Callable[[], None], hold: Any = None) -> None:
        self.inflight.append((nbytes, finish, hold))
        self.bytes += nbytes

    def drain(self) -> None:
        while self.inflight:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        size, finish, _ = self.inflight.popleft()
        finish()
        self.bytes -= size


class Scratch:
    """Host buffers for values bound for a destination they cannot be read into (a GPU tensor, another dtype),
    carved out of one allocation reused batch after batch (fresh memory costs a page fault every 4 KiB).
    :meth:`take` hands out views until it is full, then fresh arrays; :meth:`reset` (every view done with)
    grows it to the largest batch seen."""

    _ALIGN = 64

    def __init__(self) -> None:
        self._buffer = np.empty(0, dtype=np.uint8)
        self._used = self._wanted = 0

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        nbytes = math.prod(shape) * dtype.itemsize
        start, self._wanted = self._used, self._wanted + -(-nbytes // self._ALIGN) * self._ALIGN
        if start + nbytes > self._buffer.size:
            return np.empty(shape, dtype=dtype)
        self._used = self._wanted
        return self._buffer[start:start + nbytes].view(dtype).reshape(shape)

    def reset(self) -> None:
        if self._wanted > self._buffer.size:
            self._buffer = np.empty(0, dtype=np.uint8)  # let the old one go first
            self._buffer = np.empty(self._wanted, dtype=np.uint8)
        self._used = self._wanted = 0
