"""Markdown table, target check and PNG plot for ``bench_dcp.py`` results."""

from __future__ import annotations

import re
from typing import Any

README_BEGIN = "<!-- bench_dcp:begin -->"
README_END = "<!-- bench_dcp:end -->"

# (key in times, label, divides the state dict size: GB/s makes sense)
ROWS = [
    ("save", "save, 4 ranks", True),
    ("load", "load, same 4 ranks", True),
    ("reshard", "load, row -> column sharded, 4 -> 2 ranks", True),
    ("async_block", "async_save: time blocked", False),
    ("async_total", "async_save: until durable", True),
    ("slice", "one 128-row slice of the embedding, no process group", False),
    ("open", "open checkpoint (read metadata), no process group", False),
]

TARGETS = [
    # (label, figure, against, minimum speed-up)
    ("save >= 1.3x DCP", "save", "dcp_best", 1.3),
    ("save >= 0.85 of raw disk write", "save", "raw", 0.85),
    ("load >= 1.2x DCP", "load", "dcp_best", 1.2),
    ("load >= 0.85 of raw disk read", "load", "raw", 0.85),
    ("load into another topology >= 2x DCP", "reshard", "dcp_best", 2.0),
]


def _cell(seconds: float | None, nbytes: int, rate: bool) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.3f} s, {nbytes / seconds / 1e9:.2f} GB/s" if rate else f"{seconds:.3f} s"


def _ratio(other: float | None, ours: float | None) -> str:
    return "-" if other is None or ours is None else f"{other / ours:.2f}x"


def speedup(run: dict[str, Any], figure: str, against: str, ours: str = "tsckpt") -> float | None:
    """How many times faster ``ours`` was than ``against`` (``raw``, ``dcp_best``, ``dcp_default``)."""
    t = run["times"]
    name = run[against] if against.startswith("dcp") else against
    mine, other = t.get(ours, {}).get(figure), t.get(name, {}).get(figure)
    return None if mine is None or other is None else other / mine


def _columns(run: dict[str, Any]) -> list[tuple[str, str]]:
    dflt, best = run["dcp_default"], run["dcp_best"]
    return [*((v, v) for v in run["variants"]), (dflt, f"DCP {dflt[4:]} (default)"),
            (best, f"DCP {best[4:]} (best)"), ("raw", "raw disk")]


def _table(run: dict[str, Any]) -> list[str]:
    t, n = run["times"], run["bytes"]
    cols = _columns(run)
    lines = ["| figure | " + " | ".join(c[1] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for key, label, rate in ROWS:
        lines.append(f"| {label} | " + " | ".join(_cell(t.get(c, {}).get(key), n, rate) for c, _ in cols) + " |")
    stage = t["staging copy"]["copy"]
    lines.append(f"| one staging copy of a rank's state dict (clone) | {stage:.3f} s |" + " |" * (len(cols) - 1))
    mem = run["memory"]
    mem_cells = [f"{mem[c] / 1e6:.0f} MB ({mem[c] / run['local_bytes']:.0%})" if c in mem else "-" for c, _ in cols]
    lines.append(f"| peak extra memory per rank during save (local state dict {run['local_bytes'] / 1e6:.0f} MB) | "
                 + " | ".join(mem_cells) + " |")
    lines.append("| files in the checkpoint | " + " | ".join(str(run["files"].get(c, "-")) for c, _ in cols) + " |")
    lines += ["", "Speed-ups (other time / tsckpt time; above 1 means tsckpt is faster):", ""]
    heads = [f"{v} vs {other}" for v in run["variants"] for other in ("DCP default", "DCP best", "raw disk")]
    lines += ["| figure | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
    for key, label, _ in ROWS:
        cells = [_ratio(t.get(other, {}).get(key), t.get(v, {}).get(key))
                 for v in run["variants"] for other in (run["dcp_default"], run["dcp_best"], "raw")]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _targets(run: dict[str, Any], ours: str) -> list[str]:
    out = []
    for label, figure, against, minimum in TARGETS:
        s = speedup(run, figure, against, ours)
        verdict = "?" if s is None else ("met" if s >= minimum else "missed")
        out.append(f"- {label}: {'-' if s is None else f'{s:.2f}x'}, {verdict}")
    t = run["times"]
    block, stage = t.get(ours, {}).get("async_block"), t["staging copy"]["copy"]
    if block is not None:
        verdict = "met" if block <= stage else "missed"
        out.append(f"- async_save blocks <= one staging copy: {block:.3f} s vs {stage:.3f} s, {verdict}")
    extra = run["memory"].get(ours)
    if extra is not None:
        frac = extra / run["local_bytes"]
        out.append(f"- extra save memory well under one copy: {frac:.0%} of the local state dict, "
                   f"{'met' if frac <= 0.25 else 'missed'}")
    return out


def markdown(runs: list[dict[str, Any]], env: dict[str, Any]) -> str:
    args = env["args"]
    lines = [f"Run {env['date']} on {env['cpus']} CPUs: `python benchmarks/bench_dcp.py "
             f"--size-gb {args['size_gb']}`, median of {args['reps']} repetitions, "
             f"{args['world']} gloo ranks. Ratios are speed-ups of tsckpt (other time / tsckpt time)."]
    for run in runs:
        s = run["shapes"]
        lines += ["", f"**{run['dtype']}**: {run['bytes'] / 1e9:.2f} GB (hidden {s['hidden']}, ffn {s['ffn']}, "
                      f"vocab {s['vocab']}, {s['layers']} layers, weights + 2 AdamW moments)", ""]
        lines += _table(run)
        for v in run["variants"]:
            lines += ["", f"Targets, {v}:"] + _targets(run, v)
    how = {run["evict"] for run in runs}
    lines += ["", "Page cache: " + ("dropped with /proc/sys/vm/drop_caches before each load." if how == {"drop_caches"}
                                    else "this machine does not allow /proc/sys/vm/drop_caches, so before each load "
                                         "the checkpoint's files were evicted with posix_fadvise(POSIX_FADV_DONTNEED) "
                                         "after fsync (a hypervisor's own cache is out of reach).")]
    return "\n".join(lines) + "\n"


def plot(runs: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = [("save", "save"), ("load", "load"), ("reshard", "reshard 4->2"), ("async_total", "async save")]
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.8), squeeze=False)
    for ax, run in zip(axes[0], runs):
        names = list(dict.fromkeys(c for c, _ in _columns(run)))
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            vals = [run["bytes"] / run["times"].get(name, {})[k] / 1e9 if k in run["times"].get(name, {}) else 0
                    for k, _ in figures]
            ax.bar([x + i * width for x in range(len(figures))], vals, width, label=name)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(figures))], [f[1] for f in figures])
        ax.set_ylabel("GB/s (higher is better)")
        ax.set_title(f"{run['dtype']}, {run['bytes'] / 1e9:.2f} GB")
        ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def update_readme(readme: str, table: str) -> None:
    with open(readme) as f:
        text = f.read()
    block = f"{README_BEGIN}\n{table}{README_END}"
    pattern = re.compile(re.escape(README_BEGIN) + ".*?" + re.escape(README_END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{readme} has no {README_BEGIN} ... {README_END} block")
    with open(readme, "w") as f:
        f.write(pattern.sub(lambda _: block, text))
