"""Behaviours PyTorch's own DCP tests rely on, with tsckpt's writer and reader in place of DCP's.

``tools/pytorch_dcp_suite.py`` runs PyTorch's tests with ``FileSystemWriter`` /
``FileSystemReader`` swapped for ``TensorStoreWriter`` / ``TensorStoreReader``;
each test here states one behaviour those tests exercise that tsckpt's other
tests do not (constructor arguments, overwriting, plan caching, tensors that
require grad and rank-local saves are in ``test_dropin_args.py``). A behaviour
tsckpt does not have yet is marked ``xfail(strict=True)`` with the reason, so
the mark has to go when it lands.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
from torch.distributed.checkpoint.stateful import Stateful

import tsckpt
from tsckpt import TensorStoreReader, TensorStoreWriter


# --- loading -----------------------------------------------------------------------------

def test_bytesio_values_round_trip_with_dcps_planners(tmp_path):
    # The training-state pattern of PyTorch's e2e test: losses kept as a torch.save'd BytesIO.
    losses = io.BytesIO()
    torch.save([0.5, 0.25], losses)
    dcp.save({"losses": losses, "step": torch.tensor(3)}, storage_writer=TensorStoreWriter(tmp_path / "c"))
    back = {"losses": io.BytesIO(), "step": torch.tensor(0)}
    dcp.load(back, storage_reader=TensorStoreReader(tmp_path / "c"))
    back["losses"].seek(0)
    assert torch.load(back["losses"]) == [0.5, 0.25] and back["step"].item() == 3


class _Blob:
    """A Stateful holding raw bytes, like the BlobState of PyTorch's extension tests."""

    def __init__(self, value: bytes):
        self.state = {"blob": value}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = state_dict


class _Empty(Stateful):
    loaded = False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = True


def test_empty_state_dicts_save_and_load(tmp_path):
    # PyTorch's e2e tests save {} and a Stateful whose state is empty; tsckpt's own
    # planner stores plain values inline, so a values-only save writes no array either.
    tsckpt.save({"step": 3, "lr": 0.1}, tmp_path / "values")
    back = {"step": 0, "lr": 0.0}
    tsckpt.load(back, tmp_path / "values")
    assert back == {"step": 3, "lr": 0.1}
    dcp.save({}, storage_writer=TensorStoreWriter(tmp_path / "empty"))
    dcp.load({}, storage_reader=TensorStoreReader(tmp_path / "empty"))
    empty = _Empty()
    dcp.save({"foo": _Empty()}, storage_writer=TensorStoreWriter(tmp_path / "stateful"))
    dcp.load({"foo": empty}, storage_reader=TensorStoreReader(tmp_path / "stateful"))
    assert empty.loaded  # loaded in place through load_state_dict


def test_stateful_objects_with_bytes_load_in_place(tmp_path):
    dcp.save({"blob": _Blob(b"SomeBlobForTesting"), "m": torch.nn.Linear(2, 2), "n": _Empty()},
             storage_writer=TensorStoreWriter(tmp_path / "c"))
    blob, model, empty = _Blob(b""), torch.nn.Linear(2, 2), _Empty()
    dcp.load({"blob": blob, "m": model, "n": empty}, storage_reader=TensorStoreReader(tmp_path / "c"))
    assert blob.state == {"blob": b"SomeBlobForTesting"} and empty.loaded
    saved = tsckpt.open(tmp_path / "c")
    assert torch.equal(model.weight.detach(), saved["m.weight"].torch())


def test_deprecated_save_and_load_state_dict_with_no_dist(tmp_path):
    sd = {"w": torch.randn(5, 5), "e": torch.randn(5, 10)}
    dcp.save_state_dict(state_dict=sd, storage_writer=TensorStoreWriter(path=tmp_path / "c"), no_dist=True)
    back = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load_state_dict(state_dict=back, storage_reader=TensorStoreReader(path=tmp_path / "c"), no_dist=True)
    assert all(torch.equal(back[k], v) for k, v in sd.items())


def test_single_file_per_rank_true_saves_and_loads(tmp_path):
    # PyTorch's test_file_system_checkpoint.py passes DCP's default explicitly: the packed layout.
    sd = {"w": torch.randn(5, 5), "e": torch.randn(5, 10)}
    writer = TensorStoreWriter(path=tmp_path / "c", single_file_per_rank=True, thread_count=2)
    dcp.save_state_dict(state_dict=sd, storage_writer=writer, no_dist=True)
    back = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load_state_dict(state_dict=back, storage_reader=TensorStoreReader(path=tmp_path / "c"), no_dist=True)
    assert all(torch.equal(back[k], v) for k, v in sd.items())
    assert tsckpt.open(tmp_path / "c").metadata.layout == "packed"


@pytest.mark.filterwarnings("ignore:torch.distributed is unavailable")
def test_load_state_dict_from_keys_reads_a_subtree(tmp_path):
    model = torch.nn.Linear(3, 2)
    sd = {"model": model.state_dict(), "optimizer": {"state": {"0": {"step": torch.tensor(4.0)}}, "lr": 0.1}}
    dcp.save(sd, storage_writer=TensorStoreWriter(tmp_path / "c"))
    got = _load_state_dict_from_keys("model", storage_reader=TensorStoreReader(tmp_path / "c"))
    assert set(got) == {"model"} and torch.equal(got["model"]["weight"], model.weight.detach())
    got = _load_state_dict_from_keys("optimizer.state", storage_reader=TensorStoreReader(tmp_path / "c"))
    assert got["optimizer"]["state"]["0"]["step"].item() == 4.0 and "lr" not in got["optimizer"]


# --- planning and storage metadata -------------------------------------------------------

def test_read_metadata_reports_checkpoint_save_and_load_ids(tmp_path):
    writer = TensorStoreWriter(tmp_path / "c")
    dcp.save({"w": torch.zeros(3, 4), "step": 7}, storage_writer=writer)
    reader = TensorStoreReader(tmp_path / "c")
    meta = reader.read_metadata().storage_meta
    assert meta is not None
    assert str(meta.checkpoint_id) == str(tmp_path / "c")
    assert meta.save_id == writer.save_id and meta.load_id == reader.load_id


def test_dcp_default_load_planner_casts_like_dcp(tmp_path):
    # DCP's default planner casts silently in both directions (PyTorch's dtype-mismatch test);
    # tsckpt's own LoadPlanner refuses narrowing casts, DCP's must not.
    dcp.save({"w": torch.rand(4, 3)}, storage_writer=TensorStoreWriter(tmp_path / "f32"), planner=DefaultSavePlanner())
    narrow = {"w": torch.zeros(4, 3, dtype=torch.bfloat16)}
    dcp.load(narrow, storage_reader=TensorStoreReader(tmp_path / "f32"), planner=DefaultLoadPlanner())
    expected = tsckpt.open(tmp_path / "f32")["w"].torch()
    assert narrow["w"].dtype == torch.bfloat16 and torch.equal(narrow["w"], expected.to(torch.bfloat16))
    dcp.save({"w": torch.rand(4, 3, dtype=torch.bfloat16)}, storage_writer=TensorStoreWriter(tmp_path / "bf16"))
    wide = {"w": torch.zeros(4, 3)}
    dcp.load(wide, storage_reader=TensorStoreReader(tmp_path / "bf16"), planner=DefaultLoadPlanner())
    assert torch.equal(wide["w"], tsckpt.open(tmp_path / "bf16")["w"].torch().float())
