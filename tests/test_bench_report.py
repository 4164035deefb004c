"""The benchmark's pure parts: workload sizing, ratios, target verdicts, README update."""

from __future__ import annotations

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import dcp_ranks  # noqa: E402
import dcp_report  # noqa: E402


@pytest.mark.parametrize("gb, itemsize", [(1.0, 2), (1.0, 4), (0.2, 2), (4.0, 2)])
def test_workload_is_about_the_asked_size_and_shards_evenly(gb, itemsize):
    shapes = dcp_ranks.Shapes.for_size(gb * 1e9, itemsize)
    params = shapes.params()
    total = 3 * itemsize * sum(math.prod(s) for s in params.values())
    assert 0.75 * gb * 1e9 <= total <= 1.25 * gb * 1e9
    for name, shape in params.items():  # row-sharded over 4, column-sharded over 2
        assert shape[0] % 4 == 0 and shape[-1] % 2 == 0, name


def _run() -> dict:
    times = {
        "tsckpt": {"save": 1.0, "load": 1.0, "reshard": 1.0, "async_block": 0.1, "open": 0.01, "slice": 0.02},
        "dcp-t1": {"save": 2.0, "load": 1.1, "reshard": 1.5, "async_block": 0.5, "open": 0.02, "slice": 0.2},
        "dcp-t4": {"save": 1.2, "load": 1.3, "reshard": 2.5},
        "raw": {"save": 0.8, "load": 0.9},
        "staging copy": {"copy": 0.2},
    }
    return {"dtype": "bf16", "shapes": {"hidden": 256, "ffn": 1024, "vocab": 8192, "layers": 2},
            "bytes": 10**9, "times": times, "memory": {"tsckpt": 10**6}, "files": {"tsckpt": 9, "raw": 4},
            "local_bytes": 10**8, "evict": "fadvise", "dcp_default": "dcp-t1", "dcp_best": "dcp-t4",
            "variants": ["tsckpt"]}


def test_speedups_and_verdicts():
    run = _run()
    assert dcp_report.speedup(run, "save", "dcp_best") == pytest.approx(1.2)
    assert dcp_report.speedup(run, "load", "raw") == pytest.approx(0.9)
    text = dcp_report.markdown([run], {"args": {"size_gb": 1.0, "reps": 3, "world": 4}, "cpus": 2,
                                       "date": "2026-01-01 00:00"})
    assert "- save >= 1.3x DCP: 1.20x, missed" in text
    assert "- load >= 1.2x DCP: 1.30x, met" in text
    assert "- load into another topology >= 2x DCP: 2.50x, met" in text
    assert "- async_save blocks <= one staging copy: 0.100 s vs 0.200 s, met" in text
    assert "1.000 s, 1.00 GB/s" in text and "posix_fadvise" in text


def test_update_readme_replaces_only_the_marked_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{dcp_report.README_BEGIN}\nold\n{dcp_report.README_END}\nrest\n")
    dcp_report.update_readme(str(readme), "new table\n")
    assert readme.read_text() == f"intro\n{dcp_report.README_BEGIN}\nnew table\n{dcp_report.README_END}\nrest\n"
    (tmp_path / "other.md").write_text("no markers")
    with pytest.raises(SystemExit):
        dcp_report.update_readme(str(tmp_path / "other.md"), "x")
