"""Figures for benchmark results: speed-ups over each peer, requests and bytes per rank, CPU per GB.

Any benchmark can use these: it turns its results into *records*, one per
panel, phase and contender, and calls one function per figure kind (or
:func:`write_all`). A record is a dict with

* ``panel``: the setting it belongs to (a state dict and a link, a disk...): one row of panels per value;
* ``phase``: the x-axis group (save, load, a reshard...);
* ``contender``: the bar's name; ``peer``: True for the baselines (drawn in grey);
* ``speedup``: ``{peer name: peer time / this contender's time}`` (above 1: faster than that peer);
* ``requests``: requests per rank; ``moved_mb``: MB moved per rank; ``needed_mb``: MB the rank needs;
* ``cpu_per_gb``: CPU seconds per GB.

A field that is missing or None is left out of its figure; a figure with no
values at all is not drawn. ``bench_s3_peers.py`` (``s3_peers_report.records``)
and ``bench_dcp.py`` (``dcp_report.records``) make records.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

Record = dict[str, Any]
PEER_GREYS = ("#7f7f7f", "#b0b0b0", "#525252", "#d0d0d0")


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    return plt


def _unique(values: Sequence[Any]) -> list[Any]:
    return list(dict.fromkeys(values))


def _colors(records: list[Record]) -> dict[str, str]:
    """One colour per contender, the same in every figure: greys for peers, the default cycle for the rest."""
    peers = _unique(r["contender"] for r in records if r.get("peer"))
    others = _unique(r["contender"] for r in records if not r.get("peer"))
    cycle = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
    return {**{p: PEER_GREYS[i % len(PEER_GREYS)] for i, p in enumerate(peers)},
            **{o: cycle[i % len(cycle)] for i, o in enumerate(others)}}


def _count(v: float) -> str:
    return f"{v:.0f}" if v >= 10 else f"{v:.2g}"


def _bars(ax: Any, records: list[Record], value: Callable[[Record], float | None], colors: dict[str, str],
          annotate: Callable[[float], str] = _count, base: float = 0.0) -> list[str]:
    """Grouped bars: one group per phase, one bar per contender that has a value; returns the phases.

    Bars rise (or fall) from ``base``: 1 for speed-ups, so a slower contender's bar points down.
    """
    phases = _unique(r["phase"] for r in records)
    names = _unique(r["contender"] for r in records if value(r) is not None)
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs, ys = [], []
        for j, phase in enumerate(phases):
            v = next((value(r) for r in records if r["phase"] == phase and r["contender"] == name), None)
            if v is not None:
                xs.append(j - 0.4 + width * (i + 0.5))
                ys.append(v)
        bars = ax.bar(xs, [y - base for y in ys], width, bottom=base, label=name, color=colors[name])
        if len(names) <= 5:  # more labels than that overlap: read the values from the results' tables
            ax.bar_label(bars, [annotate(y) for y in ys], fontsize=6, padding=1)
    ax.set_xticks(range(len(phases)), phases, fontsize=8)
    return phases


def _times(v: float) -> str:
    return f"{v:.2f}x"


def _log_axis(ax: Any, fmt: Callable[[float], str]) -> None:
    """A log-scale y axis labelled in plain numbers (2x, 0.5x, 300), not powers of ten."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: fmt(y)))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: ""))


def _grid(rows: int, cols: int, title: str) -> tuple[Any, Any]:
    plt = _plt()
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.4 * rows + 0.8), squeeze=False)
    if title:
        fig.suptitle(title, fontsize=11)
    return fig, axes


def _finish(fig: Any, axes: Any, path: str) -> str:
    handles: dict[str, Any] = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    columns = max(1, min(len(handles), int(fig.get_figwidth() / 3.4)))  # about 3.4 inches per label
    legend_rows = -(-len(handles) // columns)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=columns, fontsize=8)
    # Leave the legend its rows at the bottom, in inches turned into a fraction of the figure.
    fig.tight_layout(rect=(0, min(0.4, (0.25 * legend_rows + 0.1) / fig.get_figheight()), 1, 0.97))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def speedups(records: list[Record], path: str, title: str = "") -> str | None:
    """Speed-up of each contender over each peer: a column of panels per peer, a row per setting (log scale)."""
    have = [r for r in records if r.get("speedup")]
    # The peers in the order the records list them as contenders, then any named only as a baseline.
    named = _unique(p for r in have for p in r["speedup"])
    peers = [p for p in _unique(r["contender"] for r in records) if p in named] + named
    peers = _unique(peers)
    if not peers:
        return None
    panels = _unique(r["panel"] for r in have)
    colors = _colors(records)
    fig, axes = _grid(len(panels), len(peers), title)
    for i, panel in enumerate(panels):
        for j, peer in enumerate(peers):
            ax = axes[i][j]
            rows = [r for r in have if r["panel"] == panel and r["contender"] != peer]
            _bars(ax, rows, lambda r, p=peer: r["speedup"].get(p), colors, _times, base=1.0)
            _log_axis(ax, _times)
            values = [v for r in rows if (v := r["speedup"].get(peer))] + [1.0]
            ax.set_ylim(min(values) / 1.25, max(values) * 1.25)  # room for the labels, 1x always in view
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_title(f"{panel}\nover {peer}", fontsize=9)
            ax.set_ylabel("speed-up (above 1: faster)", fontsize=8)
    return _finish(fig, axes, path)


def traffic(records: list[Record], path: str, title: str = "") -> str | None:
    """Per setting: requests per rank (log scale), and MB moved per rank with what a rank needs marked."""
    kinds = [k for k in ("requests", "moved_mb") if any(r.get(k) is not None for r in records)]
    panels = _unique(r["panel"] for r in records if any(r.get(k) is not None for k in kinds))
    if not panels:
        return None
    colors = _colors(records)
    fig, axes = _grid(len(panels), len(kinds), title)
    for i, panel in enumerate(panels):
        for j, kind in enumerate(kinds):
            ax = axes[i][j]
            rows = [r for r in records if r["panel"] == panel and r.get(kind) is not None]
            if not rows:  # e.g. local disk: bytes but no requests
                ax.axis("off")
                continue
            phases = _bars(ax, rows, lambda r, k=kind: r.get(k), colors)
            if kind == "requests":
                _log_axis(ax, _count)
                ax.set_ylabel("requests per rank", fontsize=8)
            else:
                ax.set_ylabel("MB moved per rank", fontsize=8)
                for x, phase in enumerate(phases):
                    need = next((r["needed_mb"] for r in rows if r["phase"] == phase and r.get("needed_mb")), None)
                    if need:
                        ax.hlines(need, x - 0.45, x + 0.45, colors="black", linestyles="dashed", linewidth=1,
                                  label="needed per rank")
            ax.set_title(panel, fontsize=9)
    return _finish(fig, axes, path)


def cpu(records: list[Record], path: str, title: str = "") -> str | None:
    """CPU seconds per GB of state, per contender and phase, a panel per setting."""
    have = [r for r in records if r.get("cpu_per_gb") is not None]
    if not have:
        return None
    panels = _unique(r["panel"] for r in have)
    colors = _colors(records)
    fig, axes = _grid(len(panels), 1, title)
    for i, panel in enumerate(panels):
        ax = axes[i][0]
        _bars(ax, [r for r in have if r["panel"] == panel], lambda r: r["cpu_per_gb"], colors, lambda v: f"{v:.2f}")
        ax.set_ylabel("CPU s per GB (all ranks)", fontsize=8)
        ax.set_title(panel, fontsize=9)
    return _finish(fig, axes, path)


FIGURES: dict[str, Callable[[list[Record], str, str], str | None]] = {
    "speedups": speedups, "traffic": traffic, "cpu": cpu}


def write_all(records: list[Record], directory: str, prefix: str, fmt: str = "png", title: str = "") -> list[str]:
    """Every figure kind that has values, as ``<directory>/<prefix>_<kind>.<fmt>``; the paths written."""
    out = []
    for kind, draw in FIGURES.items():
        path = draw(records, os.path.join(directory, f"{prefix}_{kind}.{fmt}"), title)
        if path:
            out.append(path)
    return out
