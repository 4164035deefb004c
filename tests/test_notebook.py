"""The inspection notebook runs top to bottom on a fresh kernel."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "inspect_checkpoint.ipynb"


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
