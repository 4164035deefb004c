"""With default options, one flipped byte in any file is caught by every read path."""

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import tsckpt
from damage import edit_key, flip_byte, read_key, write_key
from tsckpt.errors import TsckptError
from tsckpt.read.verify import verify

#: dcp.load wraps a rank's error in its own exception, whose text holds ours.
REFUSED = (TsckptError, CheckpointException)


def _state():
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g).bfloat16()},
            "step": 7, "extra": {"tags": {"a", "b"}}}


@pytest.fixture(scope="module", params=["plain", "packed"])
def saved(tmp_path_factory, request):
    path = tmp_path_factory.mktemp("integrity") / "ck"
    tsckpt.save(_state(), path, layout=request.param)  # default options: no Zarr crc32c codec
    return path


@pytest.fixture
def ckpt(saved, tmp_path):
    import shutil

    shutil.copytree(saved, tmp_path / "ck")
    return tmp_path / "ck"


def _flip(ckpt, key, offset=3):
    edit_key(ckpt, key, lambda data: flip_byte(data, offset, 0x10))


def _cli(*args):
    code = "import sys; from tsckpt.cli import main; sys.argv = ['tsckpt', *sys.argv[1:]]; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


def _empty():
    return {"model": {"w": torch.zeros(16, 8), "b": torch.zeros(8, dtype=torch.bfloat16)}, "step": 0,
            "extra": {"tags": None}}


def _read_paths(ckpt, tmp_path):
    """Every way to read the data, each as a callable that must raise."""
    return {
        "tsckpt.load": lambda: tsckpt.load(_empty(), ckpt, allow_pickle=True),
        "dcp.load": lambda: dcp.load(_empty(), storage_reader=tsckpt.TensorStoreReader(ckpt, allow_pickle=True)),
        "open slice": lambda: tsckpt.open(ckpt, allow_pickle=True)["model.w"][0:16],
        "open numpy": lambda: tsckpt.open(ckpt, allow_pickle=True)["model.w"].numpy(),
        "to_state_dict": lambda: tsckpt.open(ckpt, allow_pickle=True).to_state_dict(),
        "convert": lambda: tsckpt.convert(ckpt, tmp_path / "out.safetensors", trust_pickle=True),
        "diff": lambda: tsckpt.diff(ckpt, ckpt, trust_pickle=True),
    }


def test_flipped_tensor_byte_is_caught_everywhere_naming_tensor_and_chunk(ckpt, tmp_path):
    _flip(ckpt, "model/w/c.0.0")
    for name, read in _read_paths(ckpt, tmp_path).items():
        with pytest.raises(REFUSED, match=r"'model\.w'.*chunk \[0, 0\] does not match its stored crc32c"):
            read()
    report = verify(ckpt)
    assert [e.key for e in report.failed] == ["model.w"]
    assert "chunk [0, 0] does not match its stored crc32c" in report.failed[0].problems[0]
    result = _cli("verify", str(ckpt))
    assert result.returncode == 1 and "does not match its stored crc32c" in result.stdout, result
    result = _cli("show", str(ckpt), "model.w")
    assert result.returncode == 2 and "chunk [0, 0] does not match" in result.stderr + result.stdout, result


def test_clean_checkpoint_checks_every_chunk(saved):
    report = verify(saved)
    assert report.ok and report.checksummed == report.chunks - 1  # all tensor chunks; the blob has its codec
    sd = _empty()
    tsckpt.load(sd, saved, allow_pickle=True)
    assert torch.equal(sd["model"]["w"], _state()["model"]["w"])


def test_flipped_value_blob_is_caught(ckpt, tmp_path):
    _flip(ckpt, "extra/tags/c.0", offset=40)
    for name in ("tsckpt.load", "dcp.load", "to_state_dict", "convert", "diff"):
        with pytest.raises(REFUSED, match=r"extra\.tags"):
            _read_paths(ckpt, tmp_path)[name]()
    assert [e.key for e in verify(ckpt).failed] == ["extra.tags"]


def test_flipped_root_document_is_refused_by_every_path(ckpt, tmp_path):
    root = ckpt / "zarr.json"
    text = root.read_text()
    at = text.index('"shape":[16,8]') + len('"shape":[1')  # 16 -> 17 still parses as JSON
    root.write_text(text[:at] + "7" + text[at + 1:])
    for name, read in _read_paths(ckpt, tmp_path).items():
        with pytest.raises(REFUSED, match="does not match its crc32c"):
            read()
    with pytest.raises(REFUSED, match="does not match its crc32c"):
        verify(ckpt)


def test_flipped_array_zarr_json_is_reported_by_verify_and_cannot_mislead_loads(ckpt):
    doc = json.loads(read_key(ckpt, "model/w/zarr.json"))
    doc["chunk_grid"]["configuration"]["chunk_shape"] = [1, 8]
    write_key(ckpt, "model/w/zarr.json", json.dumps(doc).encode())
    assert [e.key for e in verify(ckpt).failed] == ["model.w"]
    sd = _empty()
    tsckpt.load(sd, ckpt, allow_pickle=True)  # loads open arrays from the root document alone
    assert torch.equal(sd["model"]["w"], _state()["model"]["w"])
