"""Bytes fetched from a local disk against bytes needed, per rank, on resharded loads.

Every contender saves the row-sharded state dict once from ``world`` ranks;
then for each load of ``--reshards`` (by default: column-sharded on 4, 2 and 3
ranks, row-sharded on 3 ranks, replicated on 4 ranks) that many ranks load it,
one contender at a time, after a warm-up load of the same checkpoint (so that
lazy imports and first-call set-up are not counted). A replicated load is
also measured through ``TensorStoreReader`` with ``replica_reads`` off and on,
with its load time. Bytes *needed* are each rank's local shards (the whole
state dict for a replicated rank). Every figure is kept per rank, as if every
rank were on its own node.

Before each measured load the page cache is dropped; every rank reads
``/proc/self/io`` before and after. ``rchar`` counts the bytes each rank's
``read``/``pread`` calls returned: what ranks on separate nodes would fetch.
``read_bytes`` counts what the block device delivered; ranks on one machine
share a page cache, so bytes read by two ranks count once there. (gloo's
socket traffic goes through ``recv`` and is in neither.) What ranks fetch from
an object store, and the requests they send, the ``s3`` scenario measures
(``bench_s3_peers.py``), every rank behind its own link.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

import contenders as cont
import dcp_ranks
import harness
import workloads as wl


#: The loads measured by default: issue 21's table. ``placement:ranks``.
RESHARDS = "column:4,column:2,column:3,row:3,replicated:4"
PLACEMENTS = ("row", "column", "replicated")


def parse_reshards(text: str) -> list[tuple[str, int]]:
    """``"column:4,row:3"`` -> ``[("column", 4), ("row", 3)]``."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        placement, _, ranks = part.partition(":")
        if placement not in PLACEMENTS or not ranks.isdigit() or int(ranks) < 1:
            raise ValueError(f"bad reshard {part!r}: expected PLACEMENT:RANKS, PLACEMENT one of {PLACEMENTS}")
        out.append((placement, int(ranks)))
    return out


def _io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def _everyone(cfg: dict[str, Any]) -> list[cont.Contender]:
    return cont.contenders(cfg, raw=False)


def _loaders(cfg: dict[str, Any], placement: str) -> list[cont.Contender]:
    """Who loads: everyone, and on a replicated load, tsckpt's reader with replica reads off and on."""
    extra = [cont.tsckpt_reader_variant(lay, replica_reads=on) for lay in cfg["layouts"] for on in (False, True)] \
        if placement == "replicated" else []
    return _everyone(cfg) + extra


def _location(cfg: dict[str, Any], name: str) -> str:
    return f"{cfg['root']}/{name.replace('/', '-')}"


def save_phase(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    mesh = dcp_ranks.mesh(world)
    sd = wl.build_state_dict(wl.from_dict(cfg["workload"]), wl.DTYPES[cfg["dtype"]], mesh, column=False, fill=True)
    expected = wl.checksums(sd)
    times = {c.name: dcp_ranks.timed(lambda: c.save(sd, _location(cfg, c.name))) for c in _everyone(cfg)}
    return dcp_ranks.rank0({"checksums": expected, "save": times})


def load_phase(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    mesh = dcp_ranks.mesh(world)
    placement = cfg["placement"]
    dest = wl.build_state_dict(wl.from_dict(cfg["workload"]), wl.DTYPES[cfg["dtype"]], mesh,
                               column=placement == "column", fill=False, replicated=placement == "replicated")
    # A replicated destination holds every element once per rank.
    expected = [x * (world if placement == "replicated" else 1) for x in cfg["checksums"]]
    result: dict[str, Any] = {}
    for c in _loaders(cfg, placement):
        where = _location(cfg, c.loads_from or c.name)
        c.load(dest, where)  # warm-up: imports, first-call set-up
        if rank == 0:
            harness.evict(where)
        dist.barrier()
        before = _io()
        seconds = dcp_ranks.timed(lambda: c.load(dest, where))
        after = _io()
        moved = [after["rchar"] - before["rchar"], after["read_bytes"] - before["read_bytes"]]
        row = torch.tensor([wl.local_bytes(dest), *moved], dtype=torch.int64)
        rows = [torch.zeros_like(row) for _ in range(world)]
        dist.all_gather(rows, row)
        if wl.checksums(dest) != expected:
            raise AssertionError(f"{c.name}: the {placement}-sharded state dict differs from the saved one")
        needed, rchar, read_bytes = torch.stack(rows).T.tolist()
        result[c.name] = {"seconds": seconds, "needed": needed, "rchar": rchar, "read_bytes": read_bytes}
    return dcp_ranks.rank0(result)


def _measure(cfg: dict[str, Any], world: int, reshards: list[tuple[str, int]]) -> dict:
    saved = harness.run_ranks(world, save_phase, cfg)[0]
    loads = {}
    for placement, ranks in reshards:
        print(f"[fetched] {world} -> {ranks} ranks, {placement}", flush=True)
        loads[f"{placement}:{ranks}"] = harness.run_ranks(
            ranks, load_phase, cfg | {"checksums": saved["checksums"], "placement": placement})[0]
    return {"loads": loads, "save_seconds": saved["save"]}


def run(args: Any, layouts: list[str], tmp: str) -> dict[str, Any]:
    """Measure bytes fetched vs needed per rank, for each contender and load, on local disk."""
    w_cls = wl.WORKLOADS[args.fetch_workload]
    itemsize = wl.DTYPES[args.dtypes[0]].itemsize
    reshards = parse_reshards(args.reshards)
    w = w_cls.for_size(args.fetch_gb * 1e9, itemsize)
    root = os.path.join(tmp, "fetched-disk")
    os.makedirs(root)
    print(f"[fetched] local disk, {w.describe()}", flush=True)
    cfg = {"dtype": args.dtypes[0], "dcp_threads": args.dcp_threads[:1], "layouts": layouts,
           "variants": args.variants, "workload": wl.to_dict(w), "root": root}
    disk = _measure(cfg, args.world, reshards) | {"workload": wl.to_dict(w), "bytes": wl.total_bytes(w, itemsize)}
    return {"world": args.world, "reshards": [f"{p}:{n}" for p, n in reshards], "disk": disk}
