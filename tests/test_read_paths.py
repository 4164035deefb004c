"""Every read path refuses a missing chunk, and every write path stores all-zero chunks.

A missing chunk file must never read back as zeros: ``tsckpt.open``, ``to_state_dict``,
``tsckpt show``, ``tsckpt convert`` and ``tsckpt diff`` each raise (or exit non-zero)
with an error naming the tensor and the chunk. A converted checkpoint with all-zero
tensors or all-zero inner chunks loads and verifies like a saved one.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

import tsckpt
from damage import write_key
from tsckpt.errors import TsckptError


def _cli(*args: str) -> subprocess.CompletedProcess:
    code = "import sys; from tsckpt.cli import main; sys.argv = ['tsckpt', *sys.argv[1:]]; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(params=["plain", "packed"])
def damaged(tmp_path, request):
    """A checkpoint whose ``model.w`` (one chunk, ``c.0.0``) lost its chunk (file, or key of the database)."""
    path = tmp_path / "ckpt"
    with tsckpt.CheckpointBuilder(path, inner_chunk_bytes=0, layout=request.param) as b:
        b.add_tensor(("model", "w"), torch.arange(64, dtype=torch.float32).reshape(16, 4) + 1)
        b.add_tensor(("model", "b"), torch.ones(3))
    write_key(path, "model/w/c.0.0", None)
    return path


def _names_tensor_and_chunk(text: str) -> None:
    assert "model.w" in text and "c.0.0" in text, text


def test_open_numpy_refuses_a_missing_chunk(damaged):
    ck = tsckpt.open(damaged)
    with pytest.raises(TsckptError) as info:
        ck["model.w"].numpy()
    _names_tensor_and_chunk(str(info.value))
    assert ck["model.b"].numpy().tolist() == [1.0, 1.0, 1.0]  # the other tensor still reads


def test_to_state_dict_refuses_a_missing_chunk(damaged):
    with pytest.raises(TsckptError) as info:
        tsckpt.open(damaged).to_state_dict()
    _names_tensor_and_chunk(str(info.value))


def test_show_refuses_a_missing_chunk(damaged):
    result = _cli("show", str(damaged), "model.w")
    assert result.returncode != 0, result.stdout
    _names_tensor_and_chunk(result.stderr)


def test_convert_refuses_a_missing_chunk(damaged, tmp_path):
    dst = tmp_path / "out.safetensors"
    result = _cli("convert", str(damaged), str(dst), "--quiet")
    assert result.returncode != 0, result.stdout + result.stderr
    _names_tensor_and_chunk(result.stderr)
    assert not dst.exists()


def test_diff_refuses_a_missing_chunk(damaged, tmp_path):
    other = tmp_path / "other"
    with tsckpt.CheckpointBuilder(other) as b:
        b.add_tensor(("model", "w"), torch.zeros(16, 4))
        b.add_tensor(("model", "b"), torch.ones(3))
    result = _cli("diff", str(damaged), str(other))
    assert result.returncode != 0
    _names_tensor_and_chunk(result.stderr)


def test_converted_zero_tensors_load_and_verify(tmp_path):
    padded = torch.randn(8, 4)
    padded[:4] = 0  # the zero padding rows of an embedding: a whole inner chunk of zeros
    tensors = {"zeros": torch.zeros(5, 3), "padded": padded, "flags": torch.zeros(4, dtype=torch.bool)}
    src = tmp_path / "x.safetensors"
    save_file(tensors, str(src))
    dst = tmp_path / "ck"
    result = _cli("convert", str(src), str(dst), "--quiet")
    assert result.returncode == 0, result.stderr
    sd = {k: torch.ones_like(v) for k, v in tensors.items()}
    tsckpt.load(sd, dst)
    for k, v in tensors.items():
        assert torch.equal(sd[k], v), k
    verified = _cli("verify", str(dst))
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_builder_stores_all_zero_inner_chunks(tmp_path):
    padded = torch.randn(8, 4)
    padded[:4] = 0
    path = tmp_path / "ck"
    with tsckpt.CheckpointBuilder(path, inner_chunk_bytes=64) as b:  # 4x4 float32 inner chunks
        b.add_tensor("padded", padded)
    assert tsckpt.open(path)["padded"].chunks.inner_chunk_shape == (4, 4)
    sd = {"padded": torch.ones(8, 4)}
    tsckpt.load(sd, path)
    assert torch.equal(sd["padded"], padded)
    verified = _cli("verify", str(path))
    assert verified.returncode == 0, verified.stdout + verified.stderr
