"""The benchmark's pure parts: workload shapes, shard sizes, ratios, verdicts, tables, README update."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_dcp  # noqa: E402
import contenders  # noqa: E402
import dcp_ranks  # noqa: E402
import dcp_report  # noqa: E402
import workloads as wl  # noqa: E402


@pytest.mark.parametrize("gb, itemsize", [(1.0, 2), (1.0, 4), (0.25, 2), (4.0, 2)])
def test_tuned_workload_is_about_the_asked_size_and_shards_evenly(gb, itemsize):
    w = wl.Tuned.for_size(gb * 1e9, itemsize)
    assert 0.75 * gb * 1e9 <= wl.total_bytes(w, itemsize) <= 1.25 * gb * 1e9
    for name, shape in w.params().items():  # row-sharded over 4, column-sharded over 2
        assert shape[0] % 4 == 0 and shape[-1] % 2 == 0, name


@pytest.mark.parametrize("gb, itemsize", [(1.0, 2), (0.25, 2), (0.5, 4)])
def test_untuned_workload_has_the_shapes_nobody_tuned_for(gb, itemsize):
    w = wl.Untuned.for_size(gb * 1e9, itemsize)
    params = w.params()
    assert 0.6 * gb * 1e9 <= wl.total_bytes(w, itemsize) <= 1.4 * gb * 1e9
    assert params["tok_embeddings.weight"][0] == 50257 and 50257 % 4 and 50257 % 2
    kv = params["layers.0.attention.wk.weight"]
    assert kv[0] * 8 == kv[1] == w.hidden  # grouped-query k/v: an eighth of the hidden size
    assert w.ffn % 4, "the MLP width should not divide by the world size"
    assert sum(len(s) == 1 for s in params.values()) >= 5 * w.layers  # norms and biases
    assert wl.Untuned.moments == ("momentum_buffer",)


def test_workload_round_trips_through_dict():
    for w in (wl.Tuned(256, 1024, 8192, 2), wl.Untuned(512, 1365, 64, 50257, 8), wl.Small(150, 64, 64)):
        assert wl.from_dict(wl.to_dict(w)) == w


@pytest.mark.parametrize("n, ranks", [(50257, 4), (1365, 4), (3, 4), (10, 4), (8, 2)])
def test_local_shapes_follow_torch_chunk(n, ranks):
    chunks = [len(c) for c in torch.arange(n).chunk(ranks)]
    chunks += [0] * (ranks - len(chunks))  # torch.chunk drops empty trailing pieces; DTensor keeps them
    assert [wl.local_shape((n, 7), 0, ranks, r)[0] for r in range(ranks)] == chunks
    assert wl.shard_dim((n,), column=True) == 0 and wl.shard_dim((n, 7), column=True) == 1


def test_rotation_changes_who_goes_first():
    assert [dcp_ranks.rotated([1, 2, 3], r)[0] for r in range(4)] == [1, 2, 3, 1]
    assert dcp_ranks.rotated([], 3) == []


def test_layout_check_accepts_plain_and_refuses_unknown():
    assert contenders.layout_options("plain") is not None
    assert contenders.layout_options("no-such-layout") is None
    assert contenders.supported_layouts(["plain", "no-such-layout"]) == (["plain"], ["no-such-layout"])


def test_the_unsynced_pair_joins_when_asked_and_torch_checkpointing_does_not_reshard():
    cfg = {"dcp_threads": [1], "layouts": ["packed"], "variants": [{"sync_files": False}]}
    alone = [c.name for c in contenders.contenders(cfg, raw=True)]
    assert alone == ["raw", "dcp-t1", "tsckpt-dcp/packed", "tsckpt/packed", "tsckpt/packed[sync_files=False]"]
    # No package is needed to list it: torch_checkpointing is imported at the first save or load.
    everyone = contenders.contenders(cfg | {"unsynced": True, "peers": [contenders.TORCH_CHECKPOINTING]}, raw=False)
    assert [c.name for c in everyone] == [*alone[1:], "torch-checkpointing"]
    by_name = {c.name: c for c in everyone}
    assert not by_name["torch-checkpointing"].reshards and by_name["tsckpt/packed"].reshards
    assert by_name["tsckpt/packed[sync_files=False]"].async_save is None  # the async figures are until durable


def test_bench_dcp_asks_for_the_unsynced_pair_unless_told_not_to():
    assert bench_dcp.parse_args([]).peers == ["torch-checkpointing"]
    assert bench_dcp.parse_args(["--no-unsynced"]).peers == []


def test_a_peer_whose_package_is_missing_is_skipped_with_a_note(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(contenders.OPTIONAL, contenders.TORCH_CHECKPOINTING,
                        ("no_such_module_anywhere", "torch-checkpointing==0.1.1"))
    bench_dcp.main(["--phases", "", "--layouts", "packed", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "note: torch-checkpointing==0.1.1 is not installed (pip install 'torch-checkpointing==0.1.1', or the " \
           "bench extra); skipping torch-checkpointing" in out
    assert "torch-checkpointing, sync saver not measured: torch-checkpointing==0.1.1 is not installed" in out
    assert "not measured" in (tmp_path / "results.md").read_text()


def test_quick_mode_is_small_and_dcp_default_comes_first():
    args = bench_dcp.parse_args(["--quick", "--layouts", "plain,packed"])
    assert args.reps == 1 and args.size_gb < 0.05 and args.layouts == ["plain", "packed"]
    with pytest.raises(SystemExit):
        bench_dcp.parse_args(["--dcp-threads", "4,1"])


def _samples() -> dict:
    return {
        "tsckpt/plain": {"save": [1.0, 2.0, 1.0], "load": [1.0, 1.0, 1.0], "reshard_fewer": [0.5, 0.5, 0.5]},
        "tsckpt-dcp/plain": {"save": [2.0, 2.0, 2.0], "load": [2.0, 2.0, 2.0]},
        "dcp-t1": {"save": [2.0, 2.0, 4.0], "load": [1.1, 1.3, 1.2], "reshard_fewer": [1.5, 1.0, 2.0]},
        "raw": {"save": [0.8, 0.8, 0.8], "load": [0.9, 0.9, 0.9]},
    }


def test_speedup_is_ratio_of_medians_with_per_repetition_range():
    s = _samples()
    median, low, high = dcp_report.speedup(s, "save", "tsckpt/plain")
    assert median == pytest.approx(2.0) and low == pytest.approx(1.0) and high == pytest.approx(4.0)
    assert dcp_report.speedup(s, "load", "tsckpt-dcp/plain")[0] == pytest.approx(0.6)
    assert dcp_report.speedup(s, "reshard_same", "tsckpt/plain") is None
    assert dcp_report.speedup(s, "save", "tsckpt/plain", other="raw")[0] == pytest.approx(0.8)


def _results(**env: object) -> dict:
    run = {"workload": "untuned", "dtype": "bf16", "describe": "d", "bytes": 10**9, "world": 4, "reshard_world": 2,
           "samples": _samples(), "memory": {"tsckpt/plain": 10**6}, "files": {"tsckpt/plain": 9, "dcp-t1": 5},
           "local_bytes": 10**8, "evict": "drop_caches"}
    loads = {"column:2": {"dcp-t1": {"seconds": 1.0, "needed": [50, 50], "rchar": [100, 150], "read_bytes": [50, 50]},
                          "tsckpt/plain": {"seconds": 0.5, "needed": [50, 50], "rchar": [50, 60],
                                           "read_bytes": [50, 55]}},
             "replicated:2": {"tsckpt/plain": {"seconds": 0.5, "needed": [100, 100], "rchar": [100, 101],
                                               "read_bytes": [100, 0]}}}
    many = {"ranks": 16, "describe": "150 matrices", "bytes": 10**7, "cpus": 2, "evict": "drop_caches",
            "samples": {"dcp-t1": {"save": [4.0], "load": [2.0]}, "tsckpt/plain": {"save": [2.0], "load": [4.0]}},
            "files": {"dcp-t1": 17, "tsckpt/plain": 3000}}
    return {"env": {"date": "2026-01-01 00:00 UTC", "machine": "2 CPUs", "command": "python benchmarks/bench_dcp.py",
                    "reps": 3, "load_before": "1.0", "load_after": "2.0", "complete": True, **env},
            "layouts": {"run": ["plain"], "skipped": ["packed"]}, "runs": [run],
            "fetched": {"world": 4, "reshards": ["column:2", "replicated:2"], "disk": {"bytes": 10**8, "loads": loads}},
            "many": [many]}


def test_markdown_reports_ratios_verdicts_bytes_and_ranks():
    text = dcp_report.markdown(_results())
    assert "`python benchmarks/bench_dcp.py`" in text and "2 CPUs" in text and "Partial" not in text
    assert "not accept them): packed" in text
    assert "| save, 4 ranks, row-sharded | **2.00x** (1.00-4.00) | **1.00x** (1.00-2.00) |" in text
    assert "load column-sharded, 4 -> 2 ranks" in text and "4 -> 4 ranks" not in text
    assert "- tsckpt.save/load, plain: save 2.00x (>= 1.0x met); load 1.20x (>= 1.0x met)" in text
    assert "save 1.00x (>= 1.0x met); load 0.60x (>= 1.0x missed)" in text
    # rchar / needed on disk: summed over ranks, then the rank that fetched the most for its needs
    assert "| column-sharded, 4 -> 2 ranks | DCP FileSystemWriter/Reader (default) | 0.0 MB | 0.0 MB | **2.50** | " \
           "**3.00** | 1.00 | 1.000 |" in text
    assert "| **1.10** | **1.20** | 1.05 |" in text and "| **1.00** (2.01 copies) | **1.01** |" in text
    assert "| 16 | tsckpt.save/load, plain | 2.000 s | 4.000 s | 3000 | **2.00x** | **0.50x** |" in text
    assert "drop_caches" in text


def _unsynced_results() -> dict:
    results = _results()
    samples = results["runs"][0]["samples"]
    samples["tsckpt/plain[sync_files=False]"] = {"save": [0.5, 0.5, 0.5], "load": [1.0, 1.0, 1.0],
                                                "reshard_fewer": [0.5, 0.5, 0.5]}
    samples["torch-checkpointing"] = {"save": [1.0, 1.0, 1.0], "load": [0.5, 0.5, 0.5]}
    many = results["many"][0]
    many["samples"] |= {"tsckpt/plain[sync_files=False]": {"save": [1.0], "load": [3.0]},
                        "torch-checkpointing": {"save": [3.0], "load": [1.5]}}
    many["files"]["torch-checkpointing"] = 48
    return results


def test_tsckpt_without_fsync_is_compared_with_torch_checkpointing_and_the_durable_with_dcp():
    text = dcp_report.markdown(_unsynced_results())
    assert "a power loss can lose or tear their checkpoints" in text
    assert "| tsckpt.save/load, plain[sync_files=False] over torch-checkpointing, sync saver |" in text
    # durable tsckpt over DCP's default as before; sync_files=False over torch-checkpointing
    assert "| save, 4 ranks, row-sharded | **2.00x** (1.00-4.00) | **1.00x** (1.00-2.00) | **2.00x** |" in text
    assert "| load, same 4 ranks | **1.20x** (1.10-1.30) | **0.60x** (0.55-0.65) | **0.50x** |" in text
    # no reshard of torch-checkpointing to compare with: a note, not a failure
    assert "| load column-sharded, 4 -> 2 ranks | **3.00x** (2.00-4.00) | - | - |" in text
    assert dcp_report.NO_RESHARD in text
    assert ("- tsckpt.save/load, plain[sync_files=False] over torch-checkpointing, sync saver (no target): "
            "save 2.00x; load 0.50x") in text
    assert "| 16 | torch-checkpointing, sync saver | 3.000 s | 1.500 s | 48 | - | - |" in text
    assert ("| 16 | tsckpt.save/load, plain[sync_files=False] over torch-checkpointing, sync saver | 1.000 s | "
            "3.000 s | - | **3.00x** | **0.50x** |") in text


def test_contenders_without_fsync_have_a_store_and_a_peer_of_their_own():
    results = _unsynced_results()
    by_row = {(f.store, f.phase, f.contender): f for f in dcp_report.figures(results)}
    tc, ours = "torch-checkpointing, sync saver", "tsckpt.save/load, plain[sync_files=False]"
    assert by_row["local disk, no fsync", "save, 4 ranks, row-sharded", tc].peer
    assert not by_row["local disk, no fsync", "save, 4 ranks, row-sharded", ours].peer
    assert not any(f.contender in (tc, ours) for f in by_row.values() if f.store == "local disk")
    plotted = {(r["contender"], r["phase"]): r for r in dcp_report.records(results)}
    assert plotted[ours, "save"]["speedup"] == {tc: pytest.approx(2.0)} and plotted[tc, "save"]["peer"]
    assert plotted["tsckpt.save/load, plain", "save"]["speedup"] == {
        "DCP FileSystemWriter/Reader (default)": pytest.approx(2.0)}


def test_markdown_labels_a_partial_run():
    assert "Partial run" in dcp_report.markdown(_results(complete=False))


def test_update_block_replaces_only_the_marked_block(tmp_path):
    page = tmp_path / "dcp.md"
    page.write_text(f"intro\n{dcp_report.BLOCK_BEGIN}\nold\n{dcp_report.BLOCK_END}\nrest\n")
    dcp_report.update_block(str(page), "new table\n")
    assert page.read_text() == f"intro\n{dcp_report.BLOCK_BEGIN}\nnew table\n{dcp_report.BLOCK_END}\nrest\n"
    (tmp_path / "other.md").write_text("no markers")
    with pytest.raises(SystemExit):
        dcp_report.update_block(str(tmp_path / "other.md"), "x")


def test_the_docs_page_holds_the_block_bench_dcp_rewrites():
    with open(dcp_report.DOCS_PAGE) as f:
        text = f.read()
    assert text.count(dcp_report.BLOCK_BEGIN) == 1
    assert text.index(dcp_report.BLOCK_BEGIN) < text.index(dcp_report.BLOCK_END)


def test_tuned_shapes_total_matches_three_copies():
    w = wl.Tuned(256, 1024, 8192, 2)
    assert wl.total_bytes(w, 2) == 3 * 2 * sum(math.prod(s) for s in w.params().values())
