"""The inspection notebook runs top to bottom on a fresh kernel."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
import torch
from nbclient import NotebookClient

import tsckpt

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "inspect_checkpoint.ipynb"


@pytest.fixture(autouse=True)
def kernel_imports_this_checkout(monkeypatch):
    """The kernel starts in a temporary directory: point it at the tsckpt under test, not an installed one."""
    root = str(Path(tsckpt.__file__).resolve().parent.parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))


def test_inspect_notebook_executes(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "world_size=4" in text and "[Shard(0), Shard(1)] on mesh(dp=2, tp=2)" in text
    assert "values: {'step': 1000, 'lr': 0.0003}" in text
    assert "bfloat16 (100, 32) (25, 32)" in text  # zarr-python read the bf16 array
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 2  # the chunk grid drawing and the histogram


def test_committed_notebook_has_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code)
    assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs)


@pytest.mark.parametrize("how, layout", [("parameter", "plain"), ("environment", "packed")])
def test_notebook_inspects_a_given_checkpoint(tmp_path, monkeypatch, how, layout):
    ckpt = tmp_path / "run" / "step_7"
    tsckpt.save({"net": {"proj": torch.linspace(0, 1, 60).reshape(12, 5), "b": torch.zeros(5)}, "epoch": 7}, ckpt,
                layout=layout)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    params = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    if how == "parameter":
        # What papermill does with `-p checkpoint PATH`: a cell right after the parameters cell.
        injected = nbformat.v4.new_code_cell(f"checkpoint = {str(ckpt)!r}")
        injected.metadata["tags"] = ["injected-parameters"]
        nb.cells.insert(params + 1, injected)
        monkeypatch.setenv("TSCKPT_NOTEBOOK_CHECKPOINT", str(tmp_path / "not-this-one"))
    else:
        monkeypatch.setenv("TSCKPT_NOTEBOOK_CHECKPOINT", str(ckpt))
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert f"inspecting {ckpt}" in text and "demo checkpoint" not in text
    assert "world_size=1" in text and "values: {'epoch': 7}" in text
    assert "TensorHandle('net.proj', shape=[12, 5]" in text  # the largest 2-D tensor is the one drawn
    assert "float32 (5,) (5,)" in text  # zarr-python read the second one
    assert len([o for o in outputs if "image/png" in o.get("data", {})]) == 2
    assert (ckpt / "zarr.json").is_file()  # the notebook removes only what it made itself
