"""Run a named benchmark scenario, once or several times, and print its runs side by side.

    python -m benchmarks --list
    python -m benchmarks local --runs 2 --workloads untuned --size-gb 1 --layouts packed --phases timed,first
    python -m benchmarks s3 --runs 2 --states small --links 60:10,200:2 --layouts packed
    python -m benchmarks peers --runs 2 --local "--workloads small --size-gb 0.16" --s3 "--states small"
    python -m benchmarks local --summarize RUN1/results.json RUN2/results.json   # the tables again, no run
    python -m benchmarks local --help                                           # these options, then the script's

Options of this command, for the comparisons: ``--runs N`` (default 1) runs
the scenario N times; ``--out DIR`` (default ``build/bench/SCENARIO``) holds
each run's results (``DIR/run-K``) and ``summary.md``; ``--summarize FILE...``
prints the summary of results files already written. Every other option goes
to the scenario's script, unchanged; the other scenarios run their script
once. After the runs, the summary gives for each store one table: every phase
and contender, the range of the runs' medians, and the ratio against the best
peer (see ``ranges.py``). Each run also prints the script's own tables, with
the range over its repetitions.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import harness  # noqa: E402
import ranges  # noqa: E402
from scenarios import SCENARIOS, Scenario, listing  # noqa: E402


def options(scenario: Scenario) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks {scenario.name}", description=scenario.summary,
                                 add_help=False, allow_abbrev=False)
    ap.add_argument("-h", "--help", action="store_true", help="this help, then the script's")
    if scenario.compares:
        ap.add_argument("--out", default=os.path.join(ROOT, "build", "bench", scenario.name),
                        help="each run's results go to OUT/run-K, the summary to OUT/summary.md")
        ap.add_argument("--runs", type=int, default=1, help="how many times to run the scenario")
    if scenario.figures:
        ap.add_argument("--summarize", nargs="+", metavar="FILE", help="results files (or run directories) "
                        "written before: print their summary and run nothing")
    for part in scenario.parts:
        ap.add_argument(f"--{part}", default="", metavar="OPTIONS", help=f"options for the {part} scenario, quoted")
    return ap


def script_command(scenario: Scenario, args: list[str]) -> list[str]:
    return [sys.executable, os.path.join(HERE, scenario.script), *args]


def run_once(scenario: Scenario, args: list[str], where: str = "") -> tuple[int, str | None]:
    """One run of ``scenario``'s script with ``args``; its exit status and its results file (if it writes one)."""
    cmd = script_command(scenario, args)
    results = None
    if scenario.results == "json":
        os.makedirs(os.path.dirname(where), exist_ok=True)
        results = where + ".json"
        cmd += ["--json", results]
    elif scenario.results:
        os.makedirs(where, exist_ok=True)
        results = os.path.join(where, scenario.results)
        cmd += ["--out", where]
    # The scripts import tsckpt from this checkout, and each other from this folder.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    print(f"$ {shlex.join(cmd)}", flush=True)
    return subprocess.run(cmd, env=env).returncode, results


def summary(scenario: Scenario, files: list[str], runs: list[dict[str, Any]], command: str) -> str:
    """The header (command, machine, each run's date and load average) and one table per store."""
    loaded = []
    for path in files:
        if os.path.isdir(path):
            path = os.path.join(path, scenario.results)
        with open(path) as f:
            loaded.append(json.load(f))
    runs = runs or [r.get("env", {}) for r in loaded]
    machine = next((r["machine"] for r in runs if r.get("machine")), "machine not recorded")
    lines = [f"## {scenario.name}: {len(loaded)} run{'s' * (len(loaded) != 1)}", "", f"`{command}`, on {machine}.", ""]
    for k, env in enumerate(runs, 1):
        lines.append(f"- run {k}: {env.get('date', 'date not recorded')}, load average "
                     f"{env.get('load_before', '?')} before, {env.get('load_after', '?')} after")
    lines += ["", ranges.HOW_TO_READ, ""]
    assert scenario.figures is not None
    tables = ranges.tables([scenario.figures(r) for r in loaded]) or [
        "(These runs timed no phase; each run's own report, beside its results file, holds what it measured.)"]
    return "\n".join(lines + tables)


def compare(scenario: Scenario, opts: argparse.Namespace, args: list[str], command: str) -> int:
    """``opts.runs`` runs of every part of ``scenario`` (itself, or the scenarios it is made of), then summaries."""
    parts = [(SCENARIOS[p], shlex.split(getattr(opts, p))) for p in scenario.parts] or [(scenario, args)]
    done: dict[str, tuple[list[str], list[dict[str, Any]]]] = {s.name: ([], []) for s, _ in parts}
    status = 0
    for k in range(1, opts.runs + 1):
        for part, part_args in parts:  # the parts of one run in turn, so that a slow hour bills each alike
            where = os.path.join(opts.out, *([part.name] if scenario.parts else []), f"run-{k}")
            env = harness.environment(command, [])
            status, results = run_once(part, part_args, where)
            env["load_after"] = harness.loadavg()
            if status:
                print(f"{part.name}, run {k}: the script exited with status {status}; stopping", flush=True)
                break
            done[part.name][0].append(results)
            done[part.name][1].append(env)
        if status:
            break
    texts = [summary(SCENARIOS[name], files, envs, command) for name, (files, envs) in done.items() if files]
    if texts:
        text = "\n\n".join(texts) + "\n"
        os.makedirs(opts.out, exist_ok=True)
        with open(os.path.join(opts.out, "summary.md"), "w") as f:
            f.write(text)
        print("\n" + text + f"\n(also in {os.path.join(opts.out, 'summary.md')})")
    return status


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\nScenarios:\n\n" + listing())
        return 0
    if argv[0] == "--list":
        print(listing())
        return 0
    scenario = SCENARIOS.get(argv[0])
    if scenario is None:
        print(f"unknown scenario {argv[0]!r}; python -m benchmarks --list names them", file=sys.stderr)
        return 2
    ap = options(scenario)
    opts, args = ap.parse_known_args(argv[1:])
    command = "python -m benchmarks " + shlex.join(argv)
    if opts.help:
        ap.print_help()
        for part in scenario.parts or [scenario.name]:
            print(f"\nThe options of {SCENARIOS[part].script}:\n", flush=True)
            subprocess.run(script_command(SCENARIOS[part], ["--help"]))
        return 0
    if getattr(opts, "summarize", None):
        print(summary(scenario, opts.summarize, [], command))
        return 0
    if scenario.parts and args:
        ap.error(f"{scenario.name} takes its scenarios' options quoted: " +
                 ", ".join(f'--{p} "..."' for p in scenario.parts))
    if scenario.compares:
        if opts.runs < 1:
            ap.error("--runs must be at least 1")
        return compare(scenario, opts, args, command)
    return run_once(scenario, args)[0]


if __name__ == "__main__":
    sys.exit(main())
