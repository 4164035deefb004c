"""Replicas read once: ranks that need the same region of a tensor fetch it once and pass it on.

Real gloo ranks load real checkpoints on local disk and on the moto S3 server;
what a rank fetched is counted by its ``/proc/self/io`` ``rchar`` (bytes its
read/pread calls returned, page-cache hits included: what it would fetch on a
node of its own) and, on S3, by the GET bytes a proxy in front of the server
forwarded.
"""

from __future__ import annotations

import pickle
import shutil

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

import tsckpt
from damage import edit_key, flip_byte, write_key
from dist import run_ranks
from faultproxy import FaultProxy
import zoo
from tsckpt.dcp.replica_reads import RankNote, schedule
from tsckpt.errors import OptionError, TsckptError

BUCKET = "tsckpt-replicas"
#: Where the schedule may cut each tensor's shared regions, best first: (dim, outer chunk, extent).
CUTS = {"line": ((0, 275_000, 1_100_000),), "small": (), "big": ((1, 258, 1030),)}
DIM1 = lambda fqn: CUTS.get(fqn, ((1, 32, SHAPE[1]),))  # noqa: E731
#: Eight 1 MiB float32 tensors: a copy is 8 MiB, so metadata reads are small beside a quarter of it.
NAMES = [f"layer{k}.w" for k in range(8)]
SHAPE = (512, 512)
COPY = len(NAMES) * SHAPE[0] * SHAPE[1] * 4


def _full(k: int) -> torch.Tensor:
    return torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE) * (k + 1) / 7


def _saved() -> dict[str, torch.Tensor]:
    return {name: _full(k) for k, name in enumerate(NAMES)}


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split(":")[1]) for line in f if line.startswith("rchar:"))


# --- the schedule alone ---------------------------------------------------------

def _item(fqn: str, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> ReadItem:
    return ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(fqn, offsets), dest_offsets=torch.Size([0, 0]),
                    storage_index=MetadataIndex(fqn, (0, 0)), storage_offsets=torch.Size(offsets),
                    lengths=torch.Size(lengths))


def _plans(boxes_by_rank, noted=None) -> list[LoadPlan]:
    noted = range(len(boxes_by_rank)) if noted is None else noted
    return [LoadPlan([_item(*box) for box in boxes], storage_data=RankNote(10 + r) if r in noted else None)
            for r, boxes in enumerate(boxes_by_rank)]


def test_schedule_gives_each_replica_an_even_share_and_every_rank_one_order():
    whole = [(name, (0, 0), SHAPE) for name in NAMES]
    shares = schedule(_plans([whole] * 4), lambda fqn: 4, DIM1)
    assert [int(np.count_nonzero(s.owner == s.rank)) for s in shares] == [8, 8, 8, 8]  # a stripe of each tensor
    owners = [[t.owner for t in s.transfers()] for s in shares]
    assert owners[0] == owners[1] == owners[2] == owners[3]  # everyone agrees on who fetches what
    assert owners[0] == [10, 11, 12, 13] * 8  # ranks of the default group, from the notes, stripe by stripe
    for s in shares:
        assert [t.seq for t in s.transfers()] == list(range(32))
        for t in s.transfers():
            assert set(t.receivers) == {10, 11, 12, 13} - {t.owner}
    # One member list for all, pickled once: a rank's share grows with its regions, not with the world.
    assert len({id(s.groups) for s in shares}) == 1
    assert pickle.loads(pickle.dumps(shares[1])).transfers() == shares[1].transfers()


def test_schedule_balances_bytes_and_shares_only_identical_boxes():
    # Columns of four elements (4 KiB, just large enough to share): too thin to cut into stripes, so each
    # region goes whole to one member.
    half = SHAPE[0] // 2
    top, bottom = ("w", (0, 0), (half, 4)), ("w", (half, 0), (half, 4))
    # HSDP-like: ranks 0 and 2 need the top half, 1 and 3 the bottom; rank 1 also reads a big tensor alone.
    shares = schedule(_plans([[top], [bottom, ("big", (0, 0), (4096, 512))], [top], [bottom]]), lambda fqn: 4, DIM1)
    assert [len(s.transfers()) for s in shares] == [1, 1, 1, 1]
    assert shares[1].transfers()[0].owner == 13  # rank 1 already fetches the most
    assert shares[0].transfers()[0].receivers in ((12,), (10,))
    assert shares[0].transfers()[0].part is None
    # A box that overlaps another but differs is read by each rank itself; a rank without a note shares nothing.
    shares = schedule(_plans([[top], [("w", (0, 0), (half - 1, 4))], [top]], noted=(0, 1)), lambda fqn: 4, DIM1)
    assert shares == [None, None, None]


def test_schedule_cuts_large_regions_into_one_stripe_per_member_in_rank_order():
    # Four column stripes at chunk edges, the k-th to the k-th rank; a 1-d region is cut along its one
    # dimension, and one stored as one value is fetched whole.
    big, line, small = ("big", (0, 0), (1024, 1030)), ("line", (0,), (1_100_000,)), ("small", (0, 0), (32, 32))
    shares = schedule(_plans([[big, line, small]] * 4), lambda fqn: 4, DIM1)
    transfers = shares[2].transfers()
    stripes = [(t.owner, t.part) for t in transfers if t.part is not None]
    assert stripes == [(10, (1, 0, 258)), (11, (1, 258, 516)), (12, (1, 516, 774)), (13, (1, 774, 1030)),
                       (10, (0, 0, 275000)), (11, (0, 275000, 550000)), (12, (0, 550000, 825000)),
                       (13, (0, 825000, 1100000))]
    assert [t.part for t in transfers if t.item == 2] == [None]
    assert transfers[1].box((0, 0), (1024, 1030)) == ((0, 258), (1024, 258))
    assert pickle.loads(pickle.dumps(shares[2])).transfers() == transfers
    assert [int(np.count_nonzero(s.owner == s.rank)) for s in shares].count(3) == 1  # the small region goes to one of them


def test_schedule_cuts_along_rows_where_they_give_every_member_a_stripe():
    # Saved on 4 ranks in bands: rows give 4 replicas one saved shard each (whole files, rows in place), but
    # only 2 of 4 replicas a stripe where the save had 2 ranks; then the bands are cut instead.
    region = ("w", (0, 0), (1024, 1030))
    rows, bands = (0, 256, 1024), (1, 258, 1030)
    shares = schedule(_plans([[region]] * 4), lambda fqn: 4, lambda fqn: (rows, bands))
    assert [t.part for t in shares[0].transfers()] == [(0, 0, 256), (0, 256, 512), (0, 512, 768), (0, 768, 1024)]
    shares = schedule(_plans([[region]] * 4), lambda fqn: 4, lambda fqn: ((0, 512, 1024), bands))
    assert [t.part[0] for t in shares[0].transfers()] == [1, 1, 1, 1]
    # No cut gives all 8 members a stripe: the one that gives most of them one.
    shares = schedule(_plans([[region]] * 8), lambda fqn: 4, lambda fqn: ((0, 512, 1024), bands))
    assert [t.part[0] for t in shares[0].transfers()] == [1, 1, 1, 1]
    assert [t.owner for t in shares[0].transfers()] == [10, 12, 14, 16]


def _striped_saved() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"wide": torch.randn(1024, 1030, generator=g),
            "half": torch.randn(2048, 1031, generator=g).to(torch.bfloat16),
            "line": torch.randn(1_100_000, generator=g),
            "small": torch.randn(7, 9, generator=g)}


def save_then_load_striped(rank, world, location):
    """Save row-sharded, then load every tensor whole on every rank, into a non-contiguous float32, a float64,
    a contiguous and a bfloat16 destination: the bytes this rank read and whether it got the saved values."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    saved = _striped_saved()
    dcp.save({k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None) for k, v in saved.items()},
             storage_writer=tsckpt.TensorStoreWriter(location))
    sd = {"wide": torch.zeros(1030, 1024).t(), "half": torch.zeros(2048, 1031, dtype=torch.float64),
          "line": torch.zeros(1_100_000), "small": torch.zeros(7, 9)}
    before = _rchar()
    dcp.load(sd, storage_reader=tsckpt.TensorStoreReader(location, replica_reads=True))
    read = _rchar() - before
    return read, all(torch.equal(sd[k], saved[k].to(sd[k].dtype)) for k in saved)


def test_replicated_loads_of_a_sharded_save_travel_in_stripes_bit_exactly(tmp_path):
    copy = sum(t.numel() * t.element_size() for t in _striped_saved().values())
    results = run_ranks(4, save_then_load_striped, str(tmp_path / "ck"))
    assert all(ok for _, ok in results)
    # Each rank fetches about its quarter of a copy (stripes, the small tensor, metadata), not a copy.
    assert all(read < 0.4 * copy for read, _ in results), [read / copy for read, _ in results]


def test_replica_reads_option_is_checked(tmp_path):
    with pytest.raises(OptionError, match="replica_reads='yes'"):
        tsckpt.TensorStoreReader(tmp_path, replica_reads="yes")
    assert not tsckpt.TensorStoreReader(tmp_path).shares_replica_reads()  # local disk: off by default
    assert tsckpt.TensorStoreReader({"url": "s3://bucket/p", "endpoint": "http://127.0.0.1:1"}).shares_replica_reads()


# --- real ranks -----------------------------------------------------------------

def _destination(k: int, mixed: bool) -> torch.Tensor:
    """Zeros to load tensor ``k`` into: float32 contiguous, or (``mixed``) float64 and non-contiguous in turn,
    which travel through buffers rather than straight into the destination."""
    if not mixed:
        return torch.zeros(SHAPE)
    return torch.zeros(SHAPE, dtype=torch.float64) if k % 2 else torch.zeros(SHAPE[::-1]).t()


def load_replicated(rank, world, location, loads):
    """DDP-style loads (every rank loads every tensor whole), each ``(reader options, mixed destinations)``:
    per load, the bytes this rank read and whether it got the saved values."""
    out = []
    for options, mixed in loads:
        sd = {name: _destination(k, mixed) for k, name in enumerate(NAMES)}
        before = _rchar()
        dcp.load(sd, storage_reader=tsckpt.TensorStoreReader(location, **options))
        read = _rchar() - before
        out.append((read, all(torch.equal(sd[name], _full(k).to(sd[name].dtype)) for k, name in enumerate(NAMES))))
    return out


def load_hsdp(rank, world, location):
    """A 2 x 2 mesh, [Replicate(), Shard(0)]: ranks 0, 2 need the top half of each tensor, 1, 3 the bottom."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2))
    sd = {name: distribute_tensor(torch.zeros(SHAPE), mesh, [Replicate(), Shard(0)], src_data_rank=None)
          for name in NAMES}
    before = _rchar()
    tsckpt.load(sd, location, replica_reads=True)
    read = _rchar() - before
    half = SHAPE[0] // 2
    rows = slice(half * (rank % 2), half * (rank % 2 + 1))
    return read, all(torch.equal(sd[name].to_local(), _full(k)[rows]) for k, name in enumerate(NAMES))


@pytest.fixture(scope="module")
def local_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("replicas") / "ck"
    tsckpt.save(_saved(), path)
    return path


def test_replicated_load_from_disk_fetches_a_quarter_copy_per_rank(local_ckpt):
    # A warm-up load first (lazy imports read files too), then measured loads with and without replica reads;
    # "mixed": float64 and non-contiguous destinations, which take regions through buffers.
    # "rounds": each rank's stripe of a tensor in a round of its own, so buffered receives wait for room
    # while other ranks are still sending theirs.
    on, off = {"replica_reads": True}, {"replica_reads": False}
    rounds = {"replica_reads": True, "per_thread_copy_ahead": 300 << 10}
    results = run_ranks(4, load_replicated, str(local_ckpt), [(off, False), (on, False), ({}, False), (off, False),
                                                               (on, True), (rounds, True)])
    for rank, (_, shared, default, alone, mixed, small) in enumerate(results):
        assert shared[1] and default[1] and alone[1] and mixed[1] and small[1], rank  # bit-exact every time
        for read in (shared[0], mixed[0], small[0]):
            assert 0.15 * COPY < read < 0.4 * COPY, (rank, read / COPY)
        assert default[0] > 0.95 * COPY, (rank, default[0] / COPY)  # off by default on a local disk
        assert alone[0] > 0.95 * COPY, (rank, alone[0] / COPY)
    assert sum(r[1][0] for r in results) > 0.95 * COPY  # every byte was fetched by someone


def load_zoo_whole(rank, world, location):
    """Every rank loads the whole zoo (every dtype, 0-d and empty tensors): all of it is shared."""
    sd = zoo.empty_like_expected()
    tsckpt.load(sd, location, replica_reads=True)
    zoo.assert_zoo_tensors(sd)
    return sd["extra"]


def test_every_dtype_and_shape_of_the_zoo_travels_bit_exactly(zoo4):
    for extra in run_ranks(4, load_zoo_whole, zoo4):
        assert (extra["lr"], extra["name"]) == (0.1, "run-1"), extra


def test_hsdp_replica_pairs_each_fetch_half_of_their_half(local_ckpt):
    results = run_ranks(4, load_hsdp, str(local_ckpt))
    for rank, (read, exact) in enumerate(results):
        assert exact, rank
        assert 0.15 * COPY < read < 0.4 * COPY, (rank, read / COPY)


def test_replicated_load_from_s3_gets_about_one_copy(s3):
    location = s3.location(BUCKET, "runs/replicas")
    tsckpt.save(_saved(), location)
    with FaultProxy(s3.endpoint) as proxy:
        through = {**location, "endpoint": proxy.endpoint}
        before = proxy.get_bytes
        results = run_ranks(4, load_replicated, through, [({}, False)])  # on by default on an object store
        shared = proxy.get_bytes - before
        results_alone = run_ranks(4, load_replicated, through, [({"replica_reads": False}, False)])
        alone = proxy.get_bytes - before - shared
    assert all(r[0][1] for r in results + results_alone)
    assert COPY <= shared < 1.15 * COPY, shared / COPY
    assert alone > 3.9 * COPY, alone / COPY


def load_damaged(rank, world, locations):
    """Replicated loads of damaged checkpoints, through dcp.load and tsckpt.load: what each rank raised."""
    out = []
    for location in locations:
        sd = {name: torch.zeros(SHAPE) for name in NAMES}
        try:
            dcp.load(sd, storage_reader=tsckpt.TensorStoreReader(location, replica_reads=True))
            out.append("returned")
        except CheckpointException as e:
            # Every rank's own error, gathered by DCP: each must have raised, not only the one that read the chunk.
            errors = {r: f[0] if isinstance(f, tuple) else f for r, f in e.failures.items()}
            out.append({r: (type(x).__name__, str(x)) for r, x in errors.items()})
        try:
            tsckpt.load(sd, location, replica_reads=True)
            out.append("returned")
        except TsckptError as e:
            out.append((type(e).__name__, str(e)))
    return out


def test_a_failed_read_of_a_shared_region_fails_every_rank_that_needed_it(local_ckpt, tmp_path):
    """One byte flipped in a chunk, and a chunk gone: every replica raises the error of the rank that read it."""
    flipped, missing = tmp_path / "flipped", tmp_path / "missing"
    for path in (flipped, missing):
        shutil.copytree(local_ckpt, path)
    zeros = ".".join("0" for _ in SHAPE)
    edit_key(flipped, f"layer3.w/c.{zeros}", lambda data: flip_byte(data, 1000, 0x10))
    write_key(missing, f"layer5.w/c.{zeros}", None)
    results = run_ranks(4, load_damaged, [str(flipped), str(missing)], timeout=120)
    expected = [("ChecksumError", "'layer3.w'", "does not match its stored crc32c"),
                ("StorageError", "'layer5.w'", "missing")]
    for rank, found in enumerate(results):
        for (kind, name, cause), through_dcp, through_tsckpt in zip(expected, found[::2], found[1::2]):
            assert isinstance(through_dcp, dict) and sorted(through_dcp) == [0, 1, 2, 3], (rank, through_dcp)
            for r, (raised, text) in through_dcp.items():
                assert raised == kind and name in text and cause in text, (r, raised, text)
            # tsckpt.load raises the error of the rank that read the chunk, as that rank wrote it.
            assert through_tsckpt[0] == kind and cause in through_tsckpt[1], (rank, through_tsckpt)
            assert "fetched it for this rank" not in through_tsckpt[1]


def load_with_norm(rank, world, location):
    """A replicated load of the tensors and a norm under 4 KiB (which every rank reads itself): whether it
    returned bit-exact, or what each rank raised."""
    sd = {**{name: torch.zeros(SHAPE) for name in NAMES}, "norm": torch.zeros(64)}
    try:
        dcp.load(sd, storage_reader=tsckpt.TensorStoreReader(location, replica_reads=True))
    except CheckpointException as e:
        errors = {r: f[0] if isinstance(f, tuple) else f for r, f in e.failures.items()}
        return {r: (type(x).__name__, str(x)) for r, x in errors.items()}
    return all(torch.equal(sd[n], _full(k)) for k, n in enumerate(NAMES)) and torch.equal(sd["norm"],
                                                                                          torch.arange(64.0))


def test_a_rank_s_own_small_reads_around_the_shared_regions_load_exactly_and_fail_alone(tmp_path):
    """A rank's own reads under 16 MiB start before its shared regions and are placed after them: a clean load
    is bit-exact, and a damaged norm fails every rank with its own error once the shared regions have moved."""
    path = tmp_path / "ck"
    tsckpt.save({**_saved(), "norm": torch.arange(64.0)}, path)
    assert run_ranks(4, load_with_norm, str(path), timeout=120) == [True] * 4
    edit_key(path, "norm/c.0", lambda data: flip_byte(data, 8, 0x10))
    for found in run_ranks(4, load_with_norm, str(path), timeout=120):
        assert isinstance(found, dict) and sorted(found) == [0, 1, 2, 3], found
        for r, (raised, text) in found.items():
            assert raised == "ChecksumError" and "'norm'" in text and "fetched it for this rank" not in text, text


def test_boxes_smaller_than_a_page_are_read_by_every_rank_that_needs_them():
    step, norm, big = ("step", (), ()), ("norm", (0,), (1023,)), ("big", (0, 0), (1024, 1030))
    shares = schedule(_plans([[step, norm, big]] * 4), lambda fqn: 4, DIM1)
    for share in shares:
        assert share is not None and set(share.item.tolist()) == {2}  # only the large one travels
    shares = schedule(_plans([[("norm", (0,), (1024,))]] * 4), lambda fqn: 4, lambda fqn: ((0, 256, 1024),))
    assert all(share is not None for share in shares)  # 4 KiB: shared


def test_boxes_smaller_than_a_page_go_from_the_rank_that_saved_them_when_it_needs_them_too():
    """A job resuming on the ranks that saved: each step count is passed on by the rank whose file holds it, which
    reads that file anyway, instead of every other rank reading that rank's chunk table and the count."""
    steps = [(f"step{k}", (), ()) for k in range(4)]
    saved_by = {f"step{k}": 10 + k for k in range(4)}
    shares = schedule(_plans([steps] * 4), lambda fqn: 4, DIM1, lambda region: saved_by[region[0]])
    for share in shares:
        assert share is not None and [t.owner for t in share.transfers()] == [10, 11, 12, 13]
    # Saved by a rank that does not need them (or by several): read by every rank that does, as before.
    for writer in (lambda region: 20, lambda region: None):
        assert schedule(_plans([steps] * 4), lambda fqn: 4, DIM1, writer) == [None] * 4


def test_the_share_of_a_rank_pickles_small():
    whole = [(name, (0, 0), SHAPE) for name in NAMES]
    small = schedule(_plans([whole] * 16), lambda fqn: 4, DIM1)
    large = schedule(_plans([whole] * 64), lambda fqn: 4, DIM1)
    # 4x the ranks: a rank's share grows only by the member list of its one replica group, as a region is cut
    # at its 16 chunks at most (every fourth member of 64 takes one).
    assert len(pickle.dumps(large[0])) - len(pickle.dumps(small[0])) < 60 * 4 * 8
    assert np.all(large[0].seq == np.arange(8 * 16))
    assert sorted({t.owner for t in large[0].transfers()}) == list(range(10, 74, 4))


def test_receives_are_posted_ahead_of_sends_only_where_gloo_carries_them():
    """gloo matches each message by sender and tag; NCCL runs a pair's messages in the order posted, so there a
    receive posted ahead of this rank's own sends could wait on a send queued behind the peer's receive."""
    from tsckpt.dcp.shared_reads import _backends

    assert _backends("gloo") == {"cpu": "gloo"}
    assert _backends("nccl") == {"cuda": "nccl"}
    assert _backends("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert _backends("some-plugin") is None
