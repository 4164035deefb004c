"""tsckpt against its peers on S3, every rank through its own emulated node link: seconds, requests, bytes, CPU.

Starts a moto S3 server on 127.0.0.1 (``s3_moto.py``) and, for each link setting of
``--links`` (``MB_PER_S:LATENCY_MS``), one proxy per rank in front of it
(``linkproxy.py``): every rank names the server as its S3 endpoint and its
own proxy as its HTTP proxy, which caps the rank's bandwidth each way, holds
each HTTP request for the latency, and counts its requests and bytes. Then, on ``--world`` gloo CPU ranks (more ranks than cores
is fine: the links, not the CPUs, are meant to be the limit), with
``dcp.save``/``dcp.load`` and DCP's default planners, DTensor state dicts:

* contenders: DCP's ``FsspecWriter``/``FsspecReader`` over s3fs; AWS's
  s3torchconnector (``S3StorageWriter``/``S3StorageReader``); tsckpt's
  ``TensorStoreWriter``/``TensorStoreReader``, once per ``--layouts`` entry
  (passed as ``layout=``). A peer that is not installed is left out, with a note;
* states (``--states``): ``untuned`` (``workloads.py``: bf16 weights and fp32
  moments, a 50257 vocabulary, GQA projections, biases, norms, 0-d steps) of
  ``--gb``, and ``small``, a few hundred small matrices of ``--small-gb``;
* phases: save, row-sharded; load into the same topology; column-resharded
  load into the same ranks (``Shard(1)`` instead of ``Shard(0)``);
  column-resharded load into a group of ``--fewer`` ranks (a second process
  group, as a restart on fewer nodes); replicated load (every rank loads every
  tensor whole). Every load is checked bit for bit against what was saved.

Each repetition runs every contender once, rotating who goes first; a
contender's save is followed by its loads. Tables give medians over
repetitions; speed-ups are the faster peer's median over the contender's (and,
in brackets, the median of the per-repetition ratios). Writes
``s3_peers.json`` (every sample) and ``s3_peers.md`` to ``--out``, and figures
(``plots.py``) to ``--plots`` (by default ``--out``'s ``plots``).

Usage (``pip install -e ".[bench]"`` installs the peers, moto and matplotlib):

    python -m benchmarks s3                                   # the full run: 3 links, 2 states, 6 reps
    python -m benchmarks s3 --runs 2 --links 60:10 --states untuned --layouts packed
    python -m benchmarks s3 --gb 0.02 --small-gb 0.005 --reps 2 --links 200:2 --plots ""
    python benchmarks/s3_peers_report.py build/bench/s3/run-1/s3_peers.json --plots DIR   # tables, figures again

moto serves every rank from one Python process on the same CPUs as the
ranks, so it is slower than a real object store, and slower still per request.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import contenders as cont  # noqa: E402
import harness  # noqa: E402
import linkproxy  # noqa: E402
import s3_peers_ranks as ranks  # noqa: E402
import s3_peers_report as report  # noqa: E402
from s3_moto import BenchServer  # noqa: E402
import workloads as wl  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
STATES = ("untuned", "small")
LOADS = ("load", "reshard_cols", "reshard_fewer", "replicated")
BUCKET = "bench"


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=0.32, help="size of the untuned state dict, GB (10^9 bytes)")
    ap.add_argument("--small-gb", type=float, default=0.16, help="size of the small model's state dict, GB")
    ap.add_argument("--states", type=_names, default=list(STATES), help=f"comma-separated subset of {STATES}")
    ap.add_argument("--links", type=linkproxy.parse_links, default=linkproxy.parse_links("60:10,25:30,200:2"),
                    help="emulated node links, MB_PER_S:LATENCY_MS, comma-separated (each is one block of the run)")
    ap.add_argument("--layouts", type=_names, default=["plain", "packed"],
                    help="tsckpt layouts, comma-separated, each passed as TensorStoreWriter(layout=...)")
    ap.add_argument("--peers", type=_names, default=list(ranks.PEERS), help=f"subset of {ranks.PEERS}")
    ap.add_argument("--phases", type=_names, default=list(LOADS),
                    help=f"loads to run after each save, subset of {LOADS}")
    ap.add_argument("--reps", type=int, default=6, help="repetitions; every contender runs once in each")
    ap.add_argument("--world", type=int, default=4, help="ranks that save (and run the same-size loads)")
    ap.add_argument("--fewer", type=int, default=2, help="ranks of the smaller group's column-resharded load")
    ap.add_argument("--weights", default="bf16", choices=sorted(wl.DTYPES), help="dtype of the weights")
    ap.add_argument("--moments", default="fp32", choices=sorted(wl.DTYPES), help="dtype of the optimizer moments")
    ap.add_argument("--out", default=os.path.join(harness.RESULTS, "s3"), help="where s3_peers.json and .md go")
    ap.add_argument("--plots", default=None, help="directory for the figures (default: OUT/plots); empty: none")
    ap.add_argument("--plot-format", default="png", choices=("png", "svg"))
    args = ap.parse_args(argv)
    for name, given, allowed in (("--states", args.states, STATES), ("--phases", args.phases, LOADS),
                                 ("--peers", args.peers, ranks.PEERS)):
        if unknown := set(given) - set(allowed):
            ap.error(f"{name}: unknown {sorted(unknown)}; choose from {allowed}")
    if args.plots is None:
        args.plots = os.path.join(args.out, "plots")
    return args


def state_of(args: argparse.Namespace, name: str) -> wl.Workload:
    """The workload ``name`` sized so that its weights and moments, in their dtypes, make its ``--gb``."""
    w_cls = wl.WORKLOADS[name]
    gb = args.gb if name == "untuned" else args.small_gb
    weights, moments = wl.DTYPES[args.weights].itemsize, wl.DTYPES[args.moments].itemsize
    copies = 1 + len(w_cls.moments)
    # for_size assumes one dtype for every copy: give it the mean item size.
    return w_cls.for_size(gb * 1e9, (weights + moments * (copies - 1)) / copies)


def state_bytes(args: argparse.Namespace, w: wl.Workload) -> int:
    elems = sum(math.prod(s) for s in w.params().values())
    return elems * (wl.DTYPES[args.weights].itemsize + len(w.moments) * wl.DTYPES[args.moments].itemsize)


def installed_peers(wanted: list[str]) -> tuple[list[str], list[str]]:
    """The peers of ``wanted`` whose packages import here, and notes on the others."""
    needs = {ranks.FSSPEC: "s3fs", ranks.CONNECTOR: "s3torchconnector.dcp"}
    ok, notes = [], []
    for peer in wanted:
        try:
            __import__(needs[peer])
            ok.append(peer)
        except ImportError as e:
            notes.append(f"{peer} left out: {e} (pip install -e '.[bench]')")
    return ok, notes


def run_block(args: argparse.Namespace, name: str, link: linkproxy.Link, peers: list[str],
              layouts: list[str]) -> dict[str, Any]:
    """Every contender, repetition and phase of one state dict through one link setting."""
    w = state_of(args, name)
    size = state_bytes(args, w)
    print(f"[{name}, {link.label}] {w.describe()}: {size / 1e9:.3f} GB, {args.world} ranks, {args.reps} reps",
          flush=True)
    counts = linkproxy.counters(max(args.world, args.fewer))
    started = time.perf_counter()
    # A fresh server per block: moto holds objects in memory, and a block starts with none.
    with BenchServer() as server, linkproxy.Links(server.port, link, len(counts) // len(linkproxy.FIELDS),
                                                 counts) as links:
        server.create_bucket(BUCKET)
        cfg = {"workload": wl.to_dict(w), "dtype": args.weights, "moment_dtype": args.moments, "reps": args.reps,
               "peers": peers, "layouts": layouts, "phases": ["save", *args.phases], "world": args.world,
               "bucket": BUCKET, "prefix": f"{name}-{link.key.replace(':', '-')}", "server": server.endpoint,
               "links": links.endpoints}
        samples = harness.run_ranks(args.world, ranks.world_phase, cfg, counts, timeout=None)[0]
        if "reshard_fewer" in args.phases:
            print(f"[{name}, {link.label}] column-resharded load into {args.fewer} ranks", flush=True)
            fewer = harness.run_ranks(args.fewer, ranks.fewer_phase, cfg, counts, timeout=None)[0]
            for who, phases in fewer.items():
                samples[who].update(phases)
        unparsed = sum(n for p in samples.values() for xs in p.values() for s in xs for n in s["unparsed"])
    if unparsed:
        print(f"warning: {unparsed} connections' requests could not be followed; request counts are low", flush=True)
    return {"state": name, "describe": w.describe(), "workload": wl.to_dict(w), "bytes": size,
            "link": {"mb_per_s": link.mb_per_s, "latency_ms": link.latency_ms, "label": link.label},
            "world": args.world, "fewer": args.fewer, "samples": samples,
            "wall_seconds": time.perf_counter() - started}


def environment(args: argparse.Namespace, notes: list[str]) -> dict[str, Any]:
    env = harness.environment("python -m benchmarks s3", sys.argv[1:],
                              ("torch", "tensorstore", "s3fs", "s3torchconnector", "moto"))
    return env | {"commit": _commit(), "reps": args.reps, "notes": notes, "complete": False}


def _commit() -> str:
    """The checkout's commit, with ``+changes`` when its files differ from it (which tree made the figures)."""
    import subprocess

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=HERE, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD")
    return f"{head}+changes" if head and git("status", "--porcelain", "--untracked-files=no") else head or "unknown"


def write(args: argparse.Namespace, results: dict[str, Any]) -> str:
    """``s3_peers.json`` and ``s3_peers.md`` in ``--out``, the figures in ``--plots``; returns the markdown."""
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "s3_peers.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = report.markdown(results)
    with open(os.path.join(args.out, "s3_peers.md"), "w") as f:
        f.write(text)
    if args.plots and results["blocks"]:
        report.plot(results, args.plots, args.plot_format)
    return text


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    layouts, refused = cont.supported_layouts(args.layouts)
    peers, notes = installed_peers(args.peers)
    notes += [f"layout {lay!r} left out: the installed tsckpt does not accept it" for lay in refused]
    for note in notes:
        print(f"note: {note}", flush=True)
    if not layouts:
        raise SystemExit("no tsckpt layout left to measure")
    results: dict[str, Any] = {"env": environment(args, notes), "peers": peers, "layouts": layouts, "blocks": []}
    from s3server import restore_credentials, set_credentials

    previous = set_credentials()  # dummy keys for moto, inherited by the ranks
    try:
        for name in args.states:
            for link in args.links:
                results["blocks"].append(run_block(args, name, link, peers, layouts))
                write(args, results)  # keep what finished if a later block fails
        results["env"]["complete"] = True
    finally:
        restore_credentials(previous)
        results["env"]["load_after"] = harness.loadavg()
        print(write(args, results))


if __name__ == "__main__":
    main()
