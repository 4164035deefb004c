"""What a new user meets in the first hour: the set-up, the command line's messages, its help and listings."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import torch
from typer.testing import CliRunner

import tsckpt
from cli_run import one_line_error, run_cli
from tsckpt.cli import app
from tsckpt.cli.base import for_cli

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()


def _invoke(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "200"})


def test_convert_creates_the_parent_directory_or_refuses_in_one_line(tmp_path):
    torch.save({"w": torch.ones(3), "step": 5}, tmp_path / "a.pt")
    for dst in ("out/m.safetensors", "deep/er/m.pt", "ck/step_1"):
        res = _invoke("convert", str(tmp_path / "a.pt"), str(tmp_path / dst))
        assert res.exit_code == 0, res.output
        assert (tmp_path / dst).exists()
    (tmp_path / "blocker").write_text("a file where a directory should be")
    for dst in (tmp_path / "blocker" / "m.pt", tmp_path / "blocker" / "sub" / "m.pt"):
        line = one_line_error(run_cli("convert", str(tmp_path / "a.pt"), str(dst)))
        assert line == f"error: cannot create the directory {dst.parent} for {dst}: {tmp_path / 'blocker'} is a file"
    assert (tmp_path / "blocker").read_text().startswith("a file")


def test_convert_counts_what_it_wrote_after_saying_what_it_did_not(tmp_path):
    torch.save({"w": torch.ones(3), "step": 5, "name": "run"}, tmp_path / "a.pt")
    res = _invoke("convert", str(tmp_path / "a.pt"), str(tmp_path / "m.safetensors"))
    assert res.exit_code == 0, res.output
    assert "not written: name, step" in res.output
    assert "torch -> safetensors: 1 tensor, 0 values, " in res.output


def test_messages_name_command_line_flags_not_python_keywords(tmp_path):
    torch.save({"w": torch.ones(3)}, tmp_path / "a.pt")
    assert _invoke("convert", str(tmp_path / "a.pt"), str(tmp_path / "ck")).exit_code == 0
    again = _invoke("convert", str(tmp_path / "a.pt"), str(tmp_path / "ck"))
    assert again.exit_code == 2 and "--overwrite" in again.output and "overwrite=True" not in again.output
    again = _invoke("convert", str(tmp_path / "a.pt"), str(tmp_path / "ck"), "--overwrite")
    assert again.exit_code == 0, again.output
    assert for_cli("pass trust_pickle=True (--trust-pickle) only if you trust it") == (
        "pass --trust-pickle only if you trust it")
    assert for_cli("pass allow_pickle=True only if ...; allow_dtype_cast=True") == (
        "pass --allow-pickle only if ...; allow_dtype_cast=True")  # no flag for that one: left as it is


def test_help_shows_no_type_on_plain_flags():
    for command in ["ls", "info", "verify", "convert", "diff", "latest", "prune", "clean", "show", "demo"]:
        res = _invoke(command, "--help")
        assert res.exit_code == 0, res.output
        assert "<bool>" not in res.output, (command, res.output)
    assert "--overwrite" in _invoke("convert", "--help").output


def _steps_root(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    for step in (100, 200):
        tsckpt.save({"w": torch.ones(1000), "step": step}, root / f"step_{step}")
    dead = root / f".step_300.tsckpt-{'0' * 32}" / "w"  # the staging directory of a save that died
    dead.mkdir(parents=True)
    (dead / "c.0").write_bytes(b"x" * 10)
    (root / "config.yaml").write_text("lr: 0.1\n")
    (root / "logs").mkdir()
    return root


def test_ls_on_a_directory_of_steps_lists_the_steps(tmp_path):
    root = _steps_root(tmp_path)
    res = _invoke("ls", str(root))
    assert res.exit_code == 0, res.output
    rows = {line.split("│")[2].strip(): line for line in res.output.splitlines() if line.count("│") == 6}
    assert set(rows) == {"step_100", "step_200", "step_300"}
    assert "committed" in rows["step_200"] and "3.9 KiB" in rows["step_200"]
    assert re.search(r"20\d\d-\d\d-\d\dT", rows["step_200"])  # when it was created
    assert "incomplete" in rows["step_300"] and "10 B" in rows["step_300"]
    assert f"3 steps, 2 committed; the newest committed: {root / 'step_200'}" in res.output
    assert "did not finish" not in res.output
    doc = json.loads(_invoke("ls", str(root), "--json").output)
    assert [(s["name"], s["state"], s["nbytes"]) for s in doc["steps"]] == [
        ("step_100", "committed", 4000), ("step_200", "committed", 4000), ("step_300", "incomplete", 10)]


def test_a_directory_of_other_files_is_not_called_a_crashed_save(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "run3.txt").write_text("hello")
    line = one_line_error(run_cli("ls", str(tmp_path / "notes")))
    assert line == (f"error: no checkpoint at {tmp_path / 'notes'}: it holds 1 file(s) tsckpt did not write, "
                    f"e.g. 'run3.txt', and no committed metadata in zarr.json")


def test_the_readme_lists_every_command_and_how_to_install_what_its_commands_need():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Command line", 1)[1].split("\n\n", 2)[1]
    listed = set(re.findall(r"^\| `tsckpt (\w+)", table, re.M))
    registered = {c.name or c.callback.__name__ for c in app.registered_commands}
    assert registered - {"version"} <= listed, registered - listed
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(r.startswith("papermill") for r in extras["notebook"])
    notebook = json.loads((ROOT / "notebooks" / "inspect_checkpoint.ipynb").read_text())
    imports = "".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code")
    assert "matplotlib" in imports and any(r.startswith("matplotlib") for r in extras["notebook"])
    assert 'pip install -e ".[notebook]"' in readme and "papermill notebooks/inspect_checkpoint.ipynb" in readme
    storage = readme.split("## Object storage", 1)[1].split("\n## ", 1)[0]
    for setting in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", '"endpoint"', "AWS_ACCESS_KEY_ID", "AWS_PROFILE"):
        assert setting in storage, setting
