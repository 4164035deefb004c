"""``tsckpt refs``: zarr-python and fsspec read a packed checkpoint through a reference file, without tsckpt.

The local reads run in a virtual environment holding only zarr, fsspec, numpy
and crc32c (the versions installed here); tsckpt cannot even be imported
there. Reads from the moto S3 server need s3fs, so they run in a fresh
interpreter of this environment that never imports tsckpt.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch
import zarr

import tsckpt
from cli_run import one_line_error, run_cli
from reading_scripts import REFUSAL

BUCKET = "tsckpt-refs"  # this module's bucket on the run's moto server (the s3 fixture, conftest.py)


def state() -> dict:
    g = torch.Generator().manual_seed(5)
    # zarr-python alone has no bfloat16: the bf16 tensor is in a group of its own, read only to see it refused.
    return {"model": {"w": torch.randn(200, 64, generator=g), "b": torch.randn(64, generator=g)},
            "half": {"x": torch.randn(8, 8, generator=g).bfloat16()}, "step": torch.tensor(3)}


def environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without a PYTHONPATH that could lead to the checkout."""
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **(extra or {})}


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> str:
    """The interpreter of a virtual environment with zarr, fsspec, numpy and crc32c, and no tsckpt."""
    venv = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    wanted = [f"zarr=={zarr.__version__}", f"fsspec=={fsspec.__version__}", "numpy", "crc32c"]
    done = subprocess.run([python, "-m", "pip", "install", "-q", *wanted], capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        pytest.skip(f"cannot install {' '.join(wanted)} into a virtual environment: {done.stderr[-600:]}")
    gone = subprocess.run([python, "-c", "import tsckpt"], capture_output=True, text=True, timeout=60,
                          cwd=venv, env=environment())
    assert "No module named 'tsckpt'" in gone.stderr
    return python


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("refs") / "step_1000"
    tsckpt.save(state(), str(path), layout="packed", inner_chunk_bytes=4096)
    return path


def write_refs(location: str, out: Path, env: dict[str, str] | None = None) -> str:
    """``tsckpt refs LOCATION -o OUT``; returns the line it prints to paste."""
    done = run_cli("refs", location, "-o", str(out), env=env)
    assert done.returncode == 0, done.stderr
    assert out.is_file()
    lines = done.stdout.strip().splitlines()
    assert lines[0] == f"wrote {out}; with only zarr and fsspec installed:"
    return lines[1]


READER = r'''
import json, sys
import numpy as np, zarr
args = json.loads(sys.argv[1])
scope = {"zarr": zarr}
exec(args["line"], scope)
g = scope["g"]
out = {"groups": sorted(g.keys()), "model": sorted(g["model"].keys())}
''' + REFUSAL + r'''
if args["damaged"]:
    out["damaged"] = refusal(lambda: g["model/w"][:])
else:
    out["same"] = bool(np.array_equal(g["model/w"][:], np.load(args["expected"])))
    out["bf16"] = refusal(lambda: g["half/x"])
out["tsckpt_imported"] = "tsckpt" in sys.modules
print(json.dumps(out))
'''


def read(python: str, line: str, tmp_path: Path, damaged: bool = False, env: dict[str, str] | None = None) -> dict:
    expected = tmp_path / "w.npy"
    np.save(expected, state()["model"]["w"].numpy())
    args = {"line": line, "expected": str(expected), "damaged": damaged}
    done = subprocess.run([python, "-c", READER, json.dumps(args)], capture_output=True, text=True, cwd=tmp_path,
                          timeout=240, env=environment(env))
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_zarr_and_fsspec_alone_read_a_packed_checkpoint_through_its_reference_file(bare_python, packed, tmp_path):
    line = write_refs(str(packed), tmp_path / "step_1000.refs.json")
    assert line == (f'g = zarr.open_group("reference://step_1000", '
                    f'storage_options={{\'fo\': \'{tmp_path / "step_1000.refs.json"}\'}}, mode="r")')
    out = read(bare_python, line, tmp_path)
    assert out["groups"] == ["half", "model", "step"] and out["model"] == ["b", "w"] and out["same"]
    assert out["bf16"] == "ValueError: No Zarr data type found that matches 'bfloat16'"


def test_zarrs_crc32c_codec_refuses_a_flipped_byte_read_through_the_references(bare_python, packed, tmp_path):
    copy = tmp_path / "copy" / "step_1000"
    shutil.copytree(packed, copy)
    rows = state()["model"]["w"].numpy()[0, :8].tobytes()  # the start of the first inner chunk
    [data] = [p for p in (copy / "d").iterdir() if rows in p.read_bytes()]
    raw = bytearray(data.read_bytes())
    raw[raw.find(rows) + 9] ^= 0x04
    data.write_bytes(bytes(raw))
    line = write_refs(str(copy), tmp_path / "damaged.json")
    out = read(bare_python, line, tmp_path, damaged=True)
    assert out["damaged"].startswith("ValueError: Stored and computed checksum do not match")


def test_a_moved_checkpoint_is_read_with_the_template_overridden(bare_python, packed, tmp_path):
    here, moved = tmp_path / "here" / "step_1000", tmp_path / "elsewhere" / "step_1000"
    shutil.copytree(packed, here)
    refs = tmp_path / "refs.json"
    write_refs(str(here), refs)
    doc = json.loads(refs.read_text())
    assert doc["templates"] == {"u": str(here)}
    assert all(not isinstance(v, list) or v[0].startswith("{{u}}/d/") for v in doc["refs"].values())
    shutil.move(here, moved)
    line = (f'g = zarr.open_group("reference://step_1000", mode="r", storage_options='
            f'{{"fo": {str(refs)!r}, "template_overrides": {{"u": {str(moved)!r}}}}})')
    assert read(bare_python, line, tmp_path)["same"]


def test_on_s3_fsspecs_target_filesystem_must_be_asynchronous(s3, tmp_path):
    location = f"s3://{BUCKET}/run/step_2"
    tsckpt.save(state(), s3.location(BUCKET, "run/step_2"), layout="packed")
    env = {"AWS_ENDPOINT_URL": s3.endpoint, "AWS_REGION": "us-east-1"}
    line = write_refs(location, tmp_path / "step_2.json", env=env)
    assert "'remote_options': {'asynchronous': True}" in line and '"reference://step_2"' in line
    out = read(sys.executable, line, tmp_path, env=env)
    assert out["same"] and out["model"] == ["b", "w"]
    # zarr 3.4 loads the installed packages' data-type entry points (tsckpt's among them) when it resolves a
    # dtype, so only an older zarr reads this without importing tsckpt here; the virtualenv test above reads
    # with no tsckpt installed at all.
    if tuple(int(p) for p in zarr.__version__.split(".")[:2]) < (3, 4):
        assert not out["tsckpt_imported"]
    # What zarr-python issues #2946 and #3323 report: a target filesystem that is not asynchronous is refused.
    without = line.replace("'remote_options': {'asynchronous': True}", "'remote_options': {}")
    done = subprocess.run([sys.executable, "-c", READER, json.dumps({"line": without, "damaged": False})],
                          capture_output=True, text=True, cwd=tmp_path, timeout=240, env=environment(env))
    assert "Reference-FS's target filesystem must have same value of asynchronous" in done.stderr


def test_a_plain_checkpoint_is_refused_with_the_call_that_opens_it(tmp_path):
    path = tmp_path / "plain"
    tsckpt.save({"w": torch.ones(3)}, str(path), layout="plain")
    line = one_line_error(run_cli("refs", str(path), "-o", str(tmp_path / "x.json")))
    assert line == (f'error: {path} is in the plain layout: zarr-python opens it by path '
                    f'(zarr.open_group("{path}", mode="r")); references are for the packed layout')
    assert not (tmp_path / "x.json").exists()
