"""Rank-side work of ``bench_s3_peers.py``: the S3 contenders, the measured operations, the checks.

Each phase runs on gloo CPU ranks started by ``harness.run_ranks``. Every
rank names the same S3 endpoint (``AWS_ENDPOINT_URL``: the server), as the
nodes of a cluster do, and reaches it through its own emulated link: its
proxy is the rank's HTTP proxy (``http_proxy``, which TensorStore's curl,
botocore under s3fs and the CRT under s3torchconnector all follow). A
per-rank endpoint would not do: tsckpt's coordinator sends its own location,
endpoint included, to every rank of a save, so all ranks' writes would cross
rank 0's link. A rank measures each save or load as:

* seconds: wall clock between two barriers (the slowest rank's time);
* per rank: user + system CPU seconds of the whole process (every thread:
  ``resource.getrusage(RUSAGE_SELF)``), the HTTP requests it sent and the
  bytes it sent and received (its link's counters, ``linkproxy.py``), and the
  bytes of tensor data it holds (a save) or needs (a load: its destination
  shards, a whole copy of the state on a replicated rank).

Traffic between ranks (gloo: DCP's plans, tsckpt's replica reads passing
bytes from rank to rank) does not cross the links; on a cluster it would use
the nodes' network too, usually a faster one than the path to the store.

Every load goes into a destination zeroed first and is checked bit for bit
against the values the row-sharded save was filled with (rebuilt once per
rank from the workload's seeds), 0-d steps and plain values included.
"""

from __future__ import annotations

import math
import os
import resource
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import contenders as cont
import linkproxy
import workloads as wl

REGION = "us-east-1"
FSSPEC, CONNECTOR = "dcp-fsspec", "s3torchconnector"
PEERS = (FSSPEC, CONNECTOR)
#: Loads into the saving group, in the order each contender runs them after its save.
WORLD_LOADS = ("load", "reshard_cols", "replicated")
LR, STEP = 3e-4, 1000


# --- contenders ---------------------------------------------------------------

def fsspec_peer() -> cont.Contender:
    """DCP's ``FsspecWriter``/``FsspecReader`` over s3fs, defaults (``contenders.dcp_contender`` on S3)."""
    base = cont.dcp_contender(1, s3=True)
    return cont.Contender(FSSPEC, base.save, base.load)


def connector_peer() -> cont.Contender:
    """AWS's s3torchconnector: ``S3StorageWriter``/``S3StorageReader`` with their defaults."""
    import torch.distributed.checkpoint as dcp
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

    def client() -> Any:
        # Neither S3StorageWriter nor S3StorageReader takes an endpoint; their file system's client
        # (S3FileSystem._client) does. Path-style addressing: a loopback server has no bucket host names.
        # The CRT reads the proxy (this rank's link) from http_proxy when the client is built.
        return S3Client(REGION, endpoint=os.environ["AWS_ENDPOINT_URL"],
                        s3client_config=S3ClientConfig(force_path_style=True))

    def save(sd: dict[str, Any], path: str) -> None:
        writer = S3StorageWriter(REGION, path)
        writer.fs._client = client()
        dcp.save(sd, storage_writer=writer)

    def load(sd: dict[str, Any], path: str) -> None:
        reader = S3StorageReader(REGION, path)
        reader.fs._client = client()
        dcp.load(sd, storage_reader=reader)

    return cont.Contender(CONNECTOR, save, load)


def everyone(cfg: dict[str, Any]) -> list[cont.Contender]:
    """The peers ``cfg["peers"]`` names, then tsckpt (``dcp.save``/``dcp.load``) in each of ``cfg["layouts"]``."""
    make = {FSSPEC: fsspec_peer, CONNECTOR: connector_peer}
    return [make[p]() for p in cfg["peers"]] + [cont.tsckpt_via_dcp(lay) for lay in cfg["layouts"]]


def location(cfg: dict[str, Any], name: str, leaf: str) -> str:
    """Where contender ``name`` saves in this block: ``leaf`` is ``rep<N>`` or a warm-up's name."""
    return f"s3://{cfg['bucket']}/{cfg['prefix']}/{name.replace('/', '-')}/{leaf}"


PROXY_VARIABLES = ("http_proxy", "HTTP_PROXY", "no_proxy", "NO_PROXY")


def _use_link(rank: int, cfg: dict[str, Any]) -> None:
    """Send this rank's S3 requests to the server through its own link (see the module docstring)."""
    os.environ["AWS_ENDPOINT_URL"] = cfg["server"]
    os.environ["http_proxy"] = os.environ["HTTP_PROXY"] = cfg["links"][rank]
    os.environ["no_proxy"] = os.environ["NO_PROXY"] = ""  # a no_proxy of 127.0.0.1 would bypass the link


def delete(url: str) -> None:
    """Delete every object under ``url``, straight on the server: not through the link, so not counted.

    moto keeps objects in memory: without this, every repetition's checkpoints would pile up there.
    """
    import boto3

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    saved = {k: os.environ.pop(k) for k in PROXY_VARIABLES if k in os.environ}
    try:
        s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name=REGION)
    finally:
        os.environ.update(saved)  # the client keeps what it read: no proxy
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})


# --- state dicts and checks ---------------------------------------------------

def workload(cfg: dict[str, Any]) -> wl.Workload:
    return wl.from_dict(cfg["workload"])


def state(cfg: dict[str, Any], mesh: Any, placement: str, fill: bool) -> dict[str, Any]:
    """The state dict, ``row``- or ``column``-sharded over ``mesh``, or ``replicated`` on it."""
    return wl.build_state_dict(workload(cfg), wl.DTYPES[cfg["dtype"]], mesh, column=placement == "column",
                               fill=fill, replicated=placement == "replicated",
                               moment_dtype=wl.DTYPES[cfg["moment_dtype"]])


def dtensors(sd: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], DTensor]]:
    if isinstance(sd, dict):
        for k, v in sd.items():
            yield from dtensors(v, (*path, str(k)))
    elif isinstance(sd, DTensor):
        yield path, sd


class Truth:
    """The whole value of every tensor the save wrote, rebuilt from the seeds of the ``cfg["world"]`` saving ranks."""

    def __init__(self, cfg: dict[str, Any]):
        w, saved = workload(cfg), cfg["world"]
        kinds = {"model": wl.DTYPES[cfg["dtype"]], "optim": wl.DTYPES[cfg["moment_dtype"]]}
        self.values: dict[tuple[str, ...], torch.Tensor] = {}
        for name, shape in w.params().items():
            keys = {("model", name): name} | {("optim", "state", name, m): f"{name}.{m}" for m in w.moments}
            for path, seed_name in keys.items():
                shards = [wl.seeded(seed_name, r, wl.local_shape(shape, 0, saved, r)) for r in range(saved)]
                self.values[path] = torch.cat(shards).to(kinds[path[0]])

    def check(self, dest: dict[str, Any], what: str) -> None:
        """Fail on every rank unless every rank's ``dest`` holds exactly what was saved."""
        wrong = [".".join(p) for p, t in dtensors(dest) if not _same_bits(t.to_local(), self._part(p, t))]
        steps = [s["step"] for s in dest["optim"]["state"].values()]
        if any(float(s) != STEP for s in steps) or dest["step"] != STEP:
            wrong.append("step")
        if dest["optim"]["param_groups"][0]["lr"] != LR:
            wrong.append("param_groups")
        bad = torch.tensor([len(wrong)])
        dist.all_reduce(bad)
        if int(bad):
            raise AssertionError(f"{what}: loaded values differ from the saved ones on {int(bad)} entries"
                                 f" (rank {dist.get_rank()}: {wrong[:5]})")

    def _part(self, path: tuple[str, ...], t: DTensor) -> torch.Tensor:
        """The block of the whole tensor that ``t``'s local shard holds (``torch.chunk`` shards, as DTensor's)."""
        whole = self.values[path]
        (placement,) = t.placements
        if not isinstance(placement, Shard):
            return whole
        dim, local = placement.dim, t.to_local()
        start = min(t.device_mesh.get_local_rank() * math.ceil(whole.shape[dim] / t.device_mesh.size()),
                    whole.shape[dim])
        return whole.narrow(dim, start, local.shape[dim])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    kind = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(kind), b.view(kind))


def clear(dest: dict[str, Any]) -> None:
    """Zero a destination, plain values included, so a load that leaves anything out fails its check."""
    for _, t in dtensors(dest):
        t.to_local().zero_()
    for s in dest["optim"]["state"].values():
        s["step"].zero_()
    dest["step"] = 0
    dest["optim"]["param_groups"][0]["lr"] = 0.0


# --- measuring ----------------------------------------------------------------

def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(fn: Callable[[], Any], counts: Any, held: int) -> dict[str, Any]:
    """Run ``fn`` on every rank between barriers; its seconds and every rank's CPU, requests and bytes."""
    rank = dist.get_rank()
    before, cpu = linkproxy.read_counts(counts, rank), _cpu()
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    seconds = time.perf_counter() - t0
    cpu, after = _cpu() - cpu, linkproxy.read_counts(counts, rank)
    moved = [after[f] - before[f] for f in linkproxy.FIELDS]
    row = torch.tensor([cpu, *moved, held], dtype=torch.float64)
    rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    columns = torch.stack(rows).T.tolist()
    out: dict[str, Any] = {"seconds": seconds, "cpu": columns[0]}
    for name, values in zip((*linkproxy.FIELDS, "needed"), columns[1:]):
        out[name] = [int(v) for v in values]
    return out


def _warm_up(cfg: dict[str, Any], mesh: Any, who: list[cont.Contender]) -> None:
    """A tiny save and load per contender first: imports and one-time set-up are not any figure's."""
    world = mesh.size()
    tiny = {"w": DTensor.from_local(torch.ones(8, 16), mesh, [Shard(0)], run_check=False,
                                    shape=(8 * world, 16), stride=(16, 1))}
    for c in who:
        url = location(cfg, c.name, f"warmup-{world}-ranks")
        c.save(tiny, url)
        c.load(tiny, url)


def rotated(items: list[Any], rep: int) -> list[Any]:
    """``items`` starting at position ``rep``: who goes first changes every repetition."""
    k = rep % len(items) if items else 0
    return items[k:] + items[:k]


def _add(samples: dict[str, dict[str, list[Any]]], name: str, phase: str, sample: dict[str, Any]) -> None:
    samples.setdefault(name, {}).setdefault(phase, []).append(sample)


# --- phases -------------------------------------------------------------------

def world_phase(rank: int, world: int, cfg: dict[str, Any], counts: Any) -> dict[str, Any] | None:
    """Each repetition, each contender in turn: save row-sharded, then each load of ``WORLD_LOADS`` asked for."""
    _use_link(rank, cfg)
    mesh = init_device_mesh("cpu", (world,))
    sd = state(cfg, mesh, "row", fill=True)
    truth = Truth(cfg)
    placements = {"load": "row", "reshard_cols": "column", "replicated": "replicated"}
    dests = {p: state(cfg, mesh, placements[p], fill=False) for p in WORLD_LOADS if p in cfg["phases"]}
    who = everyone(cfg)
    _warm_up(cfg, mesh, who)
    samples: dict[str, dict[str, list[Any]]] = {}
    for rep in range(cfg["reps"]):
        for c in rotated(who, rep):
            if rank == 0 and rep > 0:
                delete(location(cfg, c.name, f"rep{rep - 1}"))
            url = location(cfg, c.name, f"rep{rep}")
            _add(samples, c.name, "save", measure(lambda: c.save(sd, url), counts, wl.local_bytes(sd)))
            for phase, dest in dests.items():
                clear(dest)
                _add(samples, c.name, phase, measure(lambda: c.load(dest, url), counts, wl.local_bytes(dest)))
                truth.check(dest, f"{c.name}, {phase}, repetition {rep}")
    return samples if rank == 0 else None


def fewer_phase(rank: int, world: int, cfg: dict[str, Any], counts: Any) -> dict[str, Any] | None:
    """A smaller group loads each contender's last checkpoint column-sharded, contenders in rotating order."""
    _use_link(rank, cfg)
    mesh = init_device_mesh("cpu", (world,))
    truth = Truth(cfg)
    dest = state(cfg, mesh, "column", fill=False)
    who = everyone(cfg)
    _warm_up(cfg, mesh, who)
    samples: dict[str, dict[str, list[Any]]] = {}
    for rep in range(cfg["reps"]):
        for c in rotated(who, rep):
            url = location(cfg, c.name, f"rep{cfg['reps'] - 1}")
            clear(dest)
            _add(samples, c.name, "reshard_fewer", measure(lambda: c.load(dest, url), counts, wl.local_bytes(dest)))
            truth.check(dest, f"{c.name}, reshard_fewer, repetition {rep}")
    return samples if rank == 0 else None
