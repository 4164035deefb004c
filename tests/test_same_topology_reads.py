"""A job resuming on the ranks that saved reads every byte of each rank's own data file: on an object store, in
as few requests as the cost model's longest request allows, whatever order the bands put the values in
(tsckpt/storage/byte_reads.py). Requests are counted at an HTTP proxy in front of the S3 test server."""

from __future__ import annotations

import collections
import math

import torch
import torch.distributed.checkpoint as dcp

import tsckpt
from dist import run_ranks
from faultproxy import FaultProxy
from tsckpt.format import zarr_json

WORLD = 2
BUCKET = "tsckpt-same-topology"
#: Requests cut at 1 MiB, so that a file of a few MB is several of them.
LIMIT = 1 << 20
#: Row-sharded 2-d tensors of three widths (so bands of three widths, interleaved in each file), and scalars every
#: rank holds (as optimizer steps), which the save spreads over the ranks.
SHAPES = {"a": ((1024, 1024), torch.float32), "b": ((1024, 768), torch.bfloat16), "c": ((512, 2048), torch.float32)}
STEPS = 6


def _state(mesh, fill: bool) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    out = {}
    for k, (name, (shape, dtype)) in enumerate(SHAPES.items()):
        g = torch.Generator().manual_seed(k)
        full = torch.randn(shape, generator=g).to(dtype) if fill else torch.zeros(shape, dtype=dtype)
        out[name] = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
    out |= {f"step{k}": torch.tensor(float(k + 1) if fill else 0.0) for k in range(STEPS)}
    return out


def _save(rank, world, location):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    dcp.save(_state(mesh, fill=True), storage_writer=tsckpt.TensorStoreWriter(location, layout="packed"))


def _load(rank, world, locations):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    dest = _state(mesh, fill=False)
    dcp.load(dest, storage_reader=tsckpt.TensorStoreReader(locations[rank]))
    want = _state(mesh, fill=True)
    return (all(torch.equal(dest[k].to_local(), want[k].to_local()) for k in SHAPES)
            and all(torch.equal(dest[f"step{k}"], want[f"step{k}"]) for k in range(STEPS)))


def test_a_same_topology_load_reads_each_own_file_in_as_few_requests_as_the_longest_allows(s3):
    """Each file is read by its rank alone: the scalars saved in it reach the other ranks from that rank, not by
    a read of its chunk table and of the scalars by each of them (two requests per file, per rank)."""
    location = s3.location(BUCKET, "ck")
    run_ranks(WORLD, _save, location)
    ck = tsckpt.open(location)
    files = {f.path: f.size for rank in ck.metadata.data_files.ranks for f in rank.files}
    assert len(files) == WORLD and min(files.values()) > 4 * LIMIT
    # A request holds whole values (bands), so it may end up to one value short of the longest.
    largest = max(ck.source.locator.locate(f"{e.path}/{zarr_json.chunk_key(i)}").length  # type: ignore[union-attr]
                  for e in ck.metadata.tensors.values() for i in e.grid.indices())
    assert largest < LIMIT // 2
    with FaultProxy(s3.endpoint, rate=0.0) as first, FaultProxy(s3.endpoint, rate=0.0) as second:
        proxies = (first, second)  # one per rank: whose requests they are
        through = [location | {"endpoint": p.endpoint, "read_cost": {"max_request": LIMIT}} for p in proxies]
        assert run_ranks(WORLD, _load, through) == [True] * WORLD
        gets = [collections.Counter(path for method, path in p.dealt if method == "GET" and "/d/" in path)
                for p in proxies]
    for rank, (own, size) in enumerate(files.items()):
        assert set(gets[rank]) == {f"/{BUCKET}/ck/{own}"}, gets[rank]
        # Its chunk table (a request of its own, read before the values it locates), the scalars it passes on
        # (fetched in a round of their own), then every value.
        assert gets[rank][f"/{BUCKET}/ck/{own}"] <= math.ceil(size / (LIMIT - largest)) + 2, (gets[rank], size)
