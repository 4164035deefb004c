"""Tables, speed-ups, target verdicts and figures for ``bench_s3_peers.py`` results.

Everything here works on the samples in ``s3_peers.json``; medians and ratios
are computed here and nowhere else, so the tables and figures can be rebuilt
from a results file:

    python benchmarks/s3_peers_report.py build/bench/s3/run-1/s3_peers.json
    python benchmarks/s3_peers_report.py build/bench/s3/run-1/s3_peers.json --plots /tmp/figures --format svg
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import table  # noqa: E402
from ranges import Figure  # noqa: E402

FSSPEC, CONNECTOR = "dcp-fsspec", "s3torchconnector"  # as in s3_peers_ranks (which imports torch)
PEERS = (FSSPEC, CONNECTOR)
PHASES = [("save", "save, {world} ranks, row-sharded"),
          ("load", "same-topology load, {world} ranks"),
          ("reshard_cols", "column-resharded load, {world} → {world}"),
          ("reshard_fewer", "column-resharded load, {world} → {fewer}"),
          ("replicated", "replicated load, {world} ranks")]
SHORT = {"save": "save", "load": "load", "reshard_cols": "cols {world}→{world}",
         "reshard_fewer": "cols {world}→{fewer}", "replicated": "replicated"}
#: Issue 31's object-storage targets: the least speed-up over the faster peer, per phase.
SPEEDUP_TARGETS = {"save": 1.0, "load": 1.0, "reshard_cols": 2.0, "reshard_fewer": 2.0, "replicated": 2.0}
REQUESTS_TARGET = 1.5  # at most this many times s3torchconnector's requests per rank
FETCH_TARGET = 1.3  # at most this many bytes fetched per byte needed

COLUMNS = """\
Columns: **seconds**, the median wall-clock time between barriers (the slowest rank's), fastest and slowest
repetition in brackets. **vs faster peer**, the median seconds of the faster peer in that phase (DCP + fsspec or
s3torchconnector, whichever has the lower median) over the contender's: above 1, faster than both peers; in
brackets, the median of the same ratio taken per repetition (repetition i of each, run back to back).
**requests / rank**, the HTTP requests a rank sent through its link, mean over the ranks. **MB sent / rank** and
**MB fetched / rank**, the bytes a rank sent to and got from the store, HTTP headers included, mean over the
ranks. **moved / needed**, the bytes moved the phase's way (sent by a save, fetched by a load) over the tensor
bytes the ranks hold (a save) or need (a load: their destination shards, a whole state on each replicated rank),
summed over the ranks; the largest single rank's ratio in brackets where it is higher. **CPU s / GB**, user +
system CPU seconds of every rank process (all threads) during the phase, per GB of state dict; moto and the link
proxies are not counted. Every figure is the median over repetitions."""


def label(name: str) -> str:
    """A contender's name in tables and figures."""
    if name == FSSPEC:
        return "DCP FsspecWriter/Reader + s3fs"
    if name == CONNECTOR:
        return "s3torchconnector"
    if name.startswith("tsckpt-dcp/"):
        return f"tsckpt {name.split('/', 1)[1]}"
    return name


def _moved(phase: str) -> str:
    return "sent" if phase == "save" else "received"


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _figures(samples: list[dict[str, Any]], phase: str, gb: float) -> dict[str, Any]:
    """Medians over repetitions of one contender's phase."""
    moved = _moved(phase)

    def med(fn: Any) -> float:
        return statistics.median(fn(s) for s in samples)

    seconds = [s["seconds"] for s in samples]
    return {"seconds": statistics.median(seconds), "min": min(seconds), "max": max(seconds),
            "requests": med(lambda s: _mean(s["requests"])),
            "sent_mb": med(lambda s: _mean(s["sent"]) / 1e6), "fetched_mb": med(lambda s: _mean(s["received"]) / 1e6),
            "moved_mb": med(lambda s: _mean(s[moved]) / 1e6), "needed_mb": med(lambda s: _mean(s["needed"]) / 1e6),
            "ratio": med(lambda s: sum(s[moved]) / max(1, sum(s["needed"]))),
            "worst": med(lambda s: max(m / n for m, n in zip(s[moved], s["needed"]) if n) if any(s["needed"]) else 0),
            "cpu_per_gb": med(lambda s: sum(s["cpu"]) / gb)}


def speedup(samples: dict[str, Any], phase: str, ours: str, peer: str) -> tuple[float, float] | None:
    """``peer``'s seconds over ``ours``: the ratio of medians and the median of the per-repetition ratios."""
    mine, theirs = samples.get(ours, {}).get(phase), samples.get(peer, {}).get(phase)
    if not mine or not theirs:
        return None
    a, b = [s["seconds"] for s in mine], [s["seconds"] for s in theirs]
    return statistics.median(b) / statistics.median(a), statistics.median(t / m for m, t in zip(a, b))


def faster_peer(samples: dict[str, Any], phase: str) -> str | None:
    timed = [(statistics.median(s["seconds"] for s in samples[p][phase]), p)
             for p in PEERS if phase in samples.get(p, {})]
    return min(timed)[1] if timed else None


def summarize(block: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per contender and phase: medians, speed-ups over each peer and over the faster one."""
    gb = block["bytes"] / 1e9
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, phases in block["samples"].items():
        for phase, samples in phases.items():
            f = _figures(samples, phase, gb)
            f["speedup"] = {p: r for p in PEERS if (r := speedup(block["samples"], phase, name, p))}
            best = faster_peer(block["samples"], phase)
            f["faster_peer"] = best
            f["vs_faster"] = speedup(block["samples"], phase, name, best) if best else None
            out.setdefault(name, {})[phase] = f
    return out


def _order(names: list[str]) -> list[str]:
    return [p for p in PEERS if p in names] + [n for n in names if n not in PEERS]


def _ratio(r: tuple[float, float] | None) -> str:
    return "-" if r is None else f"**{r[0]:.2f}x** ({r[1]:.2f}x)"


def block_heading(block: dict[str, Any]) -> str:
    link = block["link"]
    return (f"**{block['state']}**, {block['bytes'] / 1e9:.3f} GB ({block['describe']}); link "
            f"{link['mb_per_s']:g} MB/s each way, {link['latency_ms']:g} ms before each request; "
            f"{block['world']} gloo ranks ({block['fewer']} in the smaller group)")


def block_table(block: dict[str, Any]) -> list[str]:
    s = summarize(block)
    fill = {"world": block["world"], "fewer": block["fewer"]}
    rows = []
    for phase, text in PHASES:
        for name in _order([n for n in s if phase in s[n]]):
            f = s[name][phase]
            worst = f" ({f['worst']:.2f})" if f["worst"] > f["ratio"] * 1.005 else ""
            rows.append([text.format(**fill), label(name), f"{f['seconds']:.3f} s ({f['min']:.2f}-{f['max']:.2f})",
                         _ratio(f["vs_faster"]), f"{f['requests']:.0f}", f"{f['sent_mb']:.1f}",
                         f"{f['fetched_mb']:.1f}", f"{f['ratio']:.2f}{worst}", f"{f['cpu_per_gb']:.2f}"])
    return table(["phase", "contender", "seconds", "vs faster peer", "requests / rank", "MB sent / rank",
                  "MB fetched / rank", "moved / needed", "CPU s / GB"], rows, "llrrrrrrr").splitlines()


def verdicts(block: dict[str, Any]) -> list[str]:
    """Issue 31's object-storage targets, per tsckpt contender: met or missed."""
    s = summarize(block)
    out = []
    for name in [n for n in s if n not in PEERS]:
        parts = []
        for phase, least in SPEEDUP_TARGETS.items():
            f = s[name].get(phase)
            if f and f["vs_faster"]:
                parts.append(f"{phase} {f['vs_faster'][0]:.2f}x (>= {least:g}x {_met(f['vs_faster'][0] >= least)})")
        for phase, f in s[name].items():
            peer = s.get(CONNECTOR, {}).get(phase)
            if peer and peer["requests"]:
                r = f["requests"] / peer["requests"]
                parts.append(f"{phase} requests {r:.2f}x s3torchconnector's (<= {REQUESTS_TARGET}x {_met(r <= REQUESTS_TARGET)})")
            if phase != "save":
                parts.append(f"{phase} fetched {f['ratio']:.2f}x needed (<= {FETCH_TARGET}x "
                             f"{_met(f['ratio'] <= FETCH_TARGET)})")
        out.append(f"- {label(name)}: " + "; ".join(parts))
    return out


def _met(ok: bool) -> str:
    return "met" if ok else "missed"


def markdown(results: dict[str, Any]) -> str:
    env = results["env"]
    lines = [f"Run {env['date']}, code of commit {env.get('commit', '?')}, on {env['machine']}: "
             f"`{env['command']}`. Load average {env['load_before']} "
             f"before the run and {env.get('load_after', '?')} after it."
             + ("" if env.get("complete") else " **Partial run: the tables hold the blocks that finished.**"),
             "", f"Medians of {env['reps']} repetitions; each repetition runs every contender once (its save, then "
                 "its loads), rotating who goes first. " + COLUMNS]
    if env.get("notes"):
        lines += ["", "Left out: " + "; ".join(env["notes"]) + "."]
    for block in results["blocks"]:
        lines += ["", block_heading(block), ""] + block_table(block)
        lines += ["", "Targets (issue 31, against the faster peer):"] + verdicts(block)
    return "\n".join(lines) + "\n"


def records(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One record per block, phase and contender, in the form ``plots.py`` draws."""
    out = []
    for block in results["blocks"]:
        s = summarize(block)
        fill = {"world": block["world"], "fewer": block["fewer"]}
        panel = (f"{block['state']} {block['bytes'] / 1e9:.2f} GB, "
                 f"{block['link']['mb_per_s']:g} MB/s, {block['link']['latency_ms']:g} ms")
        for phase, _ in PHASES:
            for name in _order([n for n in s if phase in s[n]]):
                f = s[name][phase]
                out.append({"panel": panel, "phase": SHORT[phase].format(**fill), "contender": label(name),
                            "peer": name in PEERS, "seconds": f["seconds"],
                            "speedup": {label(p): r[0] for p, r in f["speedup"].items() if p != name},
                            "requests": f["requests"], "moved_mb": f["moved_mb"], "needed_mb": f["needed_mb"],
                            "cpu_per_gb": f["cpu_per_gb"]})
    return out


def figures(results: dict[str, Any]) -> list[Figure]:
    """The run's medians as rows of ``ranges.py``: a store per link setting, a row per state, phase and contender."""
    out = []
    for block in results["blocks"]:
        s = summarize(block)
        fill = {"world": block["world"], "fewer": block["fewer"]}
        store = f"S3 (moto), each rank behind a link of {block['link']['label']}"
        state = f"{block['state']}, {block['bytes'] / 1e9:.2f} GB"
        for phase, text in PHASES:
            for name in _order([n for n in s if phase in s[n]]):
                f = s[name][phase]
                out.append(Figure(store, state, text.format(**fill), label(name), name in PEERS,
                                  {"seconds": f["seconds"], "requests / rank": f["requests"],
                                   "CPU s / GB": f["cpu_per_gb"]}))
    return out


def link_records(results: dict[str, Any]) -> list[dict[str, Any]]:
    """tsckpt's speed-up over the faster peer, a panel per state and a bar per link: how its lead moves with
    the link."""
    out = []
    for block in results["blocks"]:
        s = summarize(block)
        fill = {"world": block["world"], "fewer": block["fewer"]}
        for phase, _ in PHASES:
            for name in [n for n in s if n not in PEERS and phase in s[n]]:
                f = s[name][phase]
                if f["vs_faster"]:
                    out.append({"panel": f"{block['state']} state, {block['bytes'] / 1e9:.2f} GB",
                                "phase": SHORT[phase].format(**fill),
                                "contender": f"{label(name)}, link {block['link']['label']}", "peer": False,
                                "speedup": {"the faster peer": f["vs_faster"][0]}})
    return out


def plot(results: dict[str, Any], directory: str, fmt: str = "png") -> list[str]:
    """The figures of ``plots.py`` for these results, as ``s3_peers_<kind>.<fmt>`` in ``directory``, and
    ``s3_peers_links.<fmt>``: tsckpt over the faster peer, link by link."""
    import plots

    paths = plots.write_all(records(results), directory, "s3_peers", fmt,
                            title="tsckpt and its peers on S3 through emulated node links")
    links = plots.speedups(link_records(results), os.path.join(directory, f"s3_peers_links.{fmt}"),
                           title="tsckpt on S3 through emulated node links")
    return paths + ([links] if links else [])


def main() -> None:
    ap = argparse.ArgumentParser(description="Tables (and figures) again from bench_s3_peers.py results files; "
                                             "the blocks of several files are put together")
    ap.add_argument("results", nargs="+")
    ap.add_argument("--plots", default="", help="directory for the figures (default: none)")
    ap.add_argument("--format", default="png", choices=("png", "svg"))
    args = ap.parse_args()
    loaded = []
    for path in args.results:
        with open(path) as f:
            loaded.append(json.load(f))
    results = loaded[0] | {"blocks": [b for r in loaded for b in r["blocks"]]}
    print(markdown(results))
    if args.plots:
        for path in plot(results, args.plots, args.format):
            print(path)


if __name__ == "__main__":
    main()
