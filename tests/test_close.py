"""Closing what tsckpt opens for reading: a checkpoint, its tensor handles, a zarr store.

A checkpoint and its tensor handles refer to each other, so without
``close()`` their TensorStore objects (a packed checkpoint's node cache among
them) live until the next cyclic garbage collection. The tests run with the
collector off: whatever is released, is released by ``close()`` itself.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import zarr

import tsckpt
from tsckpt.errors import OptionError

W = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)


@pytest.fixture(params=["plain", "packed"])
def saved(request, tmp_path) -> str:
    path = str(tmp_path / "ck")
    tsckpt.save({"w": W, "lr": 0.5}, path, layout=request.param)
    return path


@pytest.fixture
def no_collection() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_close_releases_the_tensorstore_objects_without_a_collection(saved, no_collection):
    ck = tsckpt.open(saved)
    handle = ck["w"]
    assert torch.equal(handle[8:12], W[8:12])
    held = [weakref.ref(ck.store), weakref.ref(ck.source), weakref.ref(handle._box_reader)]
    ck.close()
    assert [ref() for ref in held] == [None, None, None]
    assert ck.closed and "closed" in repr(ck)
    # The metadata stays; data does not.
    assert handle.shape == (64, 16) and list(ck) == ["w", "lr"]
    with pytest.raises(OptionError, match=r"checkpoint .* is closed: open it again with tsckpt.open"):
        handle.numpy()
    assert ck["lr"] == 0.5  # a plain value is part of the metadata
    ck.close()  # twice: nothing happens


def test_with_blocks_close_checkpoints_and_handles(saved):
    with tsckpt.open(saved) as ck:
        assert ck["lr"] == 0.5
        with ck["w"] as handle:
            assert torch.equal(handle[:], W)
        assert handle._box_reader is None
        assert torch.equal(handle[:2], W[:2])  # a closed handle opens its array again while the checkpoint is open
    assert ck.closed
    with pytest.raises(OptionError, match="is closed"):
        handle[:2]


def test_a_zarr_store_closes_and_reopens_when_read_again(saved, no_collection):
    with tsckpt.zarr_store(saved) as store:
        array = zarr.open_array(store, path="w", mode="r")  # reads through a read-only copy of the store
        assert np.array_equal(array[:], W.numpy())
        used = array.store
        assert used._stores is not None
    # Closing the store closed the copy zarr reads through, too.
    assert store._stores is None and used._stores is None
    assert np.array_equal(array[:4], W[:4].numpy())  # a later read opens them again
    store.close()
    assert used._stores is None
