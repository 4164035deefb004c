"""Markdown tables, ratios and target verdicts for ``bench_dcp.py`` results, and the block of them in the docs.

Everything here works on the sample lists in ``results.json``; medians and
ratios are computed here and nowhere else, so the tables can be rebuilt from
a results file (``python benchmarks/dcp_report.py results.json``; with ``--plots DIR``, the
figures of ``plots.py`` too).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from contenders import TORCH_CHECKPOINTING as TC  # noqa: E402
from harness import table  # noqa: E402
from ranges import Figure  # noqa: E402

#: The page whose marked block ``bench_dcp.py --update-docs`` rewrites, and the markers around it.
DOCS_PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "benchmarks", "dcp.md")
BLOCK_BEGIN = "<!-- bench_dcp:begin -->"
BLOCK_END = "<!-- bench_dcp:end -->"
DCP = "dcp-t1"  # DCP's default FileSystemWriter/FileSystemReader (thread_count=1)
#: Ratios pair contenders that promise the same after a power loss: those that fsync with DCP's default,
#: those that do not (tsckpt with sync_files=False) with torch-checkpointing.
PEERS = (DCP, TC)

# (key in samples, label; {world}/{fewer} are filled in)
FIGURES = [
    ("save", "save, {world} ranks, row-sharded"),
    ("load", "load, same {world} ranks"),
    ("reshard_same", "load column-sharded, {world} -> {world} ranks"),
    ("reshard_fewer", "load column-sharded, {world} -> {fewer} ranks"),
]
EXTRAS = [
    ("first_save", "a job's first save (fresh ranks), {world} ranks"),
    ("first_load", "a job's first load (fresh ranks), same {world} ranks"),
    ("async_block", "async_save: time blocked"),
    ("async_total", "async_save: until durable"),
    ("open", "open checkpoint (read metadata), no process group"),
    ("slice", "one 128-row slice of the embedding, no process group"),
]
#: The local-disk targets against DCP's default writer and reader (median speed-ups).
TARGETS = [("save", 1.0), ("load", 1.0), ("reshard_same", 1.5), ("first_save", 1.0)]
RAW_TARGET = 0.6  # a save's speed as a fraction of a raw fsync'd write of the same bytes
FETCH_TARGET = 1.3


def synced(name: str) -> bool:
    """Whether contender ``name`` makes its checkpoint durable before its save returns."""
    return name != TC and "sync_files=False" not in name


def peer_of(name: str) -> str:
    """The peer a contender's ratios are taken against: the one that syncs as much as it does."""
    return DCP if synced(name) else TC


def median(xs: list[float] | None) -> float | None:
    return statistics.median(xs) if xs else None


def speedup(samples: dict[str, dict[str, list[float]]], figure: str, ours: str, other: str = DCP
            ) -> tuple[float, float, float] | None:
    """``other`` time / ``ours`` time: the ratio of medians, and the lowest and highest per-repetition ratio.

    Above 1 means ``ours`` was faster. Repetition i of one is paired with
    repetition i of the other (they ran back to back, in rotating order).
    """
    mine, theirs = samples.get(ours, {}).get(figure), samples.get(other, {}).get(figure)
    if not mine or not theirs:
        return None
    pairs = [t / m for m, t in zip(mine, theirs)]
    return statistics.median(theirs) / statistics.median(mine), min(pairs), max(pairs)


def _seconds(xs: list[float] | None) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):.3f} s" + (f" ({min(xs):.2f}-{max(xs):.2f})" if len(xs) > 1 else "")


def _ratio_cell(r: tuple[float, float, float] | None) -> str:
    if r is None:
        return "-"
    return f"**{r[0]:.2f}x**" + (f" ({r[1]:.2f}-{r[2]:.2f})" if r[1] != r[2] else "")


def label(name: str) -> str:
    """A contender's column heading."""
    if name == DCP:
        return "DCP FileSystemWriter/Reader (default)"
    if name.startswith("dcp-t"):
        return f"DCP thread_count={name[5:]}"
    if name.startswith("tsckpt-dcp/"):
        return f"tsckpt via dcp.save/load, {name.split('/')[1]}"
    if name.startswith("tsckpt/"):
        return f"tsckpt.save/load, {name.split('/')[1]}"
    return {"raw": "raw disk", TC: "torch-checkpointing, sync saver"}.get(name, name)


def tsckpt_names(samples: dict[str, Any]) -> list[str]:
    return [n for n in samples if n.startswith("tsckpt")]


def _columns(samples: dict[str, Any]) -> list[str]:
    others = [n for n in samples if n.startswith("dcp-t") and n != DCP]
    return [*tsckpt_names(samples), DCP, *others, *(n for n in (TC, "raw") if n in samples)]


def _versus(name: str) -> str:
    """A ratio column's heading: the tsckpt contender, and its peer where that is not DCP's default."""
    return label(name) if synced(name) or name in PEERS else f"{label(name)} over {label(TC)}"


def run_tables(run: dict[str, Any]) -> list[str]:
    """Medians (range) per contender, then speed-ups over DCP's default, for one workload."""
    s, cols = run["samples"], _columns(run["samples"])
    fill = {"world": run["world"], "fewer": run["reshard_world"]}
    rows = [[text.format(**fill), *(_seconds(s.get(c, {}).get(key)) for c in cols)]
            for key, text in FIGURES + EXTRAS if any(key in s.get(c, {}) for c in cols)]
    if "staging copy" in s:
        rows.append([f"one staging copy of a rank's state dict (clone): {_seconds(s['staging copy']['copy'])}",
                     *["-"] * len(cols)])
    mem = run.get("memory", {})
    rows.append([f"peak extra memory per rank during save (local state dict {run['local_bytes'] / 1e6:.0f} MB)",
                 *(f"{mem[c] / 1e6:.0f} MB" if c in mem else "-" for c in cols)])
    rows.append(["files in the checkpoint", *(run["files"].get(c, "-") for c in cols)])
    lines = table(["median seconds (min-max)", *map(label, cols)], rows).splitlines()
    ours = tsckpt_names(s)
    lines += ["", "Speed-up of tsckpt over its peer (peer time / tsckpt time; above 1 means tsckpt is faster; "
                  "ratio of medians, range of the per-repetition ratios): DCP's default for tsckpt's durable saves, "
                  "torch-checkpointing for tsckpt with sync_files=False (neither syncs):", ""]
    ratios = [[text.format(**fill), *(_ratio_cell(speedup(s, key, n, peer_of(n))) for n in ours)]
              for key, text in FIGURES + EXTRAS]
    lines += table(["figure", *map(_versus, ours)], [r for r in ratios if any(c != "-" for c in r[1:])]).splitlines()
    if TC in s:
        lines += ["", NO_RESHARD]
    return lines


#: Why torch-checkpointing has no column-sharded loads: a limit of what it supports, not a failure.
NO_RESHARD = ("torch-checkpointing takes part in saves and same-topology loads only: its resharding load "
              "all-gathers its metadata in CUDA tensors, which these CPU ranks do not have.")


def verdicts(samples: dict[str, Any]) -> list[str]:
    """One line per tsckpt contender: each target's median speed-up over DCP's default, met or missed.

    The targets are set against DCP's default, which syncs: tsckpt with
    ``sync_files=False`` gets its save and load speed-ups over torch-checkpointing, with no target.
    """
    out = []
    for name in tsckpt_names(samples):
        parts = []
        if not synced(name):
            for figure in ("save", "load"):
                if (r := speedup(samples, figure, name, TC)) is not None:
                    parts.append(f"{figure} {r[0]:.2f}x")
            out.append(f"- {_versus(name)} (no target): " + ("; ".join(parts) or f"{label(TC)} not measured"))
            continue
        for figure, minimum in TARGETS:
            r = speedup(samples, figure, name)
            if r is not None:
                parts.append(f"{figure} {r[0]:.2f}x (>= {minimum}x {'met' if r[0] >= minimum else 'missed'})")
        raw = speedup(samples, "save", name, "raw")
        if raw is not None:
            parts.append(f"save at {raw[0]:.0%} of a raw fsync'd write "
                         f"(>= {RAW_TARGET:.0%} {'met' if raw[0] >= RAW_TARGET else 'missed'})")
        out.append(f"- {label(name)}: " + "; ".join(parts))
    return out


def _load_label(key: str, world: int) -> str:
    placement, _, ranks = key.partition(":")
    what = {"column": "column-sharded", "row": "row-sharded", "replicated": "replicated"}.get(placement, placement)
    return f"{what}, {world} -> {ranks} ranks"


def _fetched_rows(loads: dict[str, Any], world: int) -> list[list[str]]:
    rows = []
    for key, by_contender in loads.items():
        for name, e in by_contender.items():
            needed, got = e["needed"], e["rchar"]
            per_rank = max(g / n for g, n in zip(got, needed) if n)
            ratio = sum(got) / sum(needed)
            # A replicated load needs a whole copy on every rank; storage served that many copies.
            copies = f" ({sum(got) / needed[0]:.2f} copies)" if key.startswith("replicated") else ""
            rows.append([_load_label(key, world), label(name), f"{sum(needed) / 1e6:.1f} MB",
                         f"{sum(got) / 1e6:.1f} MB", f"**{ratio:.2f}**{copies}", f"**{per_rank:.2f}**",
                         f"{sum(e['read_bytes']) / sum(needed):.2f}", f"{e['seconds']:.3f}"])
    return rows


def fetched_tables(f: dict[str, Any]) -> list[str]:
    """Bytes each rank fetched from the local disk vs the bytes it needed, for every resharded load."""
    lines: list[str] = []
    world = f["world"]
    disk = f.get("disk")
    if disk:
        lines += ["", f"Local disk ({disk['bytes'] / 1e6:.0f} MB state dict saved row-sharded by {world} ranks). "
                      "`rchar`: bytes a rank's read/pread calls returned (what a rank on its own node would "
                      "fetch); the ratio is summed over ranks against what the ranks' tensors hold, and for the "
                      "rank that fetched the most relative to its needs. `read_bytes / needed`: bytes the block "
                      "device delivered after the page cache was dropped (ranks on one machine share the cache).", ""]
        lines += table(["load into", "contender", "needed", "rchar", "rchar / needed", "largest rank",
                        "read_bytes / needed", "seconds"],
                       _fetched_rows(disk["loads"], world)).splitlines()
    return lines


def many_tables(many: list[dict[str, Any]]) -> list[str]:
    """More ranks than cores: save and load medians, files, and speed-ups over each contender's peer."""
    if not many:
        return []
    first = many[0]
    lines = ["", f"{first['describe']} ({first['bytes'] / 1e6:.0f} MB), row-sharded, saved and loaded back "
                 f"into the same ranks on this {first.get('cpus', '?')}-CPU machine:", ""]
    rows = []
    for m in many:
        s = m["samples"]
        for name in _peers_first(s):
            ratios = ["-" if name in PEERS else _ratio_cell(speedup(s, fig, name, peer_of(name)))
                      for fig in ("save", "load")]
            rows.append([m["ranks"], _versus(name), _seconds(s[name].get("save")), _seconds(s[name].get("load")),
                         m["files"].get(name, "-"), *ratios])
    return lines + table(["ranks", "contender", "save", "load", "files", "save speed-up", "load speed-up"],
                         rows).splitlines()


def _peers_first(samples: dict[str, Any]) -> list[str]:
    """The peers measured (DCP's default, torch-checkpointing), then the tsckpt contenders."""
    return [*(p for p in PEERS if p in samples), *tsckpt_names(samples)]


def markdown(results: dict[str, Any]) -> str:
    env = results["env"]
    lay = results.get("layouts", {})
    lines = [f"Run {env['date']} on {env['machine']}: `{env['command']}`. Load average "
             f"{env['load_before']} before the run and {env.get('load_after', '?')} after it."
             + ("" if env.get("complete") else " **Partial run: it stopped before every phase finished; "
                                               "the tables hold what did finish.**"),
             "",
             f"Each figure is the median of {env['reps']} repetitions (range in brackets); every repetition "
             "runs each contender once, rotating who goes first. Times are wall-clock between barriers, i.e. "
             "the slowest rank's. Before every load the page cache is "
             # results saved before every benchmark evicted only the checkpoint's files may say drop_caches
             + ("dropped (`/proc/sys/vm/drop_caches`)." if _evicts(results) == {"drop_caches"}
                else "emptied of the checkpoint's files with posix_fadvise(DONTNEED).")
             + " Ratios are speed-ups of tsckpt over DCP's default `FileSystemWriter`/`FileSystemReader` "
               "(DCP time / tsckpt time): above 1, tsckpt is faster."
             + (" tsckpt with `sync_files=False` is compared with torch-checkpointing instead: neither fsyncs, so "
                "a power loss can lose or tear their checkpoints, while DCP's default and tsckpt's default are "
                "durable when their saves return." if _unsynced(results) else "")]
    if lay.get("skipped"):
        lines += ["", f"Layouts not measured (the installed tsckpt does not accept them): {', '.join(lay['skipped'])}."]
    for name, why in results.get("peers", {}).get("skipped", {}).items():
        lines += ["", f"{label(name)} not measured: {why}."]
    for run in results.get("runs", []):
        lines += ["", f"**{run['workload']}, {run['dtype']}**: {run['bytes'] / 1e9:.3f} GB ({run['describe']}), "
                      f"{run['world']} gloo ranks.", ""]
        lines += run_tables(run)
        lines += ["", "Targets (median speed-up over DCP's default):"] + verdicts(run["samples"])
    if results.get("fetched"):
        lines += ["", "**Bytes fetched vs bytes needed on a resharded load**"] + fetched_tables(results["fetched"])
    if results.get("many"):
        lines += ["", "**More ranks than cores: many small tensors**"] + many_tables(results["many"])
    return "\n".join(lines) + "\n"


def _unsynced(results: dict[str, Any]) -> bool:
    runs = results.get("runs", []) + results.get("many", [])
    return any(not synced(n) for run in runs for n in run["samples"])


def _evicts(results: dict[str, Any]) -> set[str]:
    return {run["evict"] for run in results.get("runs", []) + results.get("many", []) if run.get("evict")}


def records(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The results as ``plots.py`` records: speed-ups over each contender's peer per workload, bytes per rank
    per load.

    Timed runs give one panel per workload (seconds and the speed-up over
    DCP's default, or over torch-checkpointing for tsckpt with ``sync_files=False``);
    the bytes-fetched phase one panel (MB a rank fetched and what it needed).
    bench_dcp measures no CPU.
    """
    out: list[dict[str, Any]] = []
    for run in results.get("runs", []):
        s = run["samples"]
        panel = f"{run['workload']} {run['dtype']} {run['bytes'] / 1e9:.2f} GB, local disk"
        fill = {"world": run["world"], "fewer": run["reshard_world"]}
        for key, short in SHORT.items():
            for name in _peers_first(s):
                times = s.get(name, {}).get(key)
                if not times:
                    continue
                ratio = None if name in PEERS else speedup(s, key, name, peer_of(name))
                out.append({"panel": panel, "phase": short.format(**fill), "contender": label(name),
                            "peer": name in PEERS, "seconds": median(times),
                            "speedup": {label(peer_of(name)): ratio[0]} if ratio else {}})
    fetched = results.get("fetched") or {}
    if disk := fetched.get("disk"):
        panel = f"bytes fetched, local disk, {disk['bytes'] / 1e6:.0f} MB state"
        for key, by_name in disk["loads"].items():
            for name, e in by_name.items():
                ranks = len(e["needed"])
                out.append({"panel": panel, "phase": _short_load(key, fetched["world"]), "contender": label(name),
                            "peer": name == DCP, "moved_mb": sum(e["rchar"]) / ranks / 1e6,
                            "needed_mb": sum(e["needed"]) / ranks / 1e6})
    return out


def figures(results: dict[str, Any]) -> list[Figure]:
    """The run's medians as rows of ``ranges.py``: one per workload (or rank count), phase and contender.

    DCP's writers (``dcp-t<N>``) are the peers; raw disk is shown as a reference. The contenders
    that do not sync are a store of their own, ``local disk, no fsync``, whose peer is
    torch-checkpointing: a best peer that skips the fsync would bill tsckpt's durable saves for it.
    """
    out = []
    for run in results.get("runs", []):
        state = f"{run['workload']} {run['dtype']}, {run['bytes'] / 1e9:.2f} GB"
        fill = {"world": run["world"], "fewer": run["reshard_world"]}
        for key, text in FIGURES + EXTRAS:
            for name in _columns(run["samples"]):
                if times := run["samples"].get(name, {}).get(key):
                    out.append(_figure(name, state, text.format(**fill), times))
    for many in results.get("many", []):
        state = f"{many['describe']}, {many['ranks']} ranks"
        for key in ("save", "load"):
            for name in _peers_first(many["samples"]):
                if times := many["samples"].get(name, {}).get(key):
                    out.append(_figure(name, state, key, times))
    return out


def _figure(name: str, state: str, phase: str, times: list[float]) -> Figure:
    store = "local disk" if synced(name) else "local disk, no fsync"
    return Figure(store, state, phase, label(name), name.startswith("dcp-t") or name == TC,
                  {"seconds": statistics.median(times)})


#: Axis labels of the figures, by key in the samples.
SHORT = {"save": "save", "load": "load", "reshard_same": "cols {world}→{world}", "reshard_fewer": "cols {world}→{fewer}",
         "first_save": "first save", "first_load": "first load"}


def _short_load(key: str, world: int) -> str:
    """``column:2`` -> ``column 4→2``."""
    placement, _, ranks = key.partition(":")
    return f"{placement} {world}→{ranks}"


def write_plots(results: dict[str, Any], directory: str, fmt: str = "png") -> list[str]:
    """The figures of ``plots.py`` for these results, as ``dcp_<kind>.<fmt>`` in ``directory``."""
    import plots

    return plots.write_all(records(results), directory, "dcp", fmt, title="tsckpt and DCP's default writer")


def update_block(page: str, table: str) -> None:
    """Replace the text between the markers in ``page`` (:data:`DOCS_PAGE`) with ``table``."""
    with open(page) as f:
        text = f.read()
    block = f"{BLOCK_BEGIN}\n{table}{BLOCK_END}"
    pattern = re.compile(re.escape(BLOCK_BEGIN) + ".*?" + re.escape(BLOCK_END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{page} has no {BLOCK_BEGIN} ... {BLOCK_END} block")
    with open(page, "w") as f:
        f.write(pattern.sub(lambda _: block, text))


if __name__ == "__main__":
    # python benchmarks/dcp_report.py results.json [--plots DIR]
    with open(sys.argv[1]) as fh:
        loaded = json.load(fh)
    print(markdown(loaded))
    if sys.argv[2:3] == ["--plots"]:
        for written in write_plots(loaded, sys.argv[3]):
            print(written)
