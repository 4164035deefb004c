"""Host copies in flight: the bound on a rank's extra host memory.

A GPU tensor is saved from a host copy, and loaded through a host buffer that
is then copied to the device; inner chunks are encoded into a copy before they
are written, and read as their stored bytes before they are checked and placed.
Without a bound, a rank would hold a copy of its whole state while TensorStore
works through it: a GPU rank with 60 GB of state would need 60 GB more host
memory. The writer and the reader both pass every such copy through one
:class:`CopyWindow`.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import OptionError

#: Default bytes of host copies a rank keeps in flight (``per_thread_copy_ahead``).
#: On an H100 host (``benchmarks/bench_cuda.py``, 6 GB of bf16), 1 GiB loaded
#: in 6.1 s against 7.3 s with 256 MiB and 5.3 s unbounded, with a host peak of
#: 2.5 GB against 4.7 GB unbounded; small next to a GPU host's memory.
DEFAULT_COPY_AHEAD = 1 << 30


def check_copy_ahead(per_thread_copy_ahead: int | None) -> int | None:
    """``per_thread_copy_ahead`` as given, or a one-line error: bytes >= 0, or None for no bound."""
    if per_thread_copy_ahead is not None and (
            isinstance(per_thread_copy_ahead, bool) or not isinstance(per_thread_copy_ahead, int)
            or per_thread_copy_ahead < 0):
        raise OptionError(f"per_thread_copy_ahead={per_thread_copy_ahead!r}: expected a byte count >= 0 or None")
    return per_thread_copy_ahead


class CopyWindow:
    """At most ``limit`` bytes of host copies whose transfer still runs, plus the one being admitted.

    The caller calls ``admit(n)`` before making an ``n``-byte copy: it finishes
    the oldest transfers until ``n`` more fit (a copy larger than ``limit`` waits
    for all others, then goes alone). Then ``add(n, finish, hold)``, where
    ``finish()`` completes the transfer and ``hold`` (the copy) stays referenced
    until it has. ``drain()`` finishes the rest. ``limit`` None never waits;
    0 moves one tensor at a time.
    """

    def __init__(self, limit: int | None):
        self.limit = limit
        self.bytes = 0
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
    """Host buffers for values on their way to a destination they cannot be read into (a GPU tensor, or
    another dtype), carved out of one allocation that is reused batch after batch.

    Fresh memory costs the kernel a page fault every 4 KiB (in a sandboxed VM,
    far more than the copy itself); a load of a GPU state through fresh
    buffers pays that on every byte. :meth:`take` hands out views until the
    allocation is full, then fresh arrays; :meth:`reset` (every view handed
    out is done with) makes it large enough for the largest batch seen, so
    each batch after the first reuses it. The caller bounds a batch's bytes.
    """

    _ALIGN = 64

    def __init__(self) -> None:
        self._buffer = np.empty(0, dtype=np.uint8)
        self._used = 0
        self._wanted = 0

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
