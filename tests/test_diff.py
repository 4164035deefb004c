"""``tsckpt.diff`` and ``tsckpt diff``: real files of several formats compared key by key."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from typer.testing import CliRunner

import tsckpt
import tsckpt.cli.convert  # noqa: F401  (registers the commands)
from tsckpt.cli import app
from tsckpt import convert, diff

runner = CliRunner()


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(6, 4, generator=g),
        "bf": torch.randn(8, generator=g).bfloat16(),
        "gone": torch.ones(3),
        "retyped": torch.arange(4, dtype=torch.int32),
        "reshaped": torch.zeros(2, 3),
        "nan": torch.tensor([1.0, math.nan]),
    }


def test_identical_checkpoints_in_different_formats(tmp_path):
    save_file(tensors(), tmp_path / "a.safetensors")
    convert(tmp_path / "a.safetensors", tmp_path / "ts")
    result = tsckpt.diff(tmp_path / "a.safetensors", tmp_path / "ts")
    assert result.identical and len(result.entries) == 6
    assert (result.format_a, result.format_b) == ("safetensors", "tsckpt")
    out = CliRunner().invoke(app, ["diff", str(tmp_path / "a.safetensors"), str(tmp_path / "ts")])
    assert out.exit_code == 0, out.output
    assert "identical" in out.output


def test_modified_checkpoint_reports_every_kind_of_change(tmp_path):
    a = tensors()
    b = {k: v.clone() for k, v in a.items() if k != "gone"}
    b["w"][2, 1] += 0.5
    b["bf"] = (b["bf"].view(torch.int16) ^ 1).view(torch.bfloat16)  # one mantissa bit of every element
    b["retyped"] = b["retyped"].to(torch.int64)
    b["reshaped"] = torch.zeros(3, 2)
    b["new"] = torch.ones(1)
    save_file(a, tmp_path / "a.safetensors")
    torch.save(b, tmp_path / "b.pt")
    result = diff(tmp_path / "a.safetensors", tmp_path / "b.pt")
    by_key = {e.key: e for e in result.entries}
    assert not result.identical
    assert {k: e.status for k, e in by_key.items()} == {
        "w": "values", "bf": "values", "gone": "only_a", "retyped": "dtype", "reshaped": "shape",
        "nan": "equal", "new": "only_b"}
    assert by_key["w"].max_abs_diff == pytest.approx(0.5, abs=1e-6)
    assert by_key["bf"].max_abs_diff > 0
    assert by_key["retyped"].max_abs_diff == 0  # same numbers, wider type
    assert (by_key["reshaped"].shape_a, by_key["reshaped"].shape_b) == ((2, 3), (3, 2))
    out = CliRunner().invoke(app, ["diff", str(tmp_path / "a.safetensors"), str(tmp_path / "b.pt")])
    assert out.exit_code == 1, out.output
    for key in ("gone", "retyped", "reshaped", "new"):
        assert key in out.output
    assert "6 of 7 entries differ" in out.output


def test_values_and_nesting_compare_by_dotted_name(tmp_path):
    sd = {"model": {"w": torch.ones(2)}, "step": 10}
    torch.save(sd, tmp_path / "a.pt")
    torch.save({"model": {"w": torch.ones(2)}, "step": 11}, tmp_path / "b.pt")
    save_file({"model.w": torch.ones(2)}, tmp_path / "c.safetensors")
    changed = diff(tmp_path / "a.pt", tmp_path / "b.pt")
    assert [(e.key, e.status, e.kind) for e in changed.differences] == [("step", "values", "object")]
    flat = diff(tmp_path / "a.pt", tmp_path / "c.safetensors")
    assert [(e.key, e.status) for e in flat.differences] == [("step", "only_a")]


def test_dcp_directory_needs_trust_pickle(tmp_path):
    dcp.save({"w": torch.arange(4.0)}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "d")))
    save_file({"w": torch.arange(4.0)}, tmp_path / "w.safetensors")
    runner = CliRunner()
    refused = runner.invoke(app, ["diff", str(tmp_path / "d"), str(tmp_path / "w.safetensors")])
    assert refused.exit_code == 2 and "--trust-pickle" in refused.output
    trusted = runner.invoke(app, ["diff", str(tmp_path / "d"), str(tmp_path / "w.safetensors"), "--trust-pickle"])
    assert trusted.exit_code == 0, trusted.output


def test_diff_shows_plain_values_and_applies_tolerances(tmp_path):
    w = torch.linspace(-1, 1, 50)
    a = {"w": w, "nan": torch.tensor([1.0, float("nan")]), "step": 10, "name": "[red]run", "gone": [1, 2]}
    b = {"w": w * (1 + 1e-5), "nan": torch.tensor([1.0, float("nan")]), "step": 11, "name": "[red]run"}
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    res = runner.invoke(app, ["diff", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--all"],
                        env={"COLUMNS": "200"})
    assert res.exit_code == 1
    rows = {line.split("│")[1].strip(): line for line in res.stdout.splitlines() if line.count("│") == 6}
    assert rows["step"].split("│")[3].strip() == "10" and rows["step"].split("│")[4].strip() == "11"
    assert "'[red]run'" in rows["name"] and "[1, 2]" in rows["gone"]
    assert "object" not in res.stdout

    def statuses(**tol) -> dict[str, str]:
        return {e.key: e.status for e in tsckpt.diff(tmp_path / "a.pt", tmp_path / "b.pt", **tol).entries}

    assert statuses()["w"] == "values"
    assert statuses(rtol=1e-4)["w"] == "close" and statuses(rtol=1e-6)["w"] == "values"
    assert statuses(atol=2e-5)["w"] == "close" and statuses(atol=1e-6)["w"] == "values"
    assert statuses(atol=1.0)["nan"] == "equal"
    result = tsckpt.diff(tmp_path / "a.pt", tmp_path / "b.pt", rtol=1e-4)
    assert [e.key for e in result.differences] == ["step", "gone"] and not result.identical
    with pytest.raises(tsckpt.TsckptError, match="non-negative"):
        tsckpt.diff(tmp_path / "a.pt", tmp_path / "b.pt", rtol=-1)

    torch.save({"w": w, "step": 10}, tmp_path / "c.pt")
    torch.save({"w": w + 1e-3, "step": 10}, tmp_path / "d.pt")
    c, d = str(tmp_path / "c.pt"), str(tmp_path / "d.pt")
    assert runner.invoke(app, ["diff", c, d]).exit_code == 1
    assert runner.invoke(app, ["diff", c, d, "--atol", "1e-4"]).exit_code == 1
    close = runner.invoke(app, ["diff", c, d, "--atol", "2e-3"], env={"COLUMNS": "200"})
    assert close.exit_code == 0, close.output
    assert "equal within tolerance: 2 entries, 1 close" in close.stdout
    assert runner.invoke(app, ["diff", c, d, "--rtol", "-1"]).exit_code == 2
    assert np.isclose(tsckpt.diff(c, d).entries[0].max_abs_diff, 1e-3, rtol=1e-2)


class Uncomparable:
    """A value whose ``==`` raises, as some third-party objects' do."""

    def __eq__(self, other):
        raise RuntimeError("cannot compare Uncomparable")


def test_values_compare_by_content_and_a_failed_comparison_is_an_error_not_a_difference(tmp_path):
    arrays = {"mask": np.arange(6).reshape(2, 3), "nested": {"t": torch.ones(2), "lst": [np.zeros(2), 1.5]},
              "loss": float("nan")}
    torch.save(arrays, tmp_path / "a.pt")
    torch.save({k: v for k, v in arrays.items()}, tmp_path / "b.pt")
    same = diff(tmp_path / "a.pt", tmp_path / "b.pt", trust_pickle=True)
    assert {e.key: e.status for e in same.entries} == {
        "mask": "equal", "nested.t": "equal", "nested.lst": "equal", "loss": "equal"}
    changed = dict(arrays, mask=np.arange(6).reshape(3, 2), nested={"t": torch.ones(2), "lst": [np.ones(2), 1.5]})
    torch.save(changed, tmp_path / "c.pt")
    assert {e.key for e in diff(tmp_path / "a.pt", tmp_path / "c.pt", trust_pickle=True).differences} == {
        "mask", "nested.lst"}

    torch.save({"odd": Uncomparable()}, tmp_path / "d.pt")
    torch.save({"odd": Uncomparable()}, tmp_path / "e.pt")
    with pytest.raises(tsckpt.TsckptError, match=r"cannot compare the values of 'odd'.*RuntimeError"):
        diff(tmp_path / "d.pt", tmp_path / "e.pt", trust_pickle=True)
    res = runner.invoke(app, ["diff", str(tmp_path / "d.pt"), str(tmp_path / "e.pt"), "--trust-pickle"])
    assert res.exit_code == 2 and "cannot compare the values of 'odd'" in res.output
