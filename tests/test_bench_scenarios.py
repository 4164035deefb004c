"""``python -m benchmarks``: the named scenarios, and the summary of several runs (range of medians, best peer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import ranges  # noqa: E402
from ranges import Figure  # noqa: E402
from scenarios import SCENARIOS  # noqa: E402


def _benchmarks(*args: str) -> subprocess.CompletedProcess:
    # No timeout of its own: `peers --help` starts two scripts that import torch, 95 s on a machine loaded 16
    # deep; the suite's per-test timeout is what stops a hang.
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, capture_output=True, text=True)


def test_list_names_every_scenario_on_a_line_of_its_own():
    done = _benchmarks("--list")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines] == list(SCENARIOS)
    for name in ("local", "s3", "cpu", "scale", "cuda", "peers"):
        assert name in SCENARIOS


def test_every_scenario_runs_a_script_that_exists_or_scenarios_that_do():
    for s in SCENARIOS.values():
        if s.parts:
            assert not s.script and all(SCENARIOS[p].figures for p in s.parts), s.name
        else:
            assert os.path.isfile(os.path.join(ROOT, "benchmarks", s.script)), s.name


def test_an_unknown_scenario_is_refused():
    done = _benchmarks("no-such-scenario")
    assert done.returncode == 2 and "--list" in done.stderr


def _run(dcp: float, ours: float, fast_peer: float | None = None) -> list[Figure]:
    out = [Figure("disk", "s", "save", "dcp", True, {"seconds": dcp}),
           Figure("disk", "s", "save", "tsckpt", False, {"seconds": ours, "requests": 3.0})]
    if fast_peer is not None:
        out.append(Figure("disk", "s", "save", "other", True, {"seconds": fast_peer}))
    return out


def test_ranges_are_of_the_runs_medians_and_ratios_against_the_best_peer_of_each_run():
    text = "\n".join(ranges.tables([_run(2.0, 1.0), _run(3.0, 1.5, fast_peer=1.2)]))
    assert "**disk**, 2 runs" in text
    assert "| state | phase | contender | seconds | speed-up over best peer | requests |" in text
    # run 1: 2.0 / 1.0; run 2: the other peer was faster, 1.2 / 1.5
    assert "| s | save | tsckpt | 1.00-1.50 | **0.80-2.00x** | 3.00 |" in text
    assert "| s | save | dcp | 2.00-3.00 | **0.40-1.00x** | - |" in text
    assert "| s | save | other | 1.20 | **1.00x** | - |" in text


def test_a_cpu_figure_is_a_share_of_the_best_peers():
    run = [Figure("disk", "s", "save", "dcp", True, {"CPU s / GB": 2.0}, share=True),
           Figure("disk", "s", "save", "tsckpt", False, {"CPU s / GB": 1.0}, share=True)]
    text = "\n".join(ranges.tables([run]))
    assert "x best peer's (below 1: less)" in text and "| s | save | tsckpt | 1.00 | **0.50x** |" in text


def test_summarize_reads_a_local_run_written_before(tmp_path):
    samples = {"dcp-t1": {"save": [2.0, 2.2, 1.8], "load": [1.0]},
               "tsckpt-dcp/packed": {"save": [1.0, 1.1, 0.9], "load": [0.5]},
               "tsckpt/packed[sync_files=False]": {"save": [0.5], "load": [0.5]},
               "torch-checkpointing": {"save": [0.4], "load": [0.25]}}
    run = {"workload": "untuned", "dtype": "bf16", "bytes": 10**9, "world": 4, "reshard_world": 2,
           "samples": samples}
    env = {"date": "2026-01-01 00:00 UTC", "machine": "2 CPUs", "load_before": "0.5", "load_after": "1.5"}
    paths = []
    for k, scale in enumerate((1.0, 2.0)):
        run_k = run | {"samples": {n: {f: [x * scale for x in xs] for f, xs in p.items()}
                                   for n, p in samples.items()}}
        path = tmp_path / f"run-{k}" / "results.json"
        path.parent.mkdir()
        path.write_text(json.dumps({"env": env, "runs": [run_k]}))
        paths.append(str(path.parent))
    done = _benchmarks("local", "--summarize", *paths)
    assert done.returncode == 0, done.stderr
    assert "## local: 2 runs" in done.stdout and "on 2 CPUs" in done.stdout
    assert "run 2: 2026-01-01 00:00 UTC, load average 0.5 before, 1.5 after" in done.stdout
    assert ("| untuned bf16, 1.00 GB | save, 4 ranks, row-sharded | tsckpt via dcp.save/load, packed | 1.00-2.00 "
            "| **2.00x** |") in done.stdout
    # Neither syncs: a table of their own, so the durable saves are never measured against a peer that skips fsync.
    assert "**local disk, no fsync**, 2 runs" in done.stdout
    assert ("| untuned bf16, 1.00 GB | load, same 4 ranks | tsckpt.save/load, packed[sync_files=False] | 0.500-1.00 "
            "| **0.50x** |") in done.stdout


@pytest.mark.parametrize("name", ["local", "peers", "open"])
def test_help_shows_this_commands_options_then_the_scripts(name):
    done = _benchmarks(name, "--help")
    assert done.returncode == 0, done.stderr
    assert f"python -m benchmarks {name}" in done.stdout and "The options of" in done.stdout
    assert ("--runs" in done.stdout) == SCENARIOS[name].compares
