"""Several runs of one scenario side by side: the range of the runs' medians, and ratios against the best peer.

One run of a scenario repeats every contender a few times and reports medians
over those repetitions; on a shared machine two runs of the same command can
differ by more than the differences measured. So ``python -m benchmarks
SCENARIO --runs N`` runs it N times and prints, per store, one table whose
cells are the lowest and highest of the N medians. Each scenario turns one
run's results file into :class:`Figure` rows (``scenarios.py``); this module
only lines them up, so it needs neither torch nor tsckpt.

The ratio to the best peer is taken within each run, against the lowest
median of that phase among the peers (DCP's writers, s3torchconnector...), and
its range is over runs too. For times it is a speed-up, the peer's median over
the contender's (above 1: faster than every peer); for CPU it is a share, the
contender's over the peer's (below 1: less CPU than every peer), as the CPU
targets are written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from harness import table


@dataclasses.dataclass(frozen=True)
class Figure:
    """One contender's medians for one phase of one run.

    ``values`` maps a measure to the run's median; the first measure is the one
    compared with the peers (lower is better: seconds, CPU seconds), the others
    are shown beside it. ``share``: give that comparison as this figure over the
    best peer's (CPU), not the best peer's over this one (a speed-up).
    """

    store: str
    state: str
    phase: str
    contender: str
    peer: bool
    values: dict[str, float]
    share: bool = False

    @property
    def row(self) -> tuple[str, str, str]:
        return self.state, self.phase, self.contender

    @property
    def compared(self) -> float:
        return next(iter(self.values.values()))


def number(x: float) -> str:
    """About three significant digits, no exponent."""
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def ratio(x: float) -> str:
    return f"{x:.2f}"


def span(xs: Sequence[float], digits: Callable[[float], str] = number, wrap: str = "{}") -> str:
    """``lowest-highest`` of ``xs`` (one value where they agree), each written by ``digits``, then put in ``wrap``."""
    if not xs:
        return "-"
    low, high = digits(min(xs)), digits(max(xs))
    return wrap.format(low if low == high else f"{low}-{high}")


def vs_best_peer(run: Sequence[Figure], figure: Figure) -> float | None:
    """The best peer's median of ``figure``'s phase in the same run over ``figure``'s (the inverse for a
    ``share``); None without a peer."""
    peers = [f.compared for f in run
             if f.peer and f.store == figure.store and f.state == figure.state and f.phase == figure.phase]
    if not peers or not figure.compared or not min(peers):
        return None
    return figure.compared / min(peers) if figure.share else min(peers) / figure.compared


def tables(runs: Sequence[Sequence[Figure]]) -> list[str]:
    """One markdown table per store over ``runs`` (each a run's figures), with its heading line."""
    stores: dict[str, dict[tuple[str, str, str], list[tuple[Figure, float | None]]]] = {}
    for run in runs:
        for f in run:
            stores.setdefault(f.store, {}).setdefault(f.row, []).append((f, vs_best_peer(run, f)))
    out = []
    for store, rows in stores.items():
        measures = list(dict.fromkeys(m for got in rows.values() for f, _ in got for m in f.values))
        share = next(iter(rows.values()))[0][0].share
        versus = "x best peer's (below 1: less)" if share else "speed-up over best peer"
        header = ["state", "phase", "contender", measures[0], versus, *measures[1:]]
        cells = []
        for (state, phase, contender), got in rows.items():
            ratios = [r for _, r in got if r is not None]
            cells.append([state, phase, contender, span([f.values[measures[0]] for f, _ in got]),
                          span(ratios, ratio, "**{}x**"),
                          *(span([f.values[m] for f, _ in got if m in f.values]) for m in measures[1:])])
        out += [f"**{store}**, {len(runs)} run{'s' * (len(runs) != 1)}", "",
                table(header, cells, "lll" + "r" * (len(header) - 3)), ""]
    return out


HOW_TO_READ = ("Each cell is the range (lowest-highest) of the runs' medians; a single value where they agree or "
               "there was one run. The ratio to the best peer is taken within each run, against the lowest median "
               "among the peers in that phase: a speed-up for times (the peer's over the contender's, above 1 "
               "faster than every peer), a share for CPU (the contender's over the peer's, below 1 less than every "
               "peer).")
