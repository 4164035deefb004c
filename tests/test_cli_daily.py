"""The command line in daily use: ``--json``, ``--version``, ``ls`` piped or narrow, ``show`` on values and groups."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from rich.console import Console
from typer.testing import CliRunner

import tsckpt
from damage import write_key
import tsckpt.cli.inspect as inspect_cmds
import zoo
from tsckpt.cli import app

runner = CliRunner()
MESH2D = "[Shard(0), Shard(1)] on mesh(dp=2, tp=2)"


def cli(*args: str, columns: int = 80) -> subprocess.CompletedProcess:
    """The installed entry point in a real process, stdout a pipe (not a terminal)."""
    return subprocess.run([sys.executable, "-c", "from tsckpt.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": str(columns)})


def test_version():
    res = cli("--version")
    assert res.returncode == 0, res.stderr
    line = res.stdout.strip()
    # the distribution's version: torch.__version__ may add a local build tag such as +cu132
    assert line.startswith(f"tsckpt {tsckpt.__version__} (python ") and f"torch {metadata.version('torch')}" in line
    assert "tensorstore " in line and "zarr " in line and len(res.stdout.splitlines()) == 1


def test_ls_json(zoo_ckpt):
    res = runner.invoke(app, ["ls", zoo_ckpt, "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert set(doc) == {"location", "world_size", "tensors", "values", "totals", "reuse"}
    assert doc["reuse"] is None  # a full save
    assert doc["location"] == zoo_ckpt and doc["world_size"] == 4
    assert doc["totals"] == {"tensors": 30, "values": 5, "nbytes": sum(t["nbytes"] for t in doc["tensors"])}
    t = {e["key"]: e for e in doc["tensors"]}["model.mesh2d"]
    assert set(t) == {"key", "key_path", "path", "shape", "dtype", "nbytes", "chunk_shape", "inner_chunk_shape",
                      "placement", "placement_spec"}
    assert (t["key_path"], t["path"], t["shape"], t["dtype"], t["nbytes"]) == (
        ["model", "mesh2d"], "model/mesh2d", [6, 8], "float32", 192)
    assert t["placement"] == MESH2D
    assert t["placement_spec"]["placements"] == [{"type": "shard", "dim": 0}, {"type": "shard", "dim": 1}]
    values = {e["key"]: e for e in doc["values"]}
    assert values["extra.groups.0.betas"] == {"key": "extra.groups.0.betas", "key_path": ["extra", "groups", 0,
                                              "betas"], "encoding": "json", "value": [0.9, 0.99]}
    assert values["extra.name"]["value"] == "run-1"


def test_info_json(zoo_ckpt):
    res = runner.invoke(app, ["info", zoo_ckpt, "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    files = [p for p in Path(zoo_ckpt).rglob("*") if p.is_file()]
    assert doc["files"] == len(files) and doc["bytes_stored"] == sum(p.stat().st_size for p in files)
    assert doc["world_size"] == 4 and doc["tensors"] == 30 and doc["values"] == 5
    assert {"shape": [2, 2], "dim_names": ["dp", "tp"], "device_type": "cpu", "ranks": [0, 1, 2, 3]} in doc["meshes"]
    assert doc["torch_version"].startswith("2.") and doc["format_version"] >= 1
    assert set(doc) == {"location", "format_version", "tsckpt_version", "torch_version", "created", "world_size",
                        "meshes", "tensors", "tensor_nbytes", "values", "layout", "files", "bytes_stored",
                        "content_hash", "reuse"}
    assert doc["content_hash"] == "xxh3_128_stored" and doc["reuse"] is None


def test_verify_json_reports_damage_per_entry(zoo_ckpt, tmp_path):
    res = runner.invoke(app, ["verify", zoo_ckpt, "--json"])
    doc = json.loads(res.stdout)
    assert res.exit_code == 0 and doc["ok"] and doc["failed"] == 0
    assert doc["arrays"] == len(doc["entries"]) >= 30 and doc["chunks"] == sum(e["chunks"] for e in doc["entries"])
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(zoo_ckpt, damaged)
    write_key(damaged, "model/even/c.1.0", None)  # a file, or a key of the packed database
    res = runner.invoke(app, ["verify", str(damaged), "--json"])
    doc = json.loads(res.stdout)
    assert res.exit_code == 1 and not doc["ok"] and doc["failed"] == 1
    bad = [e for e in doc["entries"] if e["problems"]]
    assert [e["key"] for e in bad] == ["model.even"] and "c.1.0" in " ".join(bad[0]["problems"])


def test_ls_piped_in_80_columns_keeps_every_column(zoo_ckpt):
    res = cli("ls", zoo_ckpt, columns=80)
    assert res.returncode == 0, res.stderr
    assert "…" not in res.stdout
    row = next(line for line in res.stdout.splitlines() if " mesh2d " in line)
    assert "[6, 8]" in row and "float32" in row and "192 B" in row and MESH2D in row
    assert "ShardedTensor(5 shards)" in next(line for line in res.stdout.splitlines() if " st " in line)


def test_ls_in_an_80_column_terminal_folds_instead_of_cutting(zoo_ckpt, monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(inspect_cmds, "out", Console(file=buf, force_terminal=True, width=80, color_system=None))
    assert runner.invoke(app, ["ls", zoo_ckpt]).exit_code == 0
    text = buf.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    placement_cells = [line.split("│")[-2].strip() for line in text.splitlines() if line.count("│") == 6]
    assert MESH2D in " ".join(placement_cells)


def test_show_slices_plain_values_and_takes_negative_indices(zoo_ckpt):
    def show(*args: str) -> str:
        res = runner.invoke(app, ["show", zoo_ckpt, *args])
        assert res.exit_code == 0, res.output
        return res.stdout.strip()

    assert show("extra.groups.0.betas", "-1") == "0.99"
    assert show("extra.groups.0.betas", "0:1") == "(0.9,)"
    assert show("extra.name", "-1") == "'1'" and show("extra.name", ":3") == "'run'"
    assert show("extra.groups.0.params", "::-1") == "[1, 0]"
    last_row = show("model.mesh2d", "-1")
    assert "model.mesh2d[-1]  shape [8] of [6, 8]" in last_row
    want = zoo.expected_all()["mesh2d"]
    assert f"{want[-1].double().max().item():.6g}" in last_row
    corner = show("model.mesh2d", "-2:,-1")
    assert "shape [2] of [6, 8]" in corner and f"{want[-2:, -1].double().mean().item():.6g}" in corner
    for args, message in [(["extra.lr", "0"], "cannot apply [0] to a value of type float"),
                          (["extra.groups.0.betas", "5"], "index 5 is out of range for a tuple of length 2"),
                          (["extra.name", "0,0"], "2 indices for a string")]:
        res = runner.invoke(app, ["show", zoo_ckpt, *args])
        assert res.exit_code == 2 and message in res.output, res.output
    typo = runner.invoke(app, ["show", zoo_ckpt, "extra.lr", "--alow-pickle"])
    assert typo.exit_code == 2 and "no such option: --alow-pickle" in typo.output


def test_show_on_a_group_lists_what_is_under_it(zoo_ckpt):
    res = runner.invoke(app, ["show", zoo_ckpt, "extra"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("extra is a group of 5 entries:")
    for key in ("lr", "name", "betas", "params"):
        assert f" {key} " in res.stdout
    assert "(0.9, 0.99)" in res.stdout and "world size" not in res.stdout
    res = runner.invoke(app, ["show", zoo_ckpt, "model/"])
    assert res.exit_code == 0 and MESH2D in res.stdout
    assert "extra" not in res.stdout and "dtypes" not in res.stdout
    res = runner.invoke(app, ["show", zoo_ckpt, "extra.groups"])
    assert res.stdout.startswith("extra.groups is a group of 3 entries:")
    res = runner.invoke(app, ["show", zoo_ckpt, "mod"])  # a prefix of a name is not a group
    assert res.exit_code == 2 and "no key 'mod'" in res.output
