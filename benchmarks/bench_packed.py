"""Plain vs packed layout: save and cold-read speed, files per checkpoint, and join time.

Each run is a fresh subprocess that writes a synthetic row-sharded bf16
checkpoint the way the writer does: every rank, a process of its own with its
own TensorStore context, writes its rows of every tensor (all ranks start
together at a barrier; the data sits in shared memory), then the coordinator
commits (packed: joins the ranks' databases by reference first). The page
cache is dropped before the read, which opens every array in one process and
reads it whole, all arrays at once. CPU seconds (all ranks plus the commit)
are reported beside wall time: on a shared machine they vary far less.

Layouts: ``plain`` (one file per chunk), ``packed`` (each rank's OCDBT
database, writes as the writer issues them today) and ``packed-txn`` (each
rank's writes in one atomic transaction: one OCDBT commit per rank); a suffix
``@MiB`` (``packed-txn@64``) sets that run's target data file size.

    python benchmarks/bench_packed.py                      # large and small, 3 repetitions
    python benchmarks/bench_packed.py --cases small --reps 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # this checkout's tsckpt, and the test helpers

from tsckpt.packed import PackedOptions  # noqa: E402

#: name -> (tensor count, rows, columns): bf16, row-sharded over the ranks.
CASES = {
    "large": (32, 2048, 4096),  # 512 MiB, 4 MiB chunks at 4 ranks
    "small": (300, 128, 256),   # 300 x 64 KiB, 16 KiB chunks at 4 ranks
    "1gib": (64, 2048, 4096),   # 1 GiB: 256 MiB per rank at 4 ranks, the default target file size
}
DEFAULT_CASES = ("large", "small")
LAYOUTS = ("plain", "packed", "packed-txn")


def _tensors(case: str, shm: str) -> list[Any]:
    """The case's tensors, viewed from one shared-memory file so every rank process maps the same bytes."""
    import ml_dtypes
    import numpy as np

    import packed_build as pb

    count, rows, cols = CASES[case]
    if not os.path.exists(shm):
        rng = np.random.default_rng(0)
        np.save(shm, rng.integers(0, 1 << 16, size=(count, rows, cols), dtype=np.uint16))
    data = np.load(shm, mmap_mode="r").view(ml_dtypes.bfloat16)
    return [pb.Tensor(("model", f"layers.{i}.weight"), data[i], "bfloat16") for i in range(count)]


def _rank(rank: int, ranks: int, where: str, case: str, shm: str, layout: str, target_mib: int,
          barrier: Any, results: Any) -> None:
    """One rank's save, in its own process: its rows of every tensor, timed from a common start."""
    import packed_build as pb
    from tsckpt.location import make_context, parse_location

    tensors = _tensors(case, shm)
    context = make_context(location=parse_location(where))
    barrier.wait()
    c0, t0 = _cpu(), time.monotonic()
    pb.write_rank(where, tensors, rank, ranks, layout="packed" if layout.startswith("packed") else "plain",
                  context=context, transaction=layout == "packed-txn",
                  options=PackedOptions(target_data_file_size=target_mib << 20))
    results.put((rank, t0, time.monotonic(), _cpu() - c0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))


def _cpu() -> float:
    """CPU seconds (user + system) this process has used: steadier than wall time on a shared machine."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def drop_caches() -> bool:
    done = subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], capture_output=True)
    return done.returncode == 0


def one_run(case: str, layout: str, ranks: int, where: str, target_mib: int) -> dict[str, Any]:
    """Save and cold-read one checkpoint; runs inside its own process."""
    import tensorstore as ts

    import packed_build as pb
    from tsckpt.location import make_context, parse_location
    from tsckpt.packed import PackedLayout, reader_context

    import multiprocessing

    layout, _, size = layout.partition("@")  # "packed-txn@64": a target file size for this run only
    target_mib = int(size) if size else target_mib
    options = PackedOptions(target_data_file_size=target_mib << 20)
    shm = f"/dev/shm/bench_packed_{os.getpid()}.npy"
    tensors = _tensors(case, shm)
    nbytes = sum(t.data.nbytes for t in tensors)
    base_layout = "packed" if layout.startswith("packed") else "plain"
    loc = parse_location(where)
    pb.prepare(where, layout=base_layout)

    mp = multiprocessing.get_context("spawn")
    barrier, queue = mp.Barrier(ranks), mp.Queue()
    procs = [mp.Process(target=_rank, args=(r, ranks, where, case, shm, layout, target_mib, barrier, queue))
             for r in range(ranks)]
    for p in procs:
        p.start()
    done = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    os.unlink(shm)
    c1, t1 = _cpu(), time.monotonic()
    pb.commit(where, tensors, ranks, layout=base_layout, options=options)
    t2, c2 = time.monotonic(), _cpu()
    write_s = max(d[2] for d in done) - min(d[1] for d in done)
    files = pb.files(where)

    cold = drop_caches()
    context = reader_context(make_context(location=loc))
    c3 = _cpu()
    t3 = time.perf_counter()
    if base_layout == "packed":
        specs = [PackedLayout().read_spec(dict(loc.spec), t.path) for t in tensors]
    else:
        specs = [{"driver": "zarr3", "kvstore": loc.child(t.path), "open": True,
                  "fill_missing_data_reads": False} for t in tensors]
    opened = [ts.open(s, context=context) for s in specs]
    reads = [o.result().read() for o in opened]
    out = [r.result() for r in reads]
    t4 = time.perf_counter()
    c4 = _cpu()
    assert all(o.tobytes() == t.data.tobytes() for o, t in zip(out, tensors)), "read back differs"

    result = {"case": case, "layout": layout + (f"@{size}" if size else ""), "ranks": ranks,
              "target_data_file_mib": target_mib, "bytes": nbytes, "tensors": len(tensors),
              "write_s": write_s, "commit_s": t2 - t1, "save_s": write_s + t2 - t1, "read_s": t4 - t3,
              "save_cpu_s": sum(d[3] for d in done) + c2 - c1, "read_cpu_s": c4 - c3,
              "cold_read": cold, "files": len(files),
              "stored_bytes": sum(os.path.getsize(os.path.join(dp, f))
                                  for dp, _, fs in os.walk(where) for f in fs),
              "rank_peak_rss_mb": max(d[4] for d in done) / 1024}
    if case == "small":
        import zarr

        import tsckpt.format.zarr_dtypes  # noqa: F401  (bfloat16 for zarr-python)
        from tsckpt.zarr_kvstore import zarr_store

        drop_caches()
        t5 = time.perf_counter()
        group = zarr.open_group(zarr_store(where), mode="r")
        for t in tensors:
            group[t.path][...]
        result["zarr_python_read_s"] = time.perf_counter() - t5
    return result


def join_run(ranks: int, keys: int, where: str) -> dict[str, Any]:
    """Time the coordinator's join of ``ranks`` small databases of ``keys`` chunks each."""
    import tensorstore as ts

    from tsckpt.location import make_context, parse_location
    from tsckpt.packed import PackedLayout

    loc = parse_location(where)
    layout = PackedLayout()
    context = make_context(location=loc)
    for r in range(ranks):
        db = ts.KvStore.open(layout.rank_database(dict(loc.spec), r), context=context).result()
        for f in [db.write(f"model/layers.{i}.weight/c.{r}.0", bytes(2048)) for i in range(keys)]:
            f.result()
    t0 = time.perf_counter()
    nodes, flush = layout.join(dict(loc.spec), ranks, make_context(location=loc))
    for f in [nodes.write(f"model/layers.{i}.weight/zarr.json", b"{}" * 300) for i in range(keys)]:
        f.result()
    flush()
    t1 = time.perf_counter()
    root = ts.KvStore.open(layout.root_database(dict(loc.spec)),
                           context=ts.Context({"cache_pool#tsckpt_ocdbt": {"total_bytes_limit": 1 << 26}})).result()
    listed = len(root.list().result())
    assert listed == ranks * keys + keys, listed
    data = [os.path.join(where, "d", f) for f in os.listdir(os.path.join(where, "d"))]
    return {"ranks": ranks, "keys_per_rank": keys, "join_s": t1 - t0, "root_keys": listed,
            "root_files": 1 + len(data),  # manifest.ocdbt and the root database's data files
            "root_bytes": sum(os.path.getsize(f) for f in data)}


def _child(args: list[str]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark run {args} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", default=list(DEFAULT_CASES), choices=list(CASES))
    ap.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--target-mib", type=int, default=PackedOptions().target_data_file_size >> 20,
                    help="packed layout: target_data_file_size in MiB")
    ap.add_argument("--join", default="64x300", help="RANKSxKEYS for the join timing ('' to skip)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--out", default=None, help="write all runs and medians as JSON here")
    ap.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        kind, *rest = args.child
        res = one_run(rest[0], rest[1], int(rest[2]), rest[3], int(rest[4])) if kind == "run" else \
            join_run(int(rest[0]), int(rest[1]), rest[2])
        print(json.dumps(res))
        return

    scratch = tempfile.mkdtemp(prefix="bench_packed_", dir=args.dir)
    runs: list[dict[str, Any]] = []
    try:
        for case in args.cases:
            for rep in range(args.reps):
                order = args.layouts[rep % len(args.layouts):] + args.layouts[:rep % len(args.layouts)]
                for layout in order:
                    where = os.path.join(scratch, f"{case}-{layout}-{rep}")
                    res = _child(["run", case, layout, str(args.ranks), where, str(args.target_mib)])
                    shutil.rmtree(where, ignore_errors=True)
                    runs.append(res)
                    print(f"{case:5} {layout:10} rep {rep}: save {res['save_s']:.3f}s (commit "
                          f"{res['commit_s']:.3f}s), read {res['read_s']:.3f}s, {res['files']} files", flush=True)
        joins = []
        if args.join:
            n, k = (int(x) for x in args.join.split("x"))
            for rep in range(args.reps):
                where = os.path.join(scratch, f"join-{rep}")
                joins.append(_child(["join", str(n), str(k), where]))
                shutil.rmtree(where, ignore_errors=True)
                print(f"join {n} x {k}: {joins[-1]['join_s']:.3f}s, {joins[-1]['root_files']} root files", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    summary = []
    for case in args.cases:
        for layout in args.layouts:
            rs = [r for r in runs if r["case"] == case and r["layout"] == layout]
            med = {k: statistics.median(r[k] for r in rs) for k in
                   ("save_s", "commit_s", "read_s", "save_cpu_s", "read_cpu_s", "files",
                    "rank_peak_rss_mb")
                   + (("zarr_python_read_s",) if case == "small" else ())}
            mb = rs[0]["bytes"] / 1e6
            summary.append({"case": case, "layout": layout, "MB": mb, **med,
                            "save_MBps": mb / med["save_s"], "read_MBps": mb / med["read_s"],
                            "cold_read": all(r["cold_read"] for r in rs)})
    print(f"\nmedians of {args.reps} ({args.ranks} ranks, packed target_data_file_size {args.target_mib} MiB):")
    print(f"{'case':6}{'layout':12}{'MB':>8}{'save s':>9}{'MB/s':>8}{'commit s':>10}{'read s':>9}{'MB/s':>8}"
          f"{'save cpu':>10}{'read cpu':>10}{'files':>7}{'rank RSS MB':>13}{'zarr-py s':>11}")
    for s in summary:
        print(f"{s['case']:6}{s['layout']:12}{s['MB']:8.0f}{s['save_s']:9.3f}{s['save_MBps']:8.0f}"
              f"{s['commit_s']:10.3f}{s['read_s']:9.3f}{s['read_MBps']:8.0f}"
              f"{s['save_cpu_s']:10.3f}{s['read_cpu_s']:10.3f}{s['files']:7.0f}"
              f"{s['rank_peak_rss_mb']:13.0f}{s.get('zarr_python_read_s', float('nan')):11.3f}")
    if joins:
        print(f"join {joins[0]['ranks']} x {joins[0]['keys_per_rank']}: median "
              f"{statistics.median(j['join_s'] for j in joins):.3f}s, root files {joins[0]['root_files']}, "
              f"root bytes {joins[0]['root_bytes']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"runs": runs, "summary": summary, "joins": joins}, f, indent=1)


if __name__ == "__main__":
    main()
