"""``tsckpt ls / show / info`` on a real 4-rank checkpoint, and their error handling."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import zoo
from tsckpt.cli import app
from tsckpt.cli import inspect as _commands  # noqa: F401 - registers ls/show/info on app

runner = CliRunner()


def _run(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "200"})


def test_ls_shows_tree_shapes_dtypes_placements_and_totals(zoo_ckpt):
    res = _run("ls", zoo_ckpt)
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert any(line.strip("│ ").startswith("model/") for line in lines)
    mesh2d = next(line for line in lines if " mesh2d " in line)
    assert "[6, 8]" in mesh2d and "float32" in mesh2d and "192 B" in mesh2d
    assert "[Shard(0), Shard(1)] on mesh(dp=2, tp=2)" in mesh2d
    assert "ShardedTensor(5 shards)" in next(line for line in lines if " st " in line)
    assert "bfloat16" in next(line for line in lines if " bfloat16 " in line)
    assert "(0.9, 0.99)" in res.output
    assert "30 tensors" in res.output and "5 values; world size 4" in res.output


def test_show_prints_values_and_statistics(zoo_ckpt):
    res = _run("show", zoo_ckpt, "model.mesh2d", "0:4,2")
    assert res.exit_code == 0, res.output
    want = zoo.expected_all()["mesh2d"][0:4, 2].double().numpy()
    assert "shape [4] of [6, 8]" in res.output
    for stat in (want.min(), want.max(), want.mean(), want.std()):
        assert f"{stat:.6g}" in res.output
    res = _run("show", zoo_ckpt, "dtypes.bfloat16")
    assert res.exit_code == 0 and "shape [8, 3]" in res.output
    res = _run("show", zoo_ckpt, "extra.groups.0.betas")
    assert res.exit_code == 0 and res.output.strip() == "(0.9, 0.99)"


def test_info_shows_meshes_versions_files_and_bytes(zoo_ckpt):
    res = _run("info", zoo_ckpt)
    assert res.exit_code == 0, res.output
    out = res.output
    assert "world size     │ 4 " in out
    assert "cpu [2, 2] (dp, tp)" in out and "cpu [4]" in out
    assert "torch 2." in out and "tsckpt 0." in out
    files = [p for p in Path(zoo_ckpt).rglob("*") if p.is_file()]
    assert f"files          │ {len(files)} " in out
    assert f"({sum(p.stat().st_size for p in files)} B)" in out


@pytest.mark.parametrize("args, message", [
    (["show", "{ck}", "model.evn"], "did you mean 'model.even'"),
    (["show", "{ck}", "model.even", "0:2,x"], "cannot parse 'x'"),
    (["show", "{ck}", "model.even", "9"], "index 9 is out of range"),
    (["ls", "{missing}"], "no checkpoint at"),
    (["info", "{incomplete}"], "incomplete checkpoint"),
])
def test_errors_are_one_line_on_stderr_with_nonzero_exit(zoo_ckpt, tmp_path, args, message):
    incomplete = tmp_path / "incomplete"
    shutil.copytree(zoo_ckpt, incomplete)
    doc = json.loads((incomplete / "zarr.json").read_text())
    doc["attributes"] = {}
    (incomplete / "zarr.json").write_text(json.dumps(doc))
    argv = [a.format(ck=zoo_ckpt, missing=tmp_path / "missing", incomplete=incomplete) for a in args]
    # A real process: stderr separate from stdout, exit status as the shell sees it.
    res = subprocess.run([sys.executable, "-c", "from tsckpt.cli import main; main()", *argv],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "300"})
    assert res.returncode == 2  # ERROR, as for every command that cannot do its job
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res.stderr


def test_stats_cover_non_finite_and_complex_values():
    from tsckpt.cli.inspect import _stats

    s = _stats(np.array([1.0, np.nan, np.inf, 3.0], dtype=np.float32))
    assert s["min"] == "1" and s["max"] == "3" and s["nan"] == "1" and s["inf"] == "1"
    assert _stats(np.array([3 + 4j], dtype=np.complex64))["|max|"] == "5"
    assert _stats(np.zeros((0, 3)))["elements"] == "0"
