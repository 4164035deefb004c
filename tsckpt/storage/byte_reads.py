"""Byte ranges of a checkpoint's files, planned by cost: merged where a request costs more than the gap.

Every read of tensor data ends here. A reader asks a :class:`RangeBatch` for
the byte ranges it needs (:meth:`RangeBatch.want`), from any number of files,
then runs the batch once: per file, the ranges are sorted and two neighbours
are fetched by one request when the bytes between them cost less to fetch than
a request does (:class:`ReadCost`: latency x bandwidth), large requests are
split so several are in flight, and all of them run concurrently. Each range
then gives its bytes as a view into the request's buffer.

How files are fetched is a :class:`Fetcher`: plain file calls on a local disk
(:class:`LocalFiles`: ``preadv`` into one buffer per request, on a few
threads, the GIL released; each file's size checked once against what was
written), or TensorStore ranged reads of a kvstore (:class:`KvFiles`: object
stores, memory, and the keys of an OCDBT database written before format
version 4).
"""

from __future__ import annotations

import math
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorstore as ts

from ..errors import OptionError
from .location import Location, scheme_for_driver


@dataclass(frozen=True)
class ReadCost:
    """What one request costs a rank, as seconds of waiting and bytes it could have fetched meanwhile.

    A gap between two wanted ranges of one file is read through (one request)
    when fetching it takes less time than a request's latency:
    ``gap <= latency_s * bandwidth``. ``max_request``: longer requests are cut
    into pieces about this long, fetched concurrently (a slow link is filled by
    several requests at once).
    """

    latency_s: float
    bandwidth: float  # bytes per second
    max_request: int

    @property
    def gap_bytes(self) -> int:
        return int(self.latency_s * self.bandwidth)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], default: ReadCost) -> ReadCost:
        unknown = set(d) - {"latency_s", "bandwidth", "max_request"}
        if unknown:
            raise OptionError(f"read_cost: unknown members {sorted(unknown)}; expected latency_s, bandwidth, "
                              f"max_request")
        values = {"latency_s": default.latency_s, "bandwidth": default.bandwidth,
                  "max_request": default.max_request, **d}
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in values.values()):
            raise OptionError(f"read_cost: every member is a number >= 0, not {dict(d)!r}")
        return cls(float(values["latency_s"]), float(values["bandwidth"]), max(int(values["max_request"]), 1))


#: Measured defaults (``benchmarks/bench_s3_peers.py``): a local disk's page cache or NVMe answers
#: in tens of microseconds at GB/s, an object store in tens of milliseconds at 25-200 MB/s per node.
LOCAL_COST = ReadCost(latency_s=50e-6, bandwidth=2e9, max_request=64 << 20)
OBJECT_STORE_COST = ReadCost(latency_s=0.02, bandwidth=100e6, max_request=16 << 20)
MEMORY_COST = ReadCost(latency_s=0.0, bandwidth=1e10, max_request=1 << 30)
#: The location member that overrides the model: ``{"read_cost": {"latency_s": 0.005, "bandwidth": 2e8}}``.
COST_MEMBER = "read_cost"


def read_cost(location: Location) -> ReadCost:
    """The cost model of reads from ``location``: the store kind's default, with the location's own members."""
    scheme = scheme_for_driver(location.driver)
    default = (LOCAL_COST if location.driver == "file" else MEMORY_COST if location.driver == "memory"
               else OBJECT_STORE_COST if scheme is not None and scheme.has_bucket else LOCAL_COST)
    given = location.options.get(COST_MEMBER)
    return ReadCost.from_dict(given, default) if isinstance(given, Mapping) else default


class Fetcher(ABC):
    """Reads ``[start, stop)`` of a checkpoint file, named by its key relative to the checkpoint."""

    @abstractmethod
    def fetch(self, key: str, start: int, stop: int, into: np.ndarray | None = None) -> Any:
        """Start the read; a future whose ``result()`` is the bytes as a ``uint8`` array (``into`` when given),
        or raises ValueError worded as TensorStore words it (``NOT_FOUND``, ``OUT_OF_RANGE``, ``DATA_LOSS``)."""


#: Local reads run on a few threads: enough to keep the page cache or a disk queue busy, few for 2 cores.
_LOCAL_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tsckpt-read")


class LocalFiles(Fetcher):
    """Files under a local directory, read with ``preadv``; ``sizes`` (key -> bytes written) are checked
    once per file, so a file cut short or grown fails every read of it, partial reads included."""

    def __init__(self, root: str, sizes: Mapping[str, int] | None = None):
        self.root = root
        self.sizes = dict(sizes or {})
        self._checked: dict[str, str | None] = {}
        self._lock = threading.Lock()

    def expect(self, key: str, size: int) -> None:
        """Read ``key`` only if it is ``size`` bytes long."""
        self.sizes.setdefault(key, size)

    def fetch(self, key: str, start: int, stop: int, into: np.ndarray | None = None) -> Future[np.ndarray]:
        return _LOCAL_POOL.submit(self._read, key, start, stop, into)

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
    """Keys of a TensorStore kvstore, read by byte range (object stores, memory, older OCDBT databases)."""

    def __init__(self, kv: ts.KvStore):
        self.kv = kv

    def fetch(self, key: str, start: int, stop: int, into: np.ndarray | None = None) -> Any:
        promise, out = ts.Promise.new()

        def done(f: Any) -> None:
            try:
                result = f.result()
                if result.state != "value":
                    raise ValueError(f"NOT_FOUND: {key} is missing")
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


@dataclass
class Slot:
    """One wanted range; once the batch has run, :attr:`bytes` gives them (or raises why they could not be read)."""

    key: str
    start: int
    stop: int
    data: np.ndarray | None = None
    error: BaseException | None = None

    @property
    def bytes(self) -> np.ndarray:
        if self.error is not None:
            raise self.error
        assert self.data is not None, "read before its batch ran"
        return self.data


@dataclass
class RangeBatch:
    """Byte ranges read together: wanted first, then fetched at once, merged by :class:`ReadCost`."""

    fetcher: Fetcher
    cost: ReadCost
    slots: list[Slot] = field(default_factory=list)
    #: Counters, accumulated over every :meth:`run`.
    requests: int = 0
    fetched: int = 0
    wanted: int = 0

    def want(self, key: str, start: int, stop: int) -> Slot:
        slot = Slot(key, start, stop)
        self.slots.append(slot)
        return slot

    def plan(self) -> list[tuple[str, int, int, list[Slot]]]:
        """The requests: per file, sorted ranges merged across gaps up to the cost's, cut at ``max_request``."""
        gap, limit = self.cost.gap_bytes, self.cost.max_request
        by_key: dict[str, list[Slot]] = {}
        for slot in self.slots:
            by_key.setdefault(slot.key, []).append(slot)
        requests: list[tuple[str, int, int, list[Slot]]] = []
        for key, slots in by_key.items():
            slots.sort(key=lambda s: (s.start, s.stop))
            start, stop, group = slots[0].start, slots[0].stop, [slots[0]]
            for slot in slots[1:]:
                if slot.start - stop <= gap and max(stop, slot.stop) - start <= limit:
                    stop = max(stop, slot.stop)
                    group.append(slot)
                    continue
                requests.append((key, start, stop, group))
                start, stop, group = slot.start, slot.stop, [slot]
            requests.append((key, start, stop, group))
        return requests

    def run(self) -> None:
        """Fetch every wanted range (all requests in flight at once). A range whose request failed raises
        that failure when its :attr:`Slot.bytes` are taken, so each reader reports its own."""
        requests = self.plan()
        started = []
        for key, start, stop, _ in requests:
            pieces = -(-(stop - start) // self.cost.max_request)
            if pieces <= 1:
                started.append((None, [self.fetcher.fetch(key, start, stop)]))
                continue
            # A long request in pieces, each into its part of one buffer, so the link carries several at once.
            buffer = np.empty(stop - start, dtype=np.uint8)
            started.append((buffer, [self.fetcher.fetch(key, start + a, start + b, buffer[a:b])
                                     for a, b in split(stop - start, pieces)]))
        self.requests += sum(len(f) for _, f in started)
        self.fetched += sum(stop - start for _, start, stop, _ in requests)
        self.wanted += sum(s.stop - s.start for s in self.slots)
        for (key, start, stop, group), (buffer, futures) in zip(requests, started):
            try:
                parts = [f.result() for f in futures]
            except Exception as e:  # noqa: BLE001 - handed to each range the request was for
                for slot in group:
                    slot.error = e
                continue
            data = parts[0] if buffer is None else buffer
            for slot in group:
                slot.data = data[slot.start - start:slot.stop - start]
        self.slots = []


def split(total: int, pieces: int) -> list[tuple[int, int]]:
    """``[0, total)`` cut into ``pieces`` nearly equal ``(start, stop)`` ranges."""
    step = math.ceil(total / max(pieces, 1))
    return [(a, min(a + step, total)) for a in range(0, total, step)] or [(0, 0)]
