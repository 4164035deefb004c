"""Measure a location's read cost model: the latency of one ranged read and the bandwidth of one rank.

tsckpt plans every load's reads by cost (``tsckpt/storage/byte_reads.py``): two
wanted ranges of one file are fetched by one request when the bytes between
them take less time to fetch than a request's latency, ``gap <= latency_s *
bandwidth``. The defaults are a local disk's and an object store's; this script
measures a location's own, from where it runs:

* ``latency_s``: the median time of a 4 KiB ranged read at a random offset of
  a scratch object (``--samples`` of them, one at a time);
* ``bandwidth``: bytes per second of ``--mb`` MiB read in ``max_request``
  pieces, all in flight at once, as a load reads them (best of ``--reps``).

It writes the scratch object under the location (``read-cost-<random>``),
deletes it after, and prints the member to give the location:

    {"url": "s3://bucket/prefix", "read_cost": {"latency_s": 0.012, "bandwidth": 9.5e7}}

Local reads come from the page cache once the object is written (what a load
right after a save sees); ``--cold`` drops it from the cache first (local only).

    python -m benchmarks read-cost /mnt/ckpt
    python -m benchmarks read-cost s3://bucket/prefix --mb 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tsckpt.storage import byte_reads, fetchers  # noqa: E402
from tsckpt.storage.context import make_context, open_kvstore  # noqa: E402
from tsckpt.storage.location import parse_location  # noqa: E402


def measure(location: str, mb: int, samples: int, reps: int, cold: bool) -> dict[str, float]:
    loc = parse_location(location)
    default = byte_reads.read_cost(loc)
    kv = open_kvstore(loc, make_context(location=loc))
    key = f"read-cost-{uuid.uuid4().hex}"
    size = mb << 20
    kv.write(key, np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8).tobytes()).result()
    local = loc.driver == "file"
    fetcher: fetchers.Fetcher = (fetchers.LocalFiles(str(loc.spec.get("path", "."))) if local
                                   else fetchers.KvFiles(kv))
    try:
        if cold and local:
            _drop_cache(os.path.join(str(loc.spec.get("path", ".")), key))
        rng = np.random.default_rng(1)
        times = []
        for offset in rng.integers(0, size - 4096, samples).tolist():
            t = time.perf_counter()
            fetcher.fetch(key, offset, offset + 4096).result()
            times.append(time.perf_counter() - t)
        rates = []
        for _ in range(reps):
            if cold and local:
                _drop_cache(os.path.join(str(loc.spec.get("path", ".")), key))
            t = time.perf_counter()
            pieces = [fetcher.fetch(key, a, b) for a, b in byte_reads.split(size, -(-size // default.max_request))]
            for p in pieces:
                p.result()
            rates.append(size / (time.perf_counter() - t))
    finally:
        kv.delete_range(ts_range(key)).result()
    return {"latency_s": statistics.median(times), "bandwidth": max(rates)}


def ts_range(key: str):  # noqa: ANN201 - a tensorstore.KvStore.KeyRange
    import tensorstore as ts

    return ts.KvStore.KeyRange(key, key + "\0")


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("location", help="a local directory or an s3:// / gs:// prefix")
    ap.add_argument("--mb", type=int, default=128, help="size of the scratch object, MiB")
    ap.add_argument("--samples", type=int, default=50, help="4 KiB reads timed for the latency")
    ap.add_argument("--reps", type=int, default=3, help="whole reads timed for the bandwidth (best kept)")
    ap.add_argument("--cold", action="store_true", help="drop the scratch file from the page cache first")
    args = ap.parse_args(argv)
    cost = measure(args.location, args.mb, args.samples, args.reps, args.cold)
    default = byte_reads.read_cost(parse_location(args.location))
    print(f"latency {cost['latency_s'] * 1e3:.3f} ms, bandwidth {cost['bandwidth'] / 1e6:.0f} MB/s: "
          f"reads merge across gaps up to {cost['latency_s'] * cost['bandwidth'] / 1e3:.0f} kB "
          f"(default for this kind of store: {default.latency_s * 1e3:g} ms, {default.bandwidth / 1e6:g} MB/s, "
          f"{default.gap_bytes / 1e3:.0f} kB)")
    print(json.dumps({"read_cost": {"latency_s": round(cost["latency_s"], 6),
                                    "bandwidth": float(f"{cost['bandwidth']:.3g}")}}))


if __name__ == "__main__":
    main()
