"""Byte ranges of a checkpoint's files, planned by cost: merged where a request costs more than the gap.

Every read of tensor data ends here. Per file, neighbouring ranges are fetched by one request when the bytes
between cost less than a request (:class:`ReadCost`); requests run concurrently, a bounded number of bytes at once,
in the order the reader uses them, into buffers reused once their ranges are used (:class:`ReadBuffers`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import OptionError
from .fetchers import Fetcher, LocalFiles
from .location import Location


@dataclass(frozen=True)
class ReadCost:
    """What one request costs a rank, as seconds of waiting and bytes it could have fetched meanwhile.

    A gap between two wanted ranges of one file is read through when ``gap <= latency_s * bandwidth``.
    ``max_request``: longer requests are cut into pieces about this long, fetched concurrently (a slow link is
    filled by several requests at once).
    """

    latency_s: float
    bandwidth: float  # bytes per second
    max_request: int
    #: Bytes of requests unreleased at once: enough to keep the link busy, few enough that read buffers are
    #: reused rather than made anew (fresh memory costs a page fault every 4 KiB).
    max_inflight: int
    #: Bytes of requests on their way at once (None: no bound of its own). A link shared by every request
    #: delivers them all late, together; a few at a time arrive in the order the reader uses them.
    max_arriving: int | None = None

    @property
    def gap_bytes(self) -> int:
        return int(self.latency_s * self.bandwidth)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], default: ReadCost) -> ReadCost:
        members = ("latency_s", "bandwidth", "max_request", "max_inflight", "max_arriving")
        unknown = set(d) - set(members)
        if unknown:
            raise OptionError(f"read_cost: unknown members {sorted(unknown)}; expected {', '.join(members)}")
        values = {m: getattr(default, m) for m in members} | dict(d)
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
                   for m, v in values.items() if v is not None or m != "max_arriving"):
            raise OptionError(f"read_cost: every member is a number >= 0, not {dict(d)!r}")
        arriving = values["max_arriving"]
        return cls(float(values["latency_s"]), float(values["bandwidth"]), max(int(values["max_request"]), 1),
                   max(int(values["max_inflight"]), 1), None if arriving is None else max(int(arriving), 1))


#: Defaults: a local disk's page cache or NVMe answers in tens of microseconds at GB/s, an object store
#: in tens of milliseconds at 25-200 MB/s per node.
LOCAL_COST = ReadCost(latency_s=50e-6, bandwidth=2e9, max_request=8 << 20, max_inflight=64 << 20)
#: An object store's requests are cut at 8 MiB (as AWS's CRT client cuts its parts), three on their way at once:
#: on 60 MB/s, 10 ms links a column reshard took 3.04 s so (as with 4 MiB), 3.12 s with 16 MiB all on their way
#: together (``benchmarks/bench_s3_peers.py --phases reshard_fewer``).
OBJECT_STORE_COST = ReadCost(latency_s=0.02, bandwidth=100e6, max_request=8 << 20, max_inflight=256 << 20,
                             max_arriving=24 << 20)
MEMORY_COST = ReadCost(latency_s=0.0, bandwidth=1e10, max_request=1 << 30, max_inflight=1 << 30)
#: The location member that overrides the model: ``{"read_cost": {"latency_s": 0.005, "bandwidth": 2e8}}``.
COST_MEMBER = "read_cost"


def read_cost(location: Location) -> ReadCost:
    """The cost model of reads from ``location``: the store kind's default, with the location's own members."""
    default = (MEMORY_COST if location.driver == "memory" else OBJECT_STORE_COST if location.is_object_store
               else LOCAL_COST)
    given = location.options.get(COST_MEMBER)
    return ReadCost.from_dict(given, default) if isinstance(given, Mapping) else default


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


#: Requests this large or larger read into reused buffers (:class:`ReadBuffers`).
_POOLED = 256 << 10
_BUFFERS = ReadBuffers()


class _Request:
    """One request (maybe in pieces): started in turn, its bytes shared by its ranges, its buffer reused
    once every range has been used (:meth:`Slot.release`)."""

    def __init__(self, batch: RangeBatch, key: str, start: int, stop: int, ranges: int):
        self.batch, self.key, self.start, self.stop, self.left = batch, key, start, stop, ranges
        self.pieces_left = 0
        self.seq = len(batch._queue)  # its turn
        self.futures: list[Any] | None = None
        self.buffer: np.ndarray | None = None
        self._data: np.ndarray | None = None
        self._error: BaseException | None = None
        # Set once begin() has run: the thread that claims a request from the queue begins it outside the
        # batch's lock, while another may already want its bytes.
        self._begun = threading.Event()

    def begin(self, buffer: np.ndarray | None) -> None:
        try:
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
            self.pieces_left = len(self.futures)
            for future in list(self.futures):
                future.add_done_callback(self._piece_arrived)
        except BaseException as e:
            if self.futures is None:
                self._error, self.futures = e, []
            raise
        finally:
            self._begun.set()

    def _piece_arrived(self, _: Any) -> None:
        with self.batch._lock:
            self.pieces_left -= 1
            if self.pieces_left:
                return
        self.batch._arrived(self)

    def data(self) -> np.ndarray:
        if self.futures is None:
            self.batch._pump(self)
            self._begun.wait()
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
    """One wanted range: once its batch runs, :attr:`bytes` waits for its request and gives them (or raises why
    not); :meth:`release` lets their buffer be reused."""

    key: str
    start: int
    stop: int
    _request: _Request | None = None

    @property
    def bytes(self) -> np.ndarray:
        assert self._request is not None, "read before its batch ran"
        return self._request.data()[self.start - self._request.start:self.stop - self._request.start]

    @property
    def turn(self) -> int:
        """Its request's place in the order requests start (and, a few at a time, arrive)."""
        assert self._request is not None, "planned before its batch ran"
        return self._request.seq

    def release(self) -> None:
        request, self._request = self._request, None
        if request is not None:
            request.batch._released(request)


@dataclass
class RangeBatch:
    """Byte ranges read together: wanted first, then fetched in turn, merged by :class:`ReadCost`.

    Requests start in the order their ranges were wanted, with at most ``cost.max_inflight`` bytes of them
    unreleased and ``cost.max_arriving`` on their way; a range used before its request started starts it at once.
    """

    fetcher: Fetcher
    cost: ReadCost
    slots: list[Slot] = field(default_factory=list)
    #: Counters, accumulated over every :meth:`run`.
    requests: int = 0
    fetched: int = 0
    wanted: int = 0

    def __post_init__(self) -> None:
        self._queue: list[_Request | None] = []
        self._next = self._held = self._arriving = 0
        self._stalled = False  # the pump stopped at max_arriving: the next arrival restarts it
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
            for run in _runs(slots, gap):
                requests += _cut(key, run, limit)
        requests.sort(key=lambda r: min(order[id(s)] for s in r[3]))
        return requests

    def run(self) -> None:
        """Start fetching the wanted ranges and return: each range's :attr:`Slot.bytes` waits for its own request
        (and raises its failure, so each reader reports its own)."""
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
        """Start queued requests while they fit in ``max_inflight`` and ``max_arriving`` (and all up to
        ``upto``, whatever it takes)."""
        while True:
            with self._lock:
                if self._next >= len(self._queue):
                    return
                request = self._queue[self._next]
                assert request is not None  # only those before _next have begun
                size = request.stop - request.start
                due = upto is not None and upto.seq >= self._next
                if not due and self._held and self._held + size > self.cost.max_inflight:
                    return
                wire = self.cost.max_arriving
                if not due and wire is not None and self._arriving and self._arriving + size > wire:
                    self._stalled = True
                    return
                # Begun: the queue lets go of it, so that the batch and its requests (which refer to it) form
                # no reference cycle that would keep the fetcher's TensorStore objects for the collector.
                self._queue[self._next] = None
                self._next += 1
                self._held += size
                self._arriving += size
                buffer = self._buffer(size)
            request.begin(buffer)

    def _arrived(self, request: _Request) -> None:
        # Only a pump that stopped for arrivals is restarted: a request that completes inside begin() (a
        # memory store) must not start the next one from its own callback, request after request.
        with self._lock:
            self._arriving -= request.stop - request.start
            stalled, self._stalled = self._stalled, False
        if stalled:
            self._pump()

    def _buffer(self, size: int) -> np.ndarray | None:
        """A reused buffer for a request of ``size`` bytes into local files (None: the fetcher makes its own; object
        stores hand over bytes of their own, and small requests are cheap to allocate)."""
        if not isinstance(self.fetcher, LocalFiles) or not _POOLED <= size <= self.cost.max_request:
            return None
        return _BUFFERS.take(size, self.cost)[:size]

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


def _runs(slots: list[Slot], gap: int) -> list[list[Slot]]:
    runs, stop = [[slots[0]]], slots[0].stop
    for slot in slots[1:]:
        if slot.start - stop <= gap:
            runs[-1].append(slot)
        else:
            runs.append([slot])
        stop = max(stop, slot.stop)
    return runs


def _cut(key: str, run: list[Slot], limit: int) -> list[tuple[str, int, int, list[Slot]]]:
    """One run of ranges as requests of at most ``limit`` bytes (a longer range alone), all about as long: a short
    last request would cost a request's latency for a few bytes."""
    stop = max(s.stop for s in run)
    pieces = max(1, -(-(stop - run[0].start) // limit))  # an empty value is still one request
    target = -(-(stop - run[0].start) // pieces)
    out: list[tuple[str, int, int, list[Slot]]] = []
    start, end, group = run[0].start, run[0].stop, [run[0]]
    for slot in run[1:]:
        if slot.stop <= end or (slot.stop - start <= limit and slot.start - start < target):
            end = max(end, slot.stop)
            group.append(slot)
            continue
        out.append((key, start, end, group))
        start, end, group = slot.start, slot.stop, [slot]
    out.append((key, start, end, group))
    return out


def split(total: int, pieces: int) -> list[tuple[int, int]]:
    step = math.ceil(total / max(pieces, 1))
    return [(a, min(a + step, total)) for a in range(0, total, step)] or [(0, 0)]
