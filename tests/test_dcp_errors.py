"""Errors through DCP: tsckpt's own line first, once, and every mismatched key named.

DCP gathers each rank's exception into a CheckpointException printed as every
failing rank's traceback before the error itself. ``tsckpt.save`` and
``tsckpt.load`` raise the error itself, without the frames inside DCP it
went through; through ``dcp.load`` the tsckpt line is the first line of the
error DCP shows.
"""

from __future__ import annotations

import pickle
import traceback

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dist
import tsckpt
from tsckpt.errors import LoadMismatchError


def _shapes(n: int, rows: int) -> dict[str, torch.Tensor]:
    return {f"layer{i:02d}.w": torch.zeros(rows, 3) for i in range(n)}


def test_a_load_names_every_mismatched_tensor_up_to_ten(tmp_path):
    tsckpt.save(_shapes(12, 4), tmp_path / "ck")
    four = {**_shapes(12, 4), **_shapes(4, 5)}
    with pytest.raises(LoadMismatchError) as caught:
        tsckpt.load(four, tmp_path / "ck")
    lines = str(caught.value).splitlines()
    assert lines[0] == ("4 keys of the state dict do not match the checkpoint: "
                        "'layer00.w', 'layer01.w', 'layer02.w', 'layer03.w'")
    assert lines[1:] == [f"  tensor 'layer{i:02d}.w': checkpoint shape [4, 3] does not match the state dict's [5, 3]"
                         for i in range(4)]

    twelve = {**_shapes(12, 5), "extra": torch.zeros(2), "extra2": torch.zeros(2)}
    with pytest.raises(LoadMismatchError) as caught:
        tsckpt.load(twelve, tmp_path / "ck")
    lines = str(caught.value).splitlines()
    head, named = lines[0].split(": ", 1)
    assert head == "14 keys of the state dict do not match the checkpoint"
    assert named.endswith(" and 4 more; pass allow_partial_load=True to skip keys the checkpoint does not have")
    assert named.count("'") == 20 and "'extra'" in named and "'extra2'" in named  # 10 keys named, the missing ones too
    assert len(lines) == 12 and lines[-1] == "  and 4 more"
    assert "  key 'extra' of the state dict is not in the checkpoint" in lines


def _load_mismatched(rank: int, world_size: int, path: str, api: str) -> tuple[str, str, str]:
    state = {**_shapes(4, 5), "step": 0}
    try:
        if api == "tsckpt":
            tsckpt.load(state, path)
        else:
            dcp.load(state, storage_reader=tsckpt.TensorStoreReader(path), planner=tsckpt.LoadPlanner())
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return type(e).__name__, str(e), "".join(traceback.format_exception(e))
    return "ok", "", ""


def _save_again(rank: int, world_size: int, path: str) -> tuple[str, str, str]:
    try:
        tsckpt.save({"w": torch.ones(4), "step": 1}, path)
    except BaseException as e:  # noqa: BLE001
        return type(e).__name__, str(e), "".join(traceback.format_exception(e))
    return "ok", "", ""


def test_tsckpt_load_and_save_raise_their_line_on_every_rank_without_dcp_around_it(tmp_path):
    path = str(tmp_path / "ck")
    tsckpt.save({**_shapes(4, 4), "step": 0}, path)
    first = ("4 keys of the state dict do not match the checkpoint: "
             "'layer00.w', 'layer01.w', 'layer02.w', 'layer03.w'")
    for kind, message, shown in dist.run_ranks(2, _load_mismatched, path, "tsckpt", timeout=120):
        assert kind == "LoadMismatchError" and message.splitlines()[0] == first, (kind, message)
        assert "torch/distributed/checkpoint" not in shown and "CheckpointException" not in shown, shown
        assert len(shown.splitlines()) <= 6 + len(message.splitlines()), shown

    for kind, message, shown in dist.run_ranks(2, _save_again, path, timeout=120):
        assert kind == "CheckpointExistsError" and message.startswith("Checkpoint already exists"), (kind, message)
        assert "torch/distributed/checkpoint" not in shown, shown


def test_through_dcp_load_the_tsckpt_line_is_the_first_line_of_each_ranks_error(tmp_path):
    path = str(tmp_path / "ck")
    tsckpt.save({**_shapes(4, 4), "step": 0}, path)
    for kind, message, _ in dist.run_ranks(2, _load_mismatched, path, "dcp", timeout=120):
        assert kind == "CheckpointException", (kind, message)
        errors = [line for line in message.splitlines() if line.startswith("tsckpt.errors.LoadMismatchError: ")]
        assert errors == ["tsckpt.errors.LoadMismatchError: 4 keys of the state dict do not match the checkpoint: "
                          "'layer00.w', 'layer01.w', 'layer02.w', 'layer03.w'"] * 2, message


def test_a_ranks_own_error_comes_before_one_relayed_to_it_from_another_rank():
    """With replica reads a rank raises the error of the rank that fetched for it, marked as relayed, which
    survives DCP's gathering (a pickle): tsckpt.load raises a rank's own error first."""
    from torch.distributed.checkpoint.api import CheckpointException

    from tsckpt.dcp.api import _plain

    relayed = pickle.loads(pickle.dumps(tsckpt.ChecksumError("damaged (rank 1 fetched it for this rank too)",
                                                             relayed_from=1)))
    own = pickle.loads(pickle.dumps(tsckpt.ChecksumError("damaged")))
    assert (relayed.relayed_from, own.relayed_from) == (1, None)
    assert _plain(CheckpointException("read", {0: relayed, 1: own}), "load from ck") is own
