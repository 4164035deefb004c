"""Loading into a state dict that does not match the checkpoint fails naming the key, unless allowed.

"Unexpected" keys, ones in the checkpoint that the state dict does not ask for,
are not an error: loading a subset (only the model, not the optimizer) is the
normal way to use a checkpoint, as in DCP itself.
"""

from __future__ import annotations

import pytest
import torch

import tsckpt
from tsckpt.errors import LoadMismatchError

W = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("mismatch") / "ckpt"
    tsckpt.save({"model": {"w": W.clone(), "n": torch.arange(5, dtype=torch.int64),
                           "h": W.to(torch.bfloat16)}, "lr": 0.1}, path)
    return path


def test_missing_key_is_named(ckpt):
    sd = {"model": {"w": torch.zeros(4, 3), "gone": torch.zeros(2)}}
    with pytest.raises(LoadMismatchError, match=r"'model\.gone'.*allow_partial_load"):
        tsckpt.load(sd, ckpt)


def test_missing_key_allowed_with_partial_load(ckpt):
    sd = {"model": {"w": torch.zeros(4, 3), "gone": torch.full((2,), 7.0)}}
    tsckpt.load(sd, ckpt, allow_partial_load=True)
    assert torch.equal(sd["model"]["w"], W)
    assert torch.equal(sd["model"]["gone"], torch.full((2,), 7.0))  # left as it was


def test_keys_not_asked_for_are_ignored(ckpt):
    sd = {"model": {"w": torch.zeros(4, 3)}}  # no "n", "h" or "lr"
    tsckpt.load(sd, ckpt)
    assert torch.equal(sd["model"]["w"], W) and set(sd["model"]) == {"w"} and "lr" not in sd


@pytest.mark.parametrize("shape", [(3, 4), (4,), (4, 3, 1), (5, 3)])
def test_shape_mismatch_is_named(ckpt, shape):
    with pytest.raises(LoadMismatchError, match=r"'model\.w'.*\[4, 3\].*" + str(list(shape)).replace("[", r"\[")
                       .replace("]", r"\]")):
        tsckpt.load({"model": {"w": torch.zeros(shape)}}, ckpt)


@pytest.mark.parametrize("key, dest", [("w", torch.bfloat16), ("w", torch.float16), ("w", torch.int32),
                                       ("n", torch.int32), ("n", torch.float32), ("n", torch.float64)])
def test_narrowing_cast_is_refused(ckpt, key, dest):
    like = {"w": torch.zeros(4, 3, dtype=dest), "n": torch.zeros(5, dtype=dest)}[key]
    with pytest.raises(LoadMismatchError, match=rf"'model\.{key}'.*lose precision.*allow_dtype_cast"):
        tsckpt.load({"model": {key: like}}, ckpt)


def test_narrowing_cast_allowed_when_asked(ckpt):
    sd = {"model": {"w": torch.zeros(4, 3, dtype=torch.bfloat16), "n": torch.zeros(5, dtype=torch.int32)}}
    tsckpt.load(sd, ckpt, allow_dtype_cast=True)
    assert torch.equal(sd["model"]["w"], W.to(torch.bfloat16))
    assert torch.equal(sd["model"]["n"], torch.arange(5, dtype=torch.int32))


def test_widening_cast_is_always_allowed(ckpt):
    sd = {"model": {"w": torch.zeros(4, 3, dtype=torch.float64), "h": torch.zeros(4, 3),
                    "n": torch.zeros(5, dtype=torch.int64)}}
    tsckpt.load(sd, ckpt)
    assert torch.equal(sd["model"]["w"], W.double())
    assert torch.equal(sd["model"]["h"], W.to(torch.bfloat16).float())


def test_tensor_where_a_value_was_saved_is_refused(ckpt):
    with pytest.raises(LoadMismatchError, match=r"'lr'.*non-tensor value.*state dict has a tensor"):
        tsckpt.load({"lr": torch.zeros(1)}, ckpt)


def test_value_where_a_tensor_was_saved_is_refused(ckpt):
    with pytest.raises(LoadMismatchError, match=r"'model\.w'.*holds a tensor"):
        tsckpt.load({"model": {"w": 1.0}}, ckpt)
