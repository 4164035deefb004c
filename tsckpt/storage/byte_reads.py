"""Byte ranges of a checkpoint's files, planned by cost: merged where a request costs more than the gap.

Every read of tensor data ends here. A reader asks a :class:`RangeBatch` for
the byte ranges it needs (:meth:`RangeBatch.want`), from any number of files,
then runs the batch once: per file, the ranges are sorted and two neighbours
are fetched by one request when the bytes between them cost less to fetch than
a request does (:class:`ReadCost`: latency x bandwidth), large requests are
split so several are in flight, and requests run concurrently, a bounded
number of bytes of them at once, in the order the reader uses them. Each range
then gives its bytes as a view into the request's buffer, which is reused
once every range in it has been used.

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
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorstore as ts

from ..errors import OptionError
from .location import Location
from .pools import ProcessPool, ReadBuffers


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
    #: Bytes of requests in flight at once: enough to keep the link busy, few enough that read buffers
    #: are reused rather than made anew (fresh memory costs the kernel a page fault every 4 KiB).
    max_inflight: int

    @property
    def gap_bytes(self) -> int:
        return int(self.latency_s * self.bandwidth)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], default: ReadCost) -> ReadCost:
        members = ("latency_s", "bandwidth", "max_request", "max_inflight")
        unknown = set(d) - set(members)
        if unknown:
            raise OptionError(f"read_cost: unknown members {sorted(unknown)}; expected {', '.join(members)}")
        values = {m: getattr(default, m) for m in members} | dict(d)
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in values.values()):
            raise OptionError(f"read_cost: every member is a number >= 0, not {dict(d)!r}")
        return cls(float(values["latency_s"]), float(values["bandwidth"]), max(int(values["max_request"]), 1),
                   max(int(values["max_inflight"]), 1))


#: Defaults: a local disk's page cache or NVMe answers in tens of microseconds at GB/s, an object store
#: in tens of milliseconds at 25-200 MB/s per node.
LOCAL_COST = ReadCost(latency_s=50e-6, bandwidth=2e9, max_request=8 << 20, max_inflight=64 << 20)
OBJECT_STORE_COST = ReadCost(latency_s=0.02, bandwidth=100e6, max_request=16 << 20, max_inflight=256 << 20)
MEMORY_COST = ReadCost(latency_s=0.0, bandwidth=1e10, max_request=1 << 30, max_inflight=1 << 30)
#: The location member that overrides the model: ``{"read_cost": {"latency_s": 0.005, "bandwidth": 2e8}}``.
COST_MEMBER = "read_cost"


def read_cost(location: Location) -> ReadCost:
    """The cost model of reads from ``location``: the store kind's default, with the location's own members."""
    default = (MEMORY_COST if location.driver == "memory" else OBJECT_STORE_COST if location.is_object_store
               else LOCAL_COST)
    given = location.options.get(COST_MEMBER)
    return ReadCost.from_dict(given, default) if isinstance(given, Mapping) else default


class Fetcher(ABC):
    """Reads ``[start, stop)`` of a checkpoint file, named by its key relative to the checkpoint."""

    @abstractmethod
    def fetch(self, key: str, start: int, stop: int, into: np.ndarray | None = None) -> Any:
        """Start the read; a future whose ``result()`` is the bytes as a ``uint8`` array (``into`` when given),
        or raises ValueError worded as TensorStore words it (``NOT_FOUND``, ``OUT_OF_RANGE``, ``DATA_LOSS``)."""


#: Local reads run on a few threads: enough to keep the page cache or a disk queue busy, few for 2 cores.
_LOCAL_POOL = ProcessPool(max_workers=4, thread_name_prefix="tsckpt-read")


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
    """Keys of a TensorStore kvstore, read by byte range (object stores, memory, older OCDBT databases).

    ``generations`` (key -> the generation the store gave the object when it was written, its ETag on S3):
    every read of such a key, partial reads included, must come from that generation, so an object
    truncated or rewritten since is refused without a request of its own.
    """

    def __init__(self, kv: ts.KvStore, generations: Mapping[str, bytes] | None = None):
        self.kv = kv
        self.generations = dict(generations or {})

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


#: Requests this large or larger read into reused buffers of ``max_request`` bytes.
_POOLED = 256 << 10


_BUFFERS = ReadBuffers()


class _Request:
    """One request (maybe in pieces): started in turn, its bytes shared by its ranges, its buffer reused
    once every range has been used (:meth:`Slot.release`)."""

    def __init__(self, batch: RangeBatch, key: str, start: int, stop: int, ranges: int):
        self.batch, self.key, self.start, self.stop, self.left = batch, key, start, stop, ranges
        self.seq = len(batch._queue)  # its turn
        self.futures: list[Any] | None = None
        self.buffer: np.ndarray | None = None
        self._data: np.ndarray | None = None
        self._error: BaseException | None = None

    def begin(self, buffer: np.ndarray | None) -> None:
        """Start fetching, into ``buffer`` (a reused one) if given, in pieces of at most ``max_request``."""
        size, limit = self.stop - self.start, self.batch.cost.max_request
        pieces = -(-size // limit)
        if buffer is None and pieces > 1:
            buffer = np.empty(size, dtype=np.uint8)
        self.buffer = buffer
        fetch = self.batch.fetcher.fetch
        if buffer is None:
            self.futures = [fetch(self.key, self.start, self.stop)]
        else:
            self.futures = [fetch(self.key, self.start + a, self.start + b, buffer[a:b])
                            for a, b in split(size, pieces)]
        self.batch.requests += len(self.futures)

    def data(self) -> np.ndarray:
        if self.futures is None:
            self.batch._begin_up_to(self)
        if self._data is None and self._error is None:
            assert self.futures is not None
            try:
                parts = [f.result() for f in self.futures]
                self._data = parts[0] if self.buffer is None else self.buffer
            except Exception as e:  # noqa: BLE001 - raised to every range of the request
                self._error = e
            self.futures = []
        if self._error is not None:
            raise self._error
        assert self._data is not None
        return self._data


@dataclass
class Slot:
    """One wanted range; once its batch runs, :attr:`bytes` waits for its request and gives them (or raises
    why they could not be read). :meth:`release` says they are no longer needed (their buffer is reused)."""

    key: str
    start: int
    stop: int
    _request: _Request | None = None

    @property
    def bytes(self) -> np.ndarray:
        assert self._request is not None, "read before its batch ran"
        return self._request.data()[self.start - self._request.start:self.stop - self._request.start]

    def release(self) -> None:
        request, self._request = self._request, None
        if request is not None:
            request.batch._released(request)


@dataclass
class RangeBatch:
    """Byte ranges read together: wanted first, then fetched in turn, merged by :class:`ReadCost`.

    Requests start in the order their ranges were wanted (the order a reader
    uses them), with at most ``cost.max_inflight`` bytes of them unreleased;
    a range used before its request started starts it at once. Buffers of
    released requests (local files) are reused for the next ones.
    """

    fetcher: Fetcher
    cost: ReadCost
    slots: list[Slot] = field(default_factory=list)
    #: Counters, accumulated over every :meth:`run`.
    requests: int = 0
    fetched: int = 0
    wanted: int = 0

    def __post_init__(self) -> None:
        self._queue: list[_Request] = []
        self._next = 0
        self._held = 0
        self._lock = threading.Lock()

    def want(self, key: str, start: int, stop: int) -> Slot:
        slot = Slot(key, start, stop)
        self.slots.append(slot)
        return slot

    def plan(self) -> list[tuple[str, int, int, list[Slot]]]:
        """The requests: per file, sorted ranges merged across gaps up to the cost's, cut at ``max_request``;
        in the order their first range was wanted."""
        gap, limit = self.cost.gap_bytes, self.cost.max_request
        order = {id(s): k for k, s in enumerate(self.slots)}
        by_key: dict[str, list[Slot]] = {}
        for slot in self.slots:
            by_key.setdefault(slot.key, []).append(slot)
        requests: list[tuple[str, int, int, list[Slot]]] = []
        for key, slots in by_key.items():
            slots.sort(key=lambda s: (s.start, -s.stop))  # a range inside another joins it, whatever its length
            start, stop, group = slots[0].start, slots[0].stop, [slots[0]]
            for slot in slots[1:]:
                if slot.stop <= stop or (slot.start - stop <= gap and slot.stop - start <= limit):
                    stop = max(stop, slot.stop)
                    group.append(slot)
                    continue
                requests.append((key, start, stop, group))
                start, stop, group = slot.start, slot.stop, [slot]
            requests.append((key, start, stop, group))
        requests.sort(key=lambda r: min(order[id(s)] for s in r[3]))
        return requests

    def run(self) -> None:
        """Start fetching the wanted ranges and return: each range's :attr:`Slot.bytes` waits for its own
        request, so what arrives first is used first. A request that failed raises its failure to each of
        its ranges, so each reader reports its own."""
        requests = self.plan()
        for key, start, stop, group in requests:
            request = _Request(self, key, start, stop, len(group))
            for slot in group:
                slot._request = request
            self._queue.append(request)
        self.fetched += sum(stop - start for _, start, stop, _ in requests)
        self.wanted += sum(s.stop - s.start for s in self.slots)
        self.slots = []
        self._pump()

    def _pump(self, upto: _Request | None = None) -> None:
        """Start queued requests while they fit in ``max_inflight`` (and all up to ``upto``, whatever it takes)."""
        while True:
            with self._lock:
                if self._next >= len(self._queue):
                    return
                request = self._queue[self._next]
                size = request.stop - request.start
                due = upto is not None and upto.seq >= self._next
                if not due and self._held and self._held + size > self.cost.max_inflight:
                    return
                self._next += 1
                self._held += size
                buffer = self._buffer(size)
            request.begin(buffer)

    def _begin_up_to(self, request: _Request) -> None:
        self._pump(request)

    def _buffer(self, size: int) -> np.ndarray | None:
        """A reused buffer for a request of ``size`` bytes into local files (None: the fetcher makes its own:
        object stores hand over bytes of their own, and small requests are cheap to allocate)."""
        if not isinstance(self.fetcher, LocalFiles) or not _POOLED <= size <= self.cost.max_request:
            return None
        return _BUFFERS.take(self.cost)[:size]

    def _released(self, request: _Request) -> None:
        with self._lock:
            request.left -= 1
            if request.left:
                return
            self._held -= request.stop - request.start
            if request.buffer is not None and request.buffer.base is not None:
                _BUFFERS.give(request.buffer.base, self.cost)
            request.buffer, request._data = None, None
        self._pump()


def split(total: int, pieces: int) -> list[tuple[int, int]]:
    """``[0, total)`` cut into ``pieces`` nearly equal ``(start, stop)`` ranges."""
    step = math.ceil(total / max(pieces, 1))
    return [(a, min(a + step, total)) for a in range(0, total, step)] or [(0, 0)]
