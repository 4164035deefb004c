"""Bytes fetched from storage against bytes needed, per rank, on resharded loads: local disk and S3.

Every contender saves the row-sharded state dict once from ``world`` ranks;
then for each load of ``--reshards`` (by default: column-sharded on 4, 2 and 3
ranks, row-sharded on 3 ranks, replicated on 4 ranks) that many ranks load it,
one contender at a time, after a warm-up load of the same checkpoint (so that
lazy imports and first-call set-up are not counted). A replicated load is
also measured through ``TensorStoreReader`` with ``replica_reads`` off and on
(by default it is on for S3 only), with its load time. Bytes *needed* are each
rank's local shards (the whole state dict for a replicated rank). Every figure
is kept per rank, as if every rank were on its own node.

* Local disk: before each measured load the page cache is dropped; every rank
  reads ``/proc/self/io`` before and after. ``rchar`` counts the bytes each
  rank's ``read``/``pread`` calls returned: what ranks on separate nodes would
  fetch. ``read_bytes`` counts what the block device delivered; ranks on one
  machine share a page cache, so bytes read by two ranks count once there.
  (gloo's socket traffic goes through ``recv`` and is in neither.)
* S3: a moto server on loopback behind one byte-counting TCP proxy per rank,
  started by this process. Both libraries talk to the proxy of their rank
  (tsckpt's TensorStore ``s3`` kvstore through ``AWS_ENDPOINT_URL``, DCP through
  ``FsspecWriter`` / ``FsspecReader`` over s3fs with the same endpoint), so the
  counters measure the bytes each rank got: HTTP bodies plus headers, and the
  requests it sent (counted only during loads, which send no bodies).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import contenders as cont
import dcp_ranks
import harness
import workloads as wl



# --- counting proxy (parent process) -------------------------------------------

class CountingProxy:
    """A TCP forwarder on 127.0.0.1 that counts bytes and HTTP requests in shared counters."""

    def __init__(self, target_port: int):
        ctx = mp.get_context("forkserver")  # the ranks (harness.run_ranks) come from the forkserver
        self.served = ctx.Value("q", 0)  # bytes from the server to clients
        self.requests = ctx.Value("q", 0)  # request header ends seen from clients
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pump, args=(client, server, self.requests, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.served, False), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, counter: Any, count_requests: bool) -> None:
        tail = b""
        try:
            while data := src.recv(1 << 20):
                dst.sendall(data)
                with counter.get_lock():
                    if count_requests:
                        # A header end may straddle two reads: look at the last 3 bytes too.
                        counter.value += (tail + data).count(b"\r\n\r\n")
                        tail = data[-3:]
                    else:
                        counter.value += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            src.close()

    def close(self) -> None:
        self._stop = True
        self._listener.close()


# --- rank phases ---------------------------------------------------------------

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
    return cont.contenders(cfg, raw=False, s3=cfg["s3"])


def _loaders(cfg: dict[str, Any], placement: str) -> list[cont.Contender]:
    """Who loads: everyone, and on a replicated load, tsckpt's reader with replica reads off and on."""
    extra = [cont.tsckpt_reader_variant(lay, replica_reads=on) for lay in cfg["layouts"] for on in (False, True)] \
        if placement == "replicated" else []
    return _everyone(cfg) + extra


def _location(cfg: dict[str, Any], name: str) -> str:
    return f"{cfg['root']}/{name.replace('/', '-')}"


def _own_proxy(rank: int, cfg: dict[str, Any], counters: tuple[Any, ...]) -> tuple[Any, ...]:
    """Point this rank's S3 traffic at its own proxy; returns its (served, requests) counters."""
    if not cfg["s3"]:
        return ()
    os.environ["AWS_ENDPOINT_URL"] = cfg["endpoints"][rank]
    return counters[2 * rank:2 * rank + 2]


def save_phase(rank: int, world: int, cfg: dict[str, Any], *counters: Any) -> dict[str, Any] | None:
    _own_proxy(rank, cfg, counters)
    mesh = dcp_ranks.mesh(world)
    sd = wl.build_state_dict(wl.from_dict(cfg["workload"]), wl.DTYPES[cfg["dtype"]], mesh, column=False, fill=True)
    expected = wl.checksums(sd)
    times = {c.name: dcp_ranks.timed(lambda: c.save(sd, _location(cfg, c.name))) for c in _everyone(cfg)}
    return dcp_ranks.rank0({"checksums": expected, "save": times})


def load_phase(rank: int, world: int, cfg: dict[str, Any], *counters: Any) -> dict[str, Any] | None:
    mine = _own_proxy(rank, cfg, counters)
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
        if rank == 0 and not cfg["s3"]:
            harness.evict(where)
        dist.barrier()
        before = _io()
        start = [int(x.value) for x in mine]
        seconds = dcp_ranks.timed(lambda: c.load(dest, where))
        after = _io()
        if cfg["s3"]:
            moved = [int(x.value) - s for x, s in zip(mine, start)]
        else:
            moved = [after["rchar"] - before["rchar"], after["read_bytes"] - before["read_bytes"]]
        row = torch.tensor([wl.local_bytes(dest), *moved], dtype=torch.int64)
        rows = [torch.zeros_like(row) for _ in range(world)]
        dist.all_gather(rows, row)
        if wl.checksums(dest) != expected:
            raise AssertionError(f"{c.name}: the {placement}-sharded state dict differs from the saved one")
        per_rank = torch.stack(rows).T.tolist()
        names = ("served", "requests") if cfg["s3"] else ("rchar", "read_bytes")
        result[c.name] = {"seconds": seconds, "needed": per_rank[0], **dict(zip(names, per_rank[1:]))}
    return dcp_ranks.rank0(result)


# --- driver --------------------------------------------------------------------

def _measure(cfg: dict[str, Any], world: int, reshards: list[tuple[str, int]], counters: tuple[Any, ...]) -> dict:
    saved = harness.run_ranks(world, save_phase, cfg, *counters)[0]
    loads = {}
    for placement, ranks in reshards:
        print(f"[fetched] {'S3' if cfg['s3'] else 'disk'}: {world} -> {ranks} ranks, {placement}", flush=True)
        loads[f"{placement}:{ranks}"] = harness.run_ranks(
            ranks, load_phase, cfg | {"checksums": saved["checksums"], "placement": placement}, *counters)[0]
    return {"loads": loads, "save_seconds": saved["save"]}


def run(args: Any, layouts: list[str], tmp: str) -> dict[str, Any]:
    """Measure bytes fetched vs needed per rank, for each contender and load, on local disk and on S3."""
    w_cls = wl.WORKLOADS[args.fetch_workload]
    itemsize = wl.DTYPES[args.dtypes[0]].itemsize
    reshards = parse_reshards(args.reshards)
    base = {"dtype": args.dtypes[0], "dcp_threads": args.dcp_threads[:1], "layouts": layouts,
            "variants": args.variants}
    out: dict[str, Any] = {"world": args.world, "reshards": [f"{p}:{n}" for p, n in reshards]}
    disk_w = w_cls.for_size(args.fetch_gb * 1e9, itemsize)
    root = os.path.join(tmp, "fetched-disk")
    os.makedirs(root)
    print(f"[fetched] local disk, {disk_w.describe()}", flush=True)
    out["disk"] = _measure(base | {"workload": wl.to_dict(disk_w), "root": root, "s3": False},
                           args.world, reshards, ())
    out["disk"] |= {"workload": wl.to_dict(disk_w), "bytes": wl.total_bytes(disk_w, itemsize)}
    s3_w = w_cls.for_size(args.s3_gb * 1e9, itemsize)
    print(f"[fetched] S3 (moto on loopback), {s3_w.describe()}", flush=True)
    try:
        ranks = max([args.world, *(n for _, n in reshards)])
        out["s3"] = _s3(args, base | {"workload": wl.to_dict(s3_w), "s3": True}, reshards, ranks)
        out["s3"] |= {"workload": wl.to_dict(s3_w), "bytes": wl.total_bytes(s3_w, itemsize)}
    except ImportError as e:  # moto or s3fs missing
        print(f"[fetched] S3 skipped: {e}", flush=True)
    return out


def _s3(args: Any, cfg: dict[str, Any], reshards: list[tuple[str, int]], ranks: int) -> dict[str, Any]:
    import moto  # noqa: F401  (fail early, as ImportError, where moto is not installed)
    import s3fs  # noqa: F401
    from s3server import MotoServer, restore_credentials, set_credentials

    previous = set_credentials()
    old_endpoint = os.environ.get("AWS_ENDPOINT_URL")
    try:
        with MotoServer() as server:
            server.create_bucket("bench")
            proxies = [CountingProxy(server.port) for _ in range(ranks)]
            os.environ["AWS_ENDPOINT_URL"] = proxies[0].endpoint  # for this process; each rank picks its own
            counters = tuple(c for p in proxies for c in (p.served, p.requests))
            try:
                t0 = time.perf_counter()
                result = _measure(cfg | {"root": "s3://bench/ckpt", "endpoints": [p.endpoint for p in proxies]},
                                  args.world, reshards, counters)
                result["wall_seconds"] = time.perf_counter() - t0
                return result
            finally:
                for p in proxies:
                    p.close()
    finally:
        restore_credentials(previous)
        if old_endpoint is None:
            os.environ.pop("AWS_ENDPOINT_URL", None)
        else:
            os.environ["AWS_ENDPOINT_URL"] = old_endpoint
