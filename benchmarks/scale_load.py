"""One rank's load of a checkpoint saved at scale: what it reads and holds to plan its reads, in a fresh process.

Run by ``bench_scale.py`` on the checkpoint its ``finish`` phase committed (its
data files are never written: only the metadata a load reads is there).
Loading rank ``--rank`` of ``--world`` holds each tensor's rows as FSDP2 splits
them (``torch.chunk``), as in the save; it parses the root document, then finds
every chunk key its boxes need, as ``TensorStoreReader.read_data`` does before
it reads a byte of data. Prints one JSON line: seconds, CPU seconds and RSS
added by each step, and the chunk-table bytes read (all it reads beyond the root document).

    PYTHONPATH=. python benchmarks/scale_load.py CKPT --rank 17 --world 7500
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

from tsckpt.commit import protocol as commit
from tsckpt.storage.box_reader import BoxReader
from tsckpt.storage.chunk_source import ChunkSource
from tsckpt.storage.location import parse_location
from tsckpt.storage.store import Store


def rss_mb() -> float:
    """This process's resident memory now (the peak is the high-water mark of earlier steps too)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def rows_of(rank: int, world: int, rows: int) -> tuple[int, int]:
    """The rows ``torch.chunk`` gives ``rank`` of ``world``: (offset, count)."""
    per = -(-rows // world)
    start = min(rank * per, rows)
    return start, max(0, min(per, rows - start))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    args = ap.parse_args()
    out: dict[str, float | int] = {"rank": args.rank, "world": args.world}
    store = Store.open(parse_location(args.path))
    base = rss_mb()

    t, c = time.perf_counter(), time.process_time()
    md = commit.read_metadata(store.kvstore, store.url)
    out |= {"root_parse_s": time.perf_counter() - t, "root_parse_cpu_s": time.process_time() - c,
            "root_parse_rss_mb": rss_mb() - base}

    base = rss_mb()
    t, c = time.perf_counter(), time.process_time()
    source = ChunkSource.of(store, md)
    keys: list[str] = []
    for fqn, entry in md.tensors.items():
        start, n = rows_of(args.rank, args.world, entry.shape[0])
        reader = BoxReader(source, entry, fqn)
        keys += reader.keys((start, *([0] * (len(entry.shape) - 1))), (n, *entry.shape[1:]))
    source.locator.prefetch(keys)
    missing = sum(source.locator.locate(k) is None for k in keys)
    out |= {"plan_s": time.perf_counter() - t, "plan_cpu_s": time.process_time() - c,
            "plan_rss_mb": rss_mb() - base, "keys": len(keys), "missing": missing,
            "tables_read": len(source.tables.ranks_read), "metadata_bytes_read": source.tables.bytes_read,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3}
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
