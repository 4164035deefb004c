"""The named scenarios of ``python -m benchmarks``: the script each one runs, and how a run's results become rows.

A *comparison* (``local``, ``s3``, ``cpu``, ``cuda``, ``scale``) measures tsckpt
beside its peers and writes its samples to a results file; ``--runs N`` runs it
N times and :mod:`ranges` prints, per store, the range of the runs' medians
and the ratio to the best peer. ``peers`` runs ``local`` and ``s3`` in turn, as
one command. The other scenarios each answer one question about tsckpt alone,
run once and print their own table.

Importing this module imports neither torch nor tsckpt.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from typing import Any

import dcp_report
import s3_peers_report
from ranges import Figure


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    #: The script in ``benchmarks/`` that runs it (none for a scenario made of others).
    script: str = ""
    #: Where a run's results go: ``"json"``, the script takes ``--json FILE``; a file name, the script
    #: writes that file into ``--out DIR``; empty, the script writes no results file.
    results: str = ""
    #: One run's results (the loaded file) as rows of :mod:`ranges`.
    figures: Callable[[dict[str, Any]], list[Figure]] | None = None
    #: Scenarios run in turn, each with its own options (``--local "..."``), for a scenario made of others.
    parts: tuple[str, ...] = ()

    @property
    def compares(self) -> bool:
        return self.figures is not None or bool(self.parts)


def _cpu(results: dict[str, Any]) -> list[Figure]:
    """``bench_cpu.py --json``: CPU seconds per GB (compared) and wall seconds, per phase and contender."""
    out = []
    for name, phases in results["samples"].items():
        for phase, samples in phases.items():
            out.append(Figure("local disk", results["state"], _CPU_PHASES.get(phase, phase), name, name == "dcp",
                              {"CPU s / GB": statistics.median(s[1] for s in samples) / results["gb"],
                               "seconds": statistics.median(s[0] for s in samples)}, share=True))
    return sorted(out, key=lambda f: list(_CPU_PHASES.values()).index(f.phase))


_CPU_PHASES = {"save": "save", "load": "same-topology load", "reshard": "column reshard"}


def _cuda(results: dict[str, Any]) -> list[Figure]:
    """``bench_cuda.py --json``: seconds (compared) and peak host memory of a save and a load of GPU tensors."""
    state = results.get("describe", f"{results['state_bytes'] / 1e9:.2f} GB")
    out = []
    for phase in ("save", "load"):
        for name, s in results["samples"].items():
            out.append(Figure("local disk, state on the GPU", state, phase, dcp_report.label(name),
                              name.startswith("dcp-t"),
                              {"seconds": statistics.median(s[phase]),
                               "peak host GB": statistics.median(s[f"{phase}_mem"]) / 1e9}))
    return out


def _scale(results: dict[str, Any]) -> list[Figure]:
    """``bench_scale.py --json``: the coordinator's CPU seconds (compared) and wall seconds per phase."""
    state = (f"{results['ranks']} ranks x {results['tensors']} tensors of [{results['rows']}, {results['cols']}] "
             "bf16")
    out = []
    for phase, f in results["phases"].items():
        for who, label, peer in (("tsckpt", "tsckpt", False), ("dcp", "DCP FileSystemWriter", True)):
            out.append(Figure("coordinator, plans in memory", state, phase, label, peer,
                              {"CPU s": f[f"{who}_cpu_s"], "seconds": f[f"{who}_s"]}, share=True))
    return out


SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    Scenario("local", "tsckpt against DCP's FileSystemWriter/Reader on local disk: save, load, column reshards, "
             "a job's first save; bytes fetched", "bench_dcp.py", "results.json", dcp_report.figures),
    Scenario("s3", "tsckpt against DCP + fsspec and s3torchconnector on S3 (moto), every rank behind its own "
             "emulated link", "bench_s3_peers.py", "s3_peers.json", s3_peers_report.figures),
    Scenario("peers", "local, then s3: every peer on both stores in one command (--local \"OPTIONS\", "
             "--s3 \"OPTIONS\")", parts=("local", "s3")),
    Scenario("cpu", "CPU seconds per GB of save, load and column reshard, tsckpt against DCP on local disk",
             "bench_cpu.py", "json", _cpu),
    Scenario("cuda", "GPU tensors: save and load time and peak host memory against DCP (--device cpu checks the "
             "script without a GPU)", "bench_cuda.py", "json", _cuda),
    Scenario("scale", "what a save costs the coordinator at thousands of ranks, phase by phase, against DCP's "
             "writer", "bench_scale.py", "json", _scale),
    Scenario("scale-planner", "tsckpt.save's coordinator at 10,000 ranks with tsckpt's planner, phase by phase, "
             "and one rank's load planned", "scale_planner.py"),
    Scenario("incremental", "incremental saves against full saves: bytes newly allocated, save and load time",
             "bench_incremental.py"),
    Scenario("replica-writes", "bytes each rank writes when every rank holds the whole state (DDP), against DCP",
             "bench_replica_writes.py"),
    Scenario("open", "tsckpt.open on many tensors, and a slice read against reading the whole tensor",
             "bench_open.py"),
    Scenario("one-tensor", "the bytes reading one tensor of a checkpoint of many tensors reads beyond its root",
             "bench_one_tensor.py"),
    Scenario("convert", "safetensors to tsckpt and back: MB/s against reading the source and writing the disk",
             "bench_convert.py"),
    Scenario("tiny-chunks", "a grid of 50,257 tiny chunks (nested uneven sharding) saved and loaded in each "
             "layout", "bench_tiny_chunks.py"),
    Scenario("read-cost", "a location's read latency and bandwidth: the read-cost model's inputs (LOCATION)",
             "bench_read_cost.py"),
    Scenario("fsync", "making a rank's files durable: an fsync per file, or writeback per file and one syncfs",
             "bench_fsync.py"),
    Scenario("encode", "encoding a chunk into fresh memory or streamed through reused buffers",
             "bench_encode.py"),
    Scenario("profile", "where rank 0's CPU goes in a save or a column-resharded load (cProfile)",
             "profile_rank.py"),
]}


def listing() -> str:
    """One line per scenario: its name, its script, what it measures."""
    width = max(map(len, SCENARIOS))
    return "\n".join(f"{s.name:<{width}}  {s.script or '+'.join(s.parts):<24}  {s.summary}"
                     for s in SCENARIOS.values())
