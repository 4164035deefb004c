"""Damage reported by file and tensor: ``tsckpt verify`` names each damaged file once with what it holds, and
every read path's error names the tensor, the chunk and the file, on a local disk and on S3."""

from __future__ import annotations

import json
import os

import pytest
import torch
import zarr

import tsckpt
from cli_run import run_cli
from damage import edit_key, flip_byte
from tsckpt.errors import ChecksumError, StorageError
from tsckpt.storage.context import make_context, open_kvstore
from tsckpt.storage.location import parse_location

BUCKET = "tsckpt-damage-reports"
TENSORS = 12


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {f"l{i}": torch.randn(32, 16, generator=g) for i in range(TENSORS)}, "step": 7,
            "extra": {"tags": {"a", "b"}}}


def _data_file(path) -> str:
    (name,) = [n for n in os.listdir(os.path.join(path, "d")) if not n.endswith(".index")]
    return f"d/{name}"


@pytest.fixture
def truncated(tmp_path):
    path = tmp_path / "ckpt"
    tsckpt.save(_state(), path, layout="packed")
    file = _data_file(path)
    size = os.path.getsize(path / file)
    os.truncate(path / file, size // 2)
    return path, file, size


@pytest.fixture
def flipped(tmp_path):
    path = tmp_path / "flipped"
    tsckpt.save(_state(), path, layout="packed")
    edit_key(path, "model/l3/c.0.0", lambda data: flip_byte(data, 100, 0x10))
    return path


def test_verify_names_a_truncated_data_file_once_with_what_it_holds(truncated):
    path, file, size = truncated
    result = run_cli("verify", str(path), "--no-progress", env={"COLUMNS": "40"})
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) <= 3, result.stdout  # the file, maybe a value opened otherwise, the summary
    (line,) = [ln for ln in lines if file in ln]
    assert f"{file} is {size // 2} bytes, not the {size} written" in line
    assert f"holds {TENSORS} tensors" in line, line
    assert lines[-1].startswith("FAILED") and "1 damaged file" in lines[-1]
    details = run_cli("verify", str(path), "--details", "--no-progress", env={"COLUMNS": "40"})
    assert details.returncode == 1
    named = [ln for ln in details.stdout.splitlines() if not ln.startswith("  ")]
    assert {f"model.l{i} (model/l{i}): " for i in range(TENSORS)} <= {ln.split("2 problems")[0] for ln in named}
    as_json = json.loads(run_cli("verify", str(path), "--json").stdout)
    damaged = [e for e in as_json["entries"] if e["problems"]]
    assert len(damaged) >= TENSORS and all(file in e["problem_files"] for e in damaged)
    assert file in as_json["files"]["problem_files"]


def test_verify_names_a_flipped_chunk_by_tensor_chunk_and_file(flipped):
    result = run_cli("verify", str(flipped), "--no-progress", env={"COLUMNS": "40"})
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2, result.stdout
    assert lines[0].startswith(f"model.l3 (model/l3) in {_data_file(flipped)}: chunk c.0.0: ")
    assert "does not match its stored crc32c" in lines[0]


def test_verify_groups_damage_in_many_tensors_of_one_intact_file(tmp_path):
    path = tmp_path / "ckpt"
    tsckpt.save(_state(), path, layout="packed")
    for i in range(TENSORS):
        edit_key(path, f"model/l{i}/c.0.0", lambda data: flip_byte(data, 100, 0x10))
    result = run_cli("verify", str(path), "--no-progress")
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2, result.stdout
    assert lines[0].startswith(f"{_data_file(path)}: {TENSORS} problems in {TENSORS} tensors and values")


def _zarr_store(location, path):
    return zarr.open_array(tsckpt.zarr_store(location), path=path, mode="r")[...]


def _url(location, path):
    if isinstance(location, dict):
        spec = {k: v for k, v in location.items() if k != "url"}
        return zarr.open_array(f"tsckpt://{location['url']}/{path}", mode="r",
                               storage_options={"spec": spec})[...]
    return zarr.open_array(f"tsckpt://{location}/{path}", mode="r")[...]


def _open(location, path):
    return tsckpt.open(location)[path.replace("/", ".")][...]


def _load(location, path):
    key = path.split("/")
    tsckpt.load({key[0]: {key[1]: torch.zeros(32, 16)}}, location, allow_partial_load=True)


READS = {"zarr_store": _zarr_store, "url": _url, "open": _open, "load": _load}


@pytest.mark.parametrize("read", READS)
def test_local_read_errors_name_tensor_chunk_and_file(truncated, flipped, read):
    path, file, _ = truncated
    with pytest.raises((StorageError, ChecksumError)) as info:
        READS[read](str(path), "model/l11")
    message = str(info.value)
    assert "\n" not in message
    assert "'model.l11'" in message and "model/l11/c.0.0" in message and file in message, message
    with pytest.raises(ChecksumError) as info:
        READS[read](str(flipped), "model/l3")
    message = str(info.value)
    assert "'model.l3'" in message and "model/l3/c.0.0" in message and _data_file(flipped) in message, message
    assert "crc32c" in message


def _kvstore(location):
    loc = parse_location(location)
    return open_kvstore(loc, make_context(location=loc))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_s3_read_errors_name_tensor_chunk_and_file(s3, damage):
    prefix = f"damage-reports/{damage}"
    location = s3.location(BUCKET, prefix)
    tsckpt.save(_state(), location, overwrite=True, layout="packed")
    with tsckpt.open(location) as ck:
        found = ck.source.locator.locate("model/l0/c.0.0")
    file = found.file
    kv = _kvstore(location)
    data = bytes(kv.read(file).result().value)
    # A flipped byte of model.l0's chunk; or a part cut in half, with the chunk table at its end.
    damaged = flip_byte(data, found.offset + 8, 0x10) if damage == "flip" else data[:len(data) // 2]
    kv.write(file, damaged).result()
    for name, read in READS.items():
        key = "model/l0" if damage == "flip" else "model/l11"
        with pytest.raises((StorageError, ChecksumError)) as info:
            read(location, key)
        message = str(info.value)
        assert "\n" not in message, (name, message)
        assert name != "zarr_store" or damage != "flip" or isinstance(info.value, ChecksumError), message
        assert f"'{key.replace('/', '.')}'" in message and f"{key}/c.0.0" in message and file.split(".")[0] in message, \
            (name, message)
