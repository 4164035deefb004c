"""The main job end to end: ``tsckpt demo`` saves on 4 ranks and reloads on 2.

The end-to-end run is a real subprocess with real spawned gloo ranks; the
comparison it relies on is checked separately to fail on a single flipped bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import zarr

import tsckpt
from tsckpt import main_job as demo
from tsckpt.errors import TsckptError


# Six ranks' start-up and a 4-rank save: about 40 s here, over 300 s on a machine loaded 15 deep. The limit
# only stops a hang.
@pytest.mark.timeout(900)
def test_demo_saves_on_4_ranks_and_reloads_bit_exact_on_2(tmp_path):
    path = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from tsckpt.cli import main; sys.argv[0] = 'tsckpt'; main()",
         "demo", "--save-ranks", "4", "--load-ranks", "2", "--path", str(path)],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ok = [line for line in proc.stdout.splitlines() if line.startswith("OK: ")]
    assert len(ok) == 1 and ok[0].startswith("OK: reloaded on 2 ranks, all ") and ok[0].endswith(" tensors bit-exact")
    assert f"the checkpoint stays in {path}: `tsckpt ls {path}` lists it" in proc.stdout

    md = json.loads((path / "zarr.json").read_text())["attributes"]["tsckpt"]
    assert md["world_size"] == 4
    assert f"all {len(md['tensors'])} tensors" in ok[0]
    embed = md["tensors"]["model.embed.weight"]
    # FSDP2 splits 250 rows over 4 ranks as 63/63/63/61; each rank wrote its own chunks, bands of its rows.
    assert embed["chunk_shape"][0] == 63 and 128 % embed["chunk_shape"][1] == 0
    # Through tsckpt's store, which serves either layout (the demo saves in $TSCKPT_LAYOUT's).
    group = zarr.open_group(tsckpt.zarr_store(path), mode="r")
    assert group["model/embed.weight"].attrs["tsckpt"]["kind"] == "tensor"
    assert sorted(set(tsckpt.open(path)["model.embed.weight"].writers().values())) == [0, 1, 2, 3]
    assert f"layout {md.get('layout', 'plain')}; as zarr-python sees it:" in proc.stdout
    # A line per top-level group, not the hundred-odd of the whole tree: the outcome stays on one screen.
    assert "├── model/ 28 arrays, e.g. blocks.0.fc1.bias (512,) float32" in proc.stdout.splitlines()
    assert len(proc.stdout.splitlines()) <= 20, proc.stdout
    assert md["objects"]["step"] == {"key_path": ["step"], "encoding": "json", "value": demo.STEPS}
    moment = group["optim/state/embed.weight/exp_avg"]
    assert moment.shape == (demo.VOCAB, demo.DIM) and moment.dtype == np.float32
    assert np.any(moment[...] != 0)  # trained, not freshly initialised


def test_compare_catches_one_flipped_bit_and_changed_values():
    a = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    saved = {"w": a, "step": 3, "groups": [0.1]}
    assert demo._compare(saved, {"w": a.copy(), "step": 3, "groups": [0.1]}) == (1, [])

    flipped = a.copy()
    flipped.view(np.uint32)[1, 2] ^= 1  # last mantissa bit: equal within any tolerance, not bit-exact
    tensors, problems = demo._compare(saved, {"w": flipped, "step": 4, "groups": [0.1], "new": 1})
    assert tensors == 1
    assert any(p.startswith("w: 1 of 12 elements differ") for p in problems)
    assert "step: saved 3, reloaded 4" in problems
    assert "new: reloaded but never saved" in problems

    _, problems = demo._compare(saved, {"w": a.astype(np.float64), "step": 3})
    assert any(p.startswith("w: saved float32[3, 4], reloaded float64") for p in problems)
    assert "groups: saved but not reloaded" in problems


def test_demo_says_where_its_checkpoint_stays_and_how_to_remove_a_temporary_one(tmp_path):
    path, temporary = demo._prepare_path(None)
    try:
        assert temporary and os.path.basename(path) == "ckpt"
        line = demo.where_it_stays(path, temporary)
        assert line == (f"the checkpoint stays in {path}: `tsckpt ls {path}` lists it; it is in a temporary "
                        f"directory, `rm -r {os.path.dirname(path)}` removes it")
    finally:
        os.rmdir(os.path.dirname(path))
    mine, temporary = demo._prepare_path(str(tmp_path / "mine"))
    assert not temporary and demo.where_it_stays(mine, temporary).endswith("lists it")


def test_demo_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "keep.txt").write_text("not a checkpoint")
    with pytest.raises(TsckptError, match="is not empty"):
        demo.run(path=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
