"""Bytes fetched from storage against bytes needed, on a column-resharded load, local disk and S3.

Every contender saves the row-sharded state dict once from ``world`` ranks;
then ``reshard_world`` ranks load it column-sharded, one contender at a time,
after a warm-up load of the same checkpoint (so that lazy imports and
first-call set-up are not counted). Bytes *needed* are the new ranks' local
shards summed over ranks.

* Local disk: before each measured load the checkpoint's files are evicted
  from the page cache; every rank reads ``/proc/self/io`` before and after. ``rchar`` counts the bytes each
  rank's ``read``/``pread`` calls returned: what ranks on separate nodes would
  fetch. ``read_bytes`` counts what the block device delivered; ranks on one
  machine share a page cache, so bytes read by two ranks count once there.
  (gloo's socket traffic goes through ``recv`` and is in neither.)
* S3: a moto server on loopback behind a byte-counting TCP proxy started by
  this process. Both libraries talk to the proxy (tsckpt's TensorStore ``s3``
  kvstore through ``AWS_ENDPOINT_URL``, DCP through ``FsspecWriter`` /
  ``FsspecReader`` over s3fs with the same endpoint), so one counter measures
  both: bytes served to the clients (HTTP bodies plus headers) and requests
  (request headers seen, counted only during loads, which send no bodies).
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

def _io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def _everyone(cfg: dict[str, Any]) -> list[cont.Contender]:
    return cont.contenders(cfg, raw=False, s3=cfg["s3"])


def _location(cfg: dict[str, Any], name: str) -> str:
    return f"{cfg['root']}/{name.replace('/', '-')}"


def save_phase(rank: int, world: int, cfg: dict[str, Any], *counters: Any) -> dict[str, Any] | None:
    mesh = dcp_ranks.mesh(world)
    sd = wl.build_state_dict(wl.from_dict(cfg["workload"]), wl.DTYPES[cfg["dtype"]], mesh, column=False, fill=True)
    expected = wl.checksums(sd)
    times = {c.name: dcp_ranks.timed(lambda: c.save(sd, _location(cfg, c.name))) for c in _everyone(cfg)}
    return dcp_ranks.rank0({"checksums": expected, "save": times})


def load_phase(rank: int, world: int, cfg: dict[str, Any], *counters: Any) -> dict[str, Any] | None:
    mesh = dcp_ranks.mesh(world)
    dest = wl.build_state_dict(wl.from_dict(cfg["workload"]), wl.DTYPES[cfg["dtype"]], mesh, column=True, fill=False)
    needed = torch.tensor([wl.local_bytes(dest)], dtype=torch.int64)
    dist.all_reduce(needed)
    result: dict[str, Any] = {}
    for c in _everyone(cfg):
        where = _location(cfg, c.name)
        c.load(dest, where)  # warm-up: imports, first-call set-up
        if rank == 0 and not cfg["s3"]:
            harness.evict(where)
        dist.barrier()
        before = _io()
        start = [int(x.value) for x in counters]
        seconds = dcp_ranks.timed(lambda: c.load(dest, where))
        after = _io()
        moved = torch.tensor([after["rchar"] - before["rchar"], after["read_bytes"] - before["read_bytes"]])
        dist.all_reduce(moved)
        if wl.checksums(dest) != cfg["checksums"]:
            raise AssertionError(f"{c.name}: resharded state dict differs from the saved one")
        entry = {"seconds": seconds, "needed": int(needed)}
        if cfg["s3"]:
            entry |= {"served": int(counters[0].value) - start[0], "requests": int(counters[1].value) - start[1]}
        else:
            entry |= {"rchar": int(moved[0]), "read_bytes": int(moved[1])}
        result[c.name] = entry
    return dcp_ranks.rank0(result)


# --- driver --------------------------------------------------------------------

def _measure(cfg: dict[str, Any], world: int, reshard_world: int, counters: tuple[Any, ...]) -> dict:
    saved = harness.run_ranks(world, save_phase, cfg, *counters)[0]
    loads = harness.run_ranks(reshard_world, load_phase, cfg | {"checksums": saved["checksums"]}, *counters)[0]
    return {"loads": loads, "save_seconds": saved["save"]}


def run(args: Any, layouts: list[str], tmp: str) -> dict[str, Any]:
    """Measure bytes fetched vs needed for each contender on local disk and on S3; returns the figures."""
    w_cls = wl.WORKLOADS[args.fetch_workload]
    itemsize = wl.DTYPES[args.dtypes[0]].itemsize
    base = {"dtype": args.dtypes[0], "dcp_threads": args.dcp_threads[:1], "layouts": layouts,
            "variants": args.variants}
    out: dict[str, Any] = {"world": args.world, "reshard_world": args.reshard_world}
    disk_w = w_cls.for_size(args.fetch_gb * 1e9, itemsize)
    root = os.path.join(tmp, "fetched-disk")
    os.makedirs(root)
    print(f"[fetched] local disk, {disk_w.describe()}", flush=True)
    out["disk"] = _measure(base | {"workload": wl.to_dict(disk_w), "root": root, "s3": False},
                           args.world, args.reshard_world, ())
    out["disk"] |= {"workload": wl.to_dict(disk_w), "bytes": wl.total_bytes(disk_w, itemsize)}
    s3_w = w_cls.for_size(args.s3_gb * 1e9, itemsize)
    print(f"[fetched] S3 (moto on loopback), {s3_w.describe()}", flush=True)
    try:
        out["s3"] = _s3(args, base | {"workload": wl.to_dict(s3_w), "s3": True})
        out["s3"] |= {"workload": wl.to_dict(s3_w), "bytes": wl.total_bytes(s3_w, itemsize)}
    except ImportError as e:  # moto or s3fs missing
        print(f"[fetched] S3 skipped: {e}", flush=True)
    return out


def _s3(args: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    import moto  # noqa: F401  (fail early, as ImportError, where moto is not installed)
    import s3fs  # noqa: F401
    from s3server import MotoServer, restore_credentials, set_credentials

    previous = set_credentials()
    old_endpoint = os.environ.get("AWS_ENDPOINT_URL")
    try:
        with MotoServer() as server:
            server.create_bucket("bench")
            proxy = CountingProxy(server.port)
            os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
            try:
                t0 = time.perf_counter()
                result = _measure(cfg | {"root": "s3://bench/ckpt"}, args.world, args.reshard_world,
                                  (proxy.served, proxy.requests))
                result["wall_seconds"] = time.perf_counter() - t0
                return result
            finally:
                proxy.close()
    finally:
        restore_credentials(previous)
        if old_endpoint is None:
            os.environ.pop("AWS_ENDPOINT_URL", None)
        else:
            os.environ["AWS_ENDPOINT_URL"] = old_endpoint
