"""Reads planned by cost: ranges of one file merge when the gap costs less than a request, per kind of store,
and a location's ``read_cost`` member overrides the model."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import numpy as np
import pytest

from tsckpt.errors import OptionError
from tsckpt.storage import byte_reads
from tsckpt.storage.byte_reads import LOCAL_COST, OBJECT_STORE_COST, RangeBatch, ReadCost
from tsckpt.storage.fetchers import LocalFiles
from tsckpt.storage.location import parse_location


def _file(tmp_path, name: str, size: int) -> bytes:
    data = np.random.default_rng(len(name)).integers(0, 255, size, dtype=np.uint8).tobytes()
    (tmp_path / name).write_bytes(data)
    return data


def _read(tmp_path, cost: ReadCost, ranges: list[tuple[str, int, int]]) -> RangeBatch:
    """Read ``ranges`` of files under ``tmp_path`` and check each slot's bytes against the file's."""
    batch = RangeBatch(LocalFiles(str(tmp_path)), cost)
    slots = [batch.want(*r) for r in ranges]
    batch.run()
    for slot in slots:
        expected = (tmp_path / slot.key).read_bytes()[slot.start:slot.stop]
        assert slot.bytes.tobytes() == expected, (slot.key, slot.start, slot.stop)
        slot.release()
    return batch


def test_ranges_merge_across_gaps_cheaper_than_a_request(tmp_path):
    _file(tmp_path, "a", 4 << 20)
    _file(tmp_path, "b", 1 << 20)
    gap = LOCAL_COST.gap_bytes
    # a: two ranges a gap apart that is worth reading, then one a gap too far; b: one range of its own.
    ranges = [("a", 0, 1000), ("a", 1000 + gap, 2000 + gap), ("a", 2000 + 2 * gap + 1, 3000 + 2 * gap + 1),
              ("b", 10, 20)]
    batch = _read(tmp_path, LOCAL_COST, ranges)
    assert batch.requests == 3
    assert batch.wanted == 3010 and batch.fetched == 2000 + gap + 1000 + 10


def test_an_object_store_merges_wider_gaps_than_a_disk(tmp_path):
    _file(tmp_path, "a", 4 << 20)
    ranges = [("a", k << 20, (k << 20) + 4096) for k in range(4)]  # 1 MiB apart: worth it at 20 ms, not 50 µs
    assert _read(tmp_path, LOCAL_COST, ranges).requests == 4
    assert _read(tmp_path, OBJECT_STORE_COST, ranges).requests == 1


def test_long_requests_are_cut_at_max_request_and_still_read_every_byte(tmp_path):
    _file(tmp_path, "a", 3 << 20)
    cost = ReadCost(latency_s=1.0, bandwidth=1e9, max_request=1 << 20, max_inflight=1 << 20)
    batch = _read(tmp_path, cost, [("a", 0, 3 << 20), ("a", 5, 17)])
    assert batch.requests == 3 and batch.fetched == 3 << 20


def test_the_wanted_order_is_the_request_order(tmp_path):
    for name in "abc":
        _file(tmp_path, name, 1000)
    batch = RangeBatch(LocalFiles(str(tmp_path)), LOCAL_COST)
    for name in "cab":
        batch.want(name, 0, 10)
    assert [key for key, *_ in batch.plan()] == ["c", "a", "b"]


def test_a_file_cut_short_fails_every_read_of_it(tmp_path):
    _file(tmp_path, "a", 1 << 20)
    os.truncate(tmp_path / "a", 1 << 19)
    batch = RangeBatch(LocalFiles(str(tmp_path), {"a": 1 << 20}), LOCAL_COST)
    slot = batch.want("a", 0, 10)  # its intact start
    batch.run()
    with pytest.raises(ValueError, match="DATA_LOSS: .* is 524288 bytes, not the 1048576 written"):
        slot.bytes


def test_defaults_per_kind_of_store_and_the_location_override():
    assert byte_reads.read_cost(parse_location("/tmp/ck")) == LOCAL_COST
    assert byte_reads.read_cost(parse_location("s3://bucket/ck")) == OBJECT_STORE_COST
    given = byte_reads.read_cost(parse_location({"url": "s3://bucket/ck", "read_cost": {"latency_s": 0.005}}))
    assert given == dataclasses.replace(OBJECT_STORE_COST, latency_s=0.005)
    assert given.gap_bytes == 500_000


@pytest.mark.parametrize("members, message", [
    ({"latency": 0.005}, r"read_cost: unknown members \['latency'\]; expected latency_s, bandwidth"),
    ({"bandwidth": -1}, "read_cost: every member is a number >= 0"),
    ({"bandwidth": "fast"}, "read_cost: every member is a number >= 0"),
])
def test_a_bad_override_is_one_line_naming_the_member(members, message):
    with pytest.raises(OptionError, match=message):
        byte_reads.read_cost(parse_location({"url": "/tmp/ck", "read_cost": members}))


def test_read_buffers_outlive_a_batch_and_stay_bounded(tmp_path):
    """A second batch of this process reads into the buffers the first one used (their pages are already
    faulted in), and no more bytes are kept than one batch's requests in flight, plus two of the largest."""
    cost = ReadCost(latency_s=0.0, bandwidth=1e9, max_request=1 << 20, max_inflight=2 << 20)
    _file(tmp_path, "a", 6 << 20)
    ranges = [("a", k << 20, (k << 20) + (512 << 10)) for k in range(6)]  # six requests, unmerged
    pool = byte_reads._BUFFERS
    for _ in range(2):
        batch = _read(tmp_path, cost, ranges)
        assert batch.requests == 6
        kept = list(pool._free[512 << 10])
        assert 1 <= len(kept) <= 6
    again = pool.take(512 << 10, cost)
    assert any(again is b for b in kept), "a later batch reads into a kept buffer"
    for _ in range(10):
        pool.give(np.empty(cost.max_request, dtype=np.uint8), cost)
    assert sum(b.size for bs in pool._free.values() for b in bs) <= cost.max_inflight + 2 * cost.max_request
    assert len(pool._free[cost.max_request]) == 4, "the newest buffers are kept, the oldest dropped"


@pytest.mark.parametrize("nbytes, size", [(256 << 10, 256 << 10), ((256 << 10) + 1, 512 << 10),
                                          (700 << 10, 1 << 20), (1 << 20, 1 << 20)])
def test_a_read_takes_a_buffer_at_most_twice_its_length(nbytes, size):
    """Buffers come in powers of two up to max_request, so many short requests do not each hold one of the
    largest (and make it anew when the pool keeps only a few of that size)."""
    cost = ReadCost(latency_s=0.0, bandwidth=1e9, max_request=1 << 20, max_inflight=2 << 20)
    assert byte_reads._BUFFERS.take(nbytes, cost).size == size


class _Watched(LocalFiles):
    """Local files whose reads take a while, counting the bytes on their way at once."""

    def __init__(self, root: str):
        super().__init__(root)
        self.arriving = self.most = 0
        self.order: list[int] = []
        self._count = threading.Lock()

    def _read(self, key, start, stop, into):
        with self._count:
            self.arriving += stop - start
            self.most = max(self.most, self.arriving)
        time.sleep(0.01)
        try:
            return super()._read(key, start, stop, into)
        finally:
            with self._count:
                self.arriving -= stop - start
                self.order.append(start)


def test_at_most_max_arriving_bytes_are_on_their_way_and_they_come_in_the_order_wanted(tmp_path):
    """A link shared by every request delivers them all at the end; a few at a time arrive in turn."""
    data = _file(tmp_path, "a", 8 << 20)
    cost = ReadCost(latency_s=0.0, bandwidth=1e9, max_request=1 << 20, max_inflight=64 << 20,
                    max_arriving=2 << 20)
    fetcher = _Watched(str(tmp_path))
    batch = RangeBatch(fetcher, cost)
    slots = [batch.want("a", k << 20, (k + 1) << 20) for k in range(8)]  # eight requests of 1 MiB
    batch.run()
    assert b"".join(s.bytes.tobytes() for s in slots) == data
    assert batch.requests == 8 and fetcher.most == 2 << 20
    assert sorted(fetcher.order[:2]) == [0, 1 << 20] and fetcher.order[-1] >= 6 << 20
    unbounded = _Watched(str(tmp_path))
    batch = RangeBatch(unbounded, dataclasses.replace(cost, max_arriving=None))
    slots = [batch.want("a", k << 20, (k + 1) << 20) for k in range(8)]
    batch.run()
    assert all(s.bytes.size == 1 << 20 for s in slots)
    assert unbounded.most > 2 << 20  # the pool's four threads at once


def test_a_range_used_before_its_turn_starts_its_request_whatever_is_on_its_way(tmp_path):
    data = _file(tmp_path, "a", 4 << 20)
    cost = ReadCost(latency_s=0.0, bandwidth=1e9, max_request=1 << 20, max_inflight=64 << 20,
                    max_arriving=1 << 20)
    batch = RangeBatch(_Watched(str(tmp_path)), cost)
    slots = [batch.want("a", k << 20, (k << 20) + 10) for k in range(4)]
    batch.run()
    assert slots[3].bytes.tobytes() == data[3 << 20:(3 << 20) + 10]
    assert [s.bytes.tobytes() for s in slots[:3]] == [data[k << 20:(k << 20) + 10] for k in range(3)]


class _SlowToStart(LocalFiles):
    """Local files whose request for ``b`` takes a while to start: ``starting`` is set once one is on its way."""

    def __init__(self, root: str):
        super().__init__(root)
        self.starting, self.go = threading.Event(), threading.Event()

    def fetch(self, key, start, stop, into=None):
        if key == "b":
            self.starting.set()
            self.go.wait(10)
        return super().fetch(key, start, stop, into)


def test_bytes_wanted_while_another_thread_starts_their_request_wait_for_it(tmp_path):
    """A released range lets another thread start the next request; its bytes, wanted meanwhile, wait for that
    start instead of finding the request claimed but not begun."""
    _file(tmp_path, "a", 1000)
    data = _file(tmp_path, "b", 1000)
    fetcher = _SlowToStart(str(tmp_path))
    batch = RangeBatch(fetcher, ReadCost(latency_s=0.0, bandwidth=1e9, max_request=1 << 20, max_inflight=1000))
    first, second = batch.want("a", 0, 1000), batch.want("b", 0, 1000)
    batch.run()  # "b" waits for "a" to be released: one request's bytes may be held at a time
    first.bytes
    releasing = threading.Thread(target=first.release)
    releasing.start()
    assert fetcher.starting.wait(10)
    threading.Timer(0.2, fetcher.go.set).start()
    assert second.bytes.tobytes() == data
    releasing.join(10)


def test_max_arriving_is_a_read_cost_member():
    given = byte_reads.read_cost(parse_location({"url": "s3://bucket/ck", "read_cost": {"max_arriving": 1 << 20}}))
    assert given == dataclasses.replace(OBJECT_STORE_COST, max_arriving=1 << 20)
    with pytest.raises(OptionError, match="read_cost: every member is a number >= 0"):
        byte_reads.read_cost(parse_location({"url": "/tmp/ck", "read_cost": {"max_arriving": -1}}))
