"""The packed layout's commit step at scale: joining every rank's OCDBT database into the root one.

Builds ``--ranks`` rank databases the way a packed save leaves them (each
holding one chunk key of each of ``--tensors`` arrays, FSDP-style), then times
the coordinator's join (:meth:`tsckpt.storage.packed.PackedLayout.join`: copy
every rank's B+tree by reference, then commit), and one reader opening the
joined database and reading one key of every tensor. Chunk values are 8 bytes
stored out of line (``max_inline_value_bytes=0``), as real chunks are, so the
B+trees have the shape of a real save's without its data.

    python benchmarks/bench_join.py                          # 100, 250 and 500 ranks x 2000 tensors
    python benchmarks/bench_join.py --ranks 1000 --tensors 2000 --dir /big/disk

Building the rank databases is not timed. Times are wall and CPU seconds of
this process; the join is one process, as on a real coordinator.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import table  # noqa: E402  (puts this checkout's tsckpt first on the path)

import tensorstore as ts  # noqa: E402

from tsckpt.storage.packed import PackedLayout, PackedOptions  # noqa: E402
from tsckpt.storage.context import make_context  # noqa: E402
from tsckpt.storage.location import parse_location


def build(base: dict, layout: PackedLayout, ranks: int, tensors: int) -> None:
    """Rank r's database holds ``t<i>/c.<r>.0`` for every tensor i, in one commit per rank."""
    context = make_context(location=parse_location(base))
    for r in range(ranks):
        txn = ts.Transaction(atomic=True)
        db = ts.KvStore.open(layout.rank_database(base, r), context=context).result().with_transaction(txn)
        futures = [db.write(f"t{i}/c.{r}.0", b"%08d" % i) for i in range(tensors)]
        for f in futures:
            f.result()
        txn.commit_async().result()


def run(root: str, ranks: int, tensors: int) -> dict[str, float]:
    path = os.path.join(root, f"join-{ranks}x{tensors}")
    base = {"driver": "file", "path": path + "/"}
    layout = PackedLayout(PackedOptions(max_inline_value_bytes=0))
    t = time.perf_counter()
    build(base, layout, ranks, tensors)
    build_s = time.perf_counter() - t

    context = make_context(location=parse_location(base))
    wall, cpu = time.perf_counter(), time.process_time()
    nodes, flush = layout.join(base, ranks, context)
    copy_wall = time.perf_counter() - wall
    flush()
    join_wall, join_cpu = time.perf_counter() - wall, time.process_time() - cpu

    wall = time.perf_counter()
    reader = ts.KvStore.open(layout.root_database(base), context=ts.Context(
        {"cache_pool#tsckpt_ocdbt": {"total_bytes_limit": 64 << 20}}, parent=make_context())).result()
    last = ranks - 1
    futures = [reader.read(f"t{i}/c.{last}.0") for i in range(tensors)]
    assert all(f.result().value == b"%08d" % i for i, f in enumerate(futures))
    read_wall = time.perf_counter() - wall
    root_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(path, "d"))
                     for f in fs) + os.path.getsize(os.path.join(path, "manifest.ocdbt"))
    shutil.rmtree(path)
    return {"ranks": ranks, "tensors": tensors, "keys": ranks * tensors, "build_s": build_s,
            "join_wall_s": join_wall, "copy_wall_s": copy_wall, "join_cpu_s": join_cpu, "read_one_per_tensor_s": read_wall,
            "root_db_mb": root_bytes / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[100, 250, 500])
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--dir", default=None, help="where the databases go (default: a temporary directory)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="tsckpt-join-", dir=args.dir)
    rows = []
    try:
        for ranks in args.ranks:
            r = run(root, ranks, args.tensors)
            print(f"[join] {ranks} x {args.tensors}: joined in {r['join_wall_s']:.2f} s", flush=True)
            rows.append([f"{ranks} x {args.tensors}", f"{r['keys']:,}",
                         f"{r['join_wall_s']:.2f} ({r['copy_wall_s']:.2f} + {r['join_wall_s'] - r['copy_wall_s']:.2f})",
                         f"{r['join_cpu_s']:.2f}", f"{r['root_db_mb']:.2f}", f"{r['read_one_per_tensor_s']:.2f}"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(table(["ranks x tensors", "keys", "join wall s (copies + commit)", "join CPU s", "root database MB",
                 "reader: one key of each tensor, s"], rows))


if __name__ == "__main__":
    main()
