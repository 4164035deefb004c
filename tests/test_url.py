"""``tsckpt://`` URLs: zarr-python, xarray and dask open a checkpoint by URL, tsckpt installed but never imported.

The reading code runs in a fresh interpreter that never imports tsckpt: fsspec
finds the protocol through the ``fsspec.specs`` entry point when the first URL
is opened. Each call reads a checkpoint saved locally and on the moto S3
server, in both layouts, and refuses a copy with one byte of one chunk flipped.
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
import tensorstore as ts
import torch
import zarr
from typer.testing import CliRunner

import tsckpt
from tsckpt.cli import app, inspect  # noqa: F401 - inspect registers ls and info
from tsckpt.read.url import TsckptFileSystem, open_line
from tsckpt.storage.location import parse_location
from reading_scripts import REFUSAL

BUCKET = "tsckpt-url"  # this module's bucket on the run's moto server (the s3 fixture, conftest.py)
WQ = "layers.0.attn.wq.weight"
LAYOUTS = ["plain", "packed"]
INNER_BYTES = 4096


def state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"model": {WQ: torch.randn(256, 128, generator=g).bfloat16(),
                      "embed.weight": torch.randn(96, 16, generator=g)},
            "step": torch.tensor(7), "lr": 3e-4}


def raw(array: torch.Tensor) -> np.ndarray:
    return array.view(torch.int16).numpy() if array.dtype == torch.bfloat16 else array.numpy()


def first_inner_chunk(path_or_loc) -> tuple[int, int]:
    chunks = tsckpt.open(path_or_loc).tensors[f"model.{WQ}"].chunks
    return tuple(chunks.inner_chunk_shape or chunks.chunk_shape)


def flip_in(read, write, names, needle: bytes) -> str:
    """Flip one bit in the one stored value that holds ``needle``; returns its name."""
    found = [(name, data.find(needle), data) for name in names if (data := read(name)) is not None]
    hits = [(name, at, data) for name, at, data in found if at >= 0]
    assert len(hits) == 1, [name for name, *_ in hits]
    name, at, data = hits[0]
    damaged = bytearray(data)
    damaged[at + 5] ^= 0x10
    write(name, bytes(damaged))
    return name


def first_chunk_bytes(location) -> bytes:
    inner = first_inner_chunk(location)
    return np.ascontiguousarray(raw(state()["model"][WQ])[: inner[0], : inner[1]]).tobytes()


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """(good, damaged) local checkpoints by layout."""
    base = tmp_path_factory.mktemp("url")
    out = {}
    for layout in LAYOUTS:
        good, bad = base / layout / "step_1000", base / f"{layout}-damaged" / "step_1000"
        tsckpt.save(state(), str(good), layout=layout, inner_chunk_bytes=INNER_BYTES)
        shutil.copytree(good, bad)
        files = [str(p) for p in bad.rglob("*") if p.is_file() and p.name != "zarr.json"]
        flip_in(lambda f: Path(f).read_bytes(), lambda f, b: Path(f).write_bytes(b), files, first_chunk_bytes(str(good)))
        out[layout] = (str(good), str(bad))
    return out


@pytest.fixture(scope="module")
def on_s3(s3) -> dict[str, tuple[str, str]]:
    """(good, damaged) checkpoints on the moto server by layout, as ``s3://`` URLs."""
    out = {}
    for layout in LAYOUTS:
        urls = []
        for which in ("good", "damaged"):
            loc = s3.location(BUCKET, f"{layout}-{which}/step_1000")
            tsckpt.save(state(), loc, layout=layout, inner_chunk_bytes=INNER_BYTES)
            urls.append(loc)
        kv = ts.KvStore.open(dict(parse_location(urls[1]).spec)).result()
        prefix = f"{layout}-damaged/step_1000/"
        names = [k[len(prefix):] for k in s3.keys(BUCKET, prefix) if not k.endswith("zarr.json")]

        def read(name, kv=kv):
            result = kv.read(name).result()
            return bytes(result.value) if result.state == "value" else None

        flip_in(read, lambda name, b, kv=kv: kv.write(name, b).result(), names, first_chunk_bytes(urls[0]))
        out[layout] = tuple(loc["url"] for loc in urls)
    return out


# The user's code: zarr, xarray and dask imported, tsckpt never.
USER_CODE = r'''
import json, sys
import numpy as np, tensorstore as ts, zarr, xarray as xr, dask.array as da
args = json.loads(sys.argv[1])
url, damaged, key, (i0, i1) = args["url"], args["damaged"], args["key"], args["inner"]
expected = np.load(args["expected"])
out = {"imported_before_open": "tsckpt" in sys.modules}

def same(values, want=expected):
    return bool(np.array_equal(np.asarray(values).astype(np.float32), want))
''' + REFUSAL + r'''
def bytes_read():
    return sum(v.get("value", 0) for m in ts.experimental_collect_matching_metrics(args["metric"]) for v in m["values"])

g = zarr.open_group(url, mode="r")
out["imported_by_the_url"] = "tsckpt" in sys.modules
a = g["model/" + key]
out["zarr"] = {"dtype": str(a.dtype), "same": same(a[:]), "members": sorted(g.keys()),
               "model": sorted(g["model"].keys())}
a[-1, -1]  # the index nodes of a packed checkpoint are read and cached by now
before = bytes_read()
corner = a[0:2, 0:3]
out["slice"] = {"bytes": bytes_read() - before, "same": same(corner, expected[0:2, 0:3])}
ds = xr.open_zarr(url + "/model", consolidated=False)
out["xarray"] = {"same": same(ds[key].values), "dims": list(ds[key].dims), "variables": sorted(ds.data_vars)}
out["dask"] = {"same": same(da.from_zarr(url, component="model/" + key).compute())}

bad = zarr.open_group(damaged, mode="r")["model/" + key]
out["damaged"] = {
    "zarr": refusal(lambda: bad[:]),
    "zarr_elsewhere": same(bad[i0:, :], expected[i0:, :]) and same(bad[:, i1:], expected[:, i1:]),
    "xarray": refusal(lambda: xr.open_zarr(damaged + "/model", consolidated=False)[key].values),
    "dask": refusal(lambda: da.from_zarr(damaged, component="model/" + key).compute()),
}
print(json.dumps(out))
'''


def read_as_a_user(tmp_path, good: str, damaged: str, inner, metric: str, env: dict[str, str] | None = None) -> dict:
    expected = tmp_path / "expected.npy"
    np.save(expected, state()["model"][WQ].float().numpy())
    args = {"url": f"tsckpt://{good}", "damaged": f"tsckpt://{damaged}", "key": WQ, "inner": list(inner),
            "expected": str(expected), "metric": metric}
    # Run away from the checkout, so that only the installed package (and its entry points) can be found.
    done = subprocess.run([sys.executable, "-c", USER_CODE, json.dumps(args)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=240, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def check(out: dict, inner) -> None:
    assert not out["imported_before_open"] and out["imported_by_the_url"]
    assert out["zarr"] == {"dtype": "bfloat16", "same": True, "members": ["model", "step"],
                           "model": ["embed.weight", WQ]}
    # One inner chunk of bf16 with its crc32c, and the shard's index: not the array's 64 KiB.
    assert out["slice"]["same"] and 0 < out["slice"]["bytes"] <= inner[0] * inner[1] * 2 + 4 + 1024, out["slice"]
    assert out["xarray"] == {"same": True, "dims": [f"{WQ}_0", f"{WQ}_1"], "variables": ["embed.weight", WQ]}
    assert out["dask"] == {"same": True}
    damaged = out["damaged"]
    assert damaged.pop("zarr_elsewhere") is True
    for call, refusal in damaged.items():
        assert refusal is not None and "checksum" in refusal.lower(), (call, refusal)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_zarr_xarray_and_dask_read_a_local_checkpoint_by_url_without_importing_tsckpt(local, layout, tmp_path):
    good, damaged = local[layout]
    inner = first_inner_chunk(good)
    # A relative path, as in tsckpt://ckpt/step_1000: relative to the reader's working directory.
    workdir = Path(good).parent.parent
    out = read_as_a_user(workdir, os.path.relpath(good, workdir), os.path.relpath(damaged, workdir), inner,
                         "/tensorstore/kvstore/file/bytes_read")
    check(out, inner)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_zarr_xarray_and_dask_read_an_s3_checkpoint_by_url_with_the_usual_environment(on_s3, s3, layout, tmp_path):
    good, damaged = on_s3[layout]
    inner = first_inner_chunk(s3.location(BUCKET, f"{layout}-good/step_1000"))
    out = read_as_a_user(tmp_path, good, damaged, inner, "/tensorstore/kvstore/s3/bytes_read",
                         env={"AWS_ENDPOINT_URL": s3.endpoint})
    check(out, inner)


# --- the filesystem, in this process ---------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_filesystem_serves_the_zarr_keys_and_nothing_else(local, layout):
    good, _ = local[layout]
    fs = fsspec.filesystem("tsckpt")
    assert isinstance(fs, TsckptFileSystem)
    store = tsckpt.zarr_store(good)
    assert fs.ls(good, detail=False) == [f"{good}/model", f"{good}/step", f"{good}/zarr.json"]
    keys = sorted(k[len(good) + 1:] for k in fs.find(good))
    assert keys == sorted(k for k in zarr.core.sync.sync(_listed(store)) if not k.startswith("d/"))
    assert not any(k.startswith(("d/", "manifest")) for k in keys)
    chunk = f"{good}/model/{WQ}/c.0.0"
    whole = fs.cat_file(chunk)
    assert fs.info(chunk) == {"name": chunk, "type": "file", "size": len(whole)}
    assert fs.cat_file(chunk, start=7, end=100) == whole[7:100]
    assert fs.cat_file(chunk, start=-20) == whole[-20:]
    assert fs.cat_file(chunk, start=len(whole) - 5, end=None) == whole[-5:]
    assert fs.info(f"{good}/model")["type"] == "directory" and fs.isdir(good)
    assert fs.exists(chunk) and not fs.exists(f"{good}/model/nothing") and not fs.exists(f"{good}/manifest.ocdbt")
    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"{good}/model/nothing/zarr.json")
    with pytest.raises(FileNotFoundError, match="no tsckpt checkpoint at or above"):
        fs.cat_file(f"{Path(good).parent}/zarr.json")
    for write in (lambda: fs.pipe_file(f"{good}/x", b"1"), lambda: fs.rm(chunk), lambda: fs.mkdir(f"{good}/y"),
                  lambda: fs.open(f"{good}/zarr.json", "wb")):
        with pytest.raises(PermissionError, match="read-only"):
            write()
    with fs.open(f"{good}/zarr.json") as f:
        assert json.loads(f.read())["attributes"]["tsckpt"]["layout"] == layout


async def _listed(store):
    return [k async for k in store.list()]


def test_a_checkpoint_saved_over_the_one_opened_is_read_anew(tmp_path):
    path = str(tmp_path / "step_5")
    tsckpt.save({"w": torch.zeros(4, 3)}, path)
    assert not zarr.open_group(f"tsckpt://{path}", mode="r")["w"][:].any()
    tsckpt.save({"w": torch.ones(6, 3)}, path, overwrite=True)
    again = zarr.open_group(f"tsckpt://{path}", mode="r")["w"]
    assert again.shape == (6, 3) and again[:].all()


def test_a_damaged_root_document_is_refused_not_taken_for_a_missing_group(tmp_path):
    path = tmp_path / "ck"
    tsckpt.save({"w": torch.zeros(4)}, str(path))
    doc = (path / "zarr.json").read_text()
    (path / "zarr.json").write_text(doc.replace('"world_size":1', '"world_size":2'))
    with pytest.raises(tsckpt.ChecksumError, match="crc32c"):
        zarr.open_group(f"tsckpt://{path}", mode="r")


def test_storage_options_carry_an_endpoint_the_environment_does_not(on_s3, s3, monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    good, _ = on_s3["packed"]
    line = open_line(json.dumps({"url": good, "endpoint": s3.endpoint}))
    assert line.startswith(f'g = zarr.open_group("tsckpt://{good}", mode="r", storage_options=')
    scope: dict = {"zarr": zarr}
    exec(line, scope)
    assert scope["g"]["model/embed.weight"][:].tolist() == state()["model"]["embed.weight"].tolist()


# --- the line to paste ------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["ls", "info"])
def test_ls_and_info_print_the_line_that_opens_the_checkpoint_by_url(local, command, monkeypatch):
    good, _ = local["packed"]
    monkeypatch.chdir(Path(good).parent)
    res = CliRunner().invoke(app, [command, "step_1000"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    line = res.output.splitlines()[-1]
    assert line.startswith(f'g = zarr.open_group("tsckpt://{good}", mode="r")')
    scope: dict = {"zarr": zarr}
    exec(line, scope)
    assert sorted(scope["g"]["model"].keys()) == ["embed.weight", WQ]
