"""Small things a new user meets in the first hour: wrapped output, step names, S3 sizes, run directories, exports."""

from __future__ import annotations

import inspect
import json
import os
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import tsckpt
import tsckpt.errors
from cli_run import one_line_error, run_cli
from tsckpt.errors import IncompleteCheckpointError

ROOT = Path(__file__).resolve().parent.parent
BUCKET = "tsckpt-newcomer"  # this module's bucket on the run's moto server (the s3 fixture, conftest.py)
LONG = "model.transformer.layers.11.self_attention.query_key_value.weight_for_a_long_name"


def test_diff_and_ls_written_to_a_file_are_not_wrapped(tmp_path):
    tsckpt.save({LONG: torch.zeros(4, 3), "lr": 0.1}, tmp_path / "a")
    tsckpt.save({LONG: torch.ones(4, 3), "lr": 0.2}, tmp_path / "b")
    result = run_cli("diff", str(tmp_path / "a"), str(tmp_path / "b"), env={"COLUMNS": "80"})
    assert result.returncode == 1, result.stderr
    rows = [line for line in result.stdout.splitlines() if LONG in line]
    assert len(rows) == 1 and "float32[4, 3]" in rows[0] and "1" in rows[0], result.stdout
    assert "2 of 2 entries differ" in result.stdout

    run = tmp_path / "run"
    name = "pretraining_with_a_long_experiment_name_and_a_date_2026_11_25_step_1000"
    tsckpt.save({"w": torch.ones(2)}, run / name)
    result = run_cli("ls", str(run), env={"COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stdout.splitlines() if name in line and "committed" in line], result.stdout


def test_a_step_is_the_integer_a_name_ends_with(tmp_path):
    for name in ("step_3", "step_4", "step_5_async", "step_6.old"):
        tsckpt.save({"w": torch.ones(2)}, tmp_path / name)
    assert tsckpt.latest(tmp_path) == str(tmp_path / "step_4")
    assert [e.name for e in tsckpt.steps.scan(tmp_path)] == ["step_3", "step_4"]
    assert tsckpt.prune(tmp_path, keep=1) == [str(tmp_path / "step_3")]
    assert sorted(os.listdir(tmp_path)) == ["step_4", "step_5_async", "step_6.old"]
    assert "ends with" in tsckpt.steps.__doc__ and "step_5_async" in tsckpt.steps.__doc__


def test_info_on_s3_says_why_it_shows_no_stored_bytes(s3):
    location = s3.location(BUCKET, "run/step_1")
    tsckpt.save({"w": torch.ones(4)}, location)
    result = run_cli("info", json.dumps(location), env={"COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if "bytes stored" in line)
    assert "?" not in row and "TensorStore lists an object store's keys without their sizes" in row, row


def test_loading_a_run_directory_names_its_newest_step_and_latest(tmp_path):
    run = tmp_path / "run"
    for step in (100, 200):
        tsckpt.save({"w": torch.full((2,), float(step))}, run / f"step_{step}")
    (run / "logs").mkdir()
    line = (f"{run} is a directory of step checkpoints, not a checkpoint: the newest committed one is "
            f"{run}/step_200, which tsckpt.latest({str(run)!r}) returns (`tsckpt latest {run}` in a shell)")
    with pytest.raises(IncompleteCheckpointError) as caught:
        tsckpt.load({"w": torch.zeros(2)}, str(run))
    assert str(caught.value) == line
    with pytest.raises(IncompleteCheckpointError) as caught:
        tsckpt.open(str(run))
    assert str(caught.value) == line
    assert one_line_error(run_cli("info", str(run))) == f"error: {line}"
    # A directory without steps inside is still called what it is.
    (tmp_path / "other" / "w").mkdir(parents=True)
    (tmp_path / "other" / "w" / "c.0").write_bytes(b"\0" * 16)
    with pytest.raises(tsckpt.TsckptError) as caught:
        tsckpt.open(str(tmp_path / "other"))
    assert "step checkpoints" not in str(caught.value)


def test_every_error_class_is_importable_from_tsckpt():
    classes = [obj for _, obj in inspect.getmembers(tsckpt.errors, inspect.isclass)
               if issubclass(obj, BaseException) and obj.__module__ == "tsckpt.errors"]
    assert tsckpt.errors.SaveFailedError in classes
    for cls in classes:
        assert getattr(tsckpt, cls.__name__) is cls and cls.__name__ in tsckpt.__all__, cls.__name__


def test_the_test_extra_installs_what_every_test_needs():
    with open(ROOT / "pyproject.toml", "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["test"]
    # Without it, test_dropin_args' check of DCP's ZStandard() extension always skipped.
    assert any(req.split(">")[0].split("=")[0].strip() == "zstandard" for req in extra), extra


def test_zarr_reads_bf16_once_tsckpt_is_imported(tmp_path):
    """What the zarr_dtypes docstring promises for zarr 3.1-3.4.0 (where "No Zarr data type found" comes from)."""
    import subprocess
    import textwrap

    path = str(tmp_path / "c")
    tsckpt.save({"h": torch.ones(4, dtype=torch.bfloat16)}, path, layout="plain")
    code = textwrap.dedent(f"""
        import importlib.metadata, sys, zarr
        from zarr.core.dtype import data_type_registry
        if "bfloat16" not in data_type_registry.contents:  # zarr < 3.4.1: entry points not loaded
            try:
                zarr.open_group({path!r}, mode="r")["h"][:]
            except ValueError as e:
                print("without:", e)
        import tsckpt
        print("with:", zarr.open_group({path!r}, mode="r")["h"][:].dtype)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "with: bfloat16"
    assert all("No Zarr data type found that matches 'bfloat16'" in line for line in lines[:-1]), lines
