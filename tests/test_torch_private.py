"""What tsckpt relies on of PyTorch's private parts (tsckpt.dcp.torch_private), checked against the installed torch.

A torch release that moves, renames or changes one of them fails here, by name.
"""

from __future__ import annotations

import dataclasses
import inspect
import io

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

import zoo
from dist import run_ranks
from tsckpt.dcp import torch_private as tp
from tsckpt.dcp.planner import describe


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_strided_shard_keeps_its_dim_and_split_factor():
    placement = tp.StridedShard(1, split_factor=2)
    assert (placement.dim, placement.split_factor) == (1, 2)
    from tsckpt.dcp.planner import _placement_record

    assert _placement_record(placement) == {"type": "strided_shard", "dim": 1, "split_factor": 2}


def test_dcp_flattens_nested_state_dicts_into_dotted_keys_and_object_paths():
    nested = {"a": {"b": torch.ones(2), "c": [torch.zeros(1), {"d": 1}]}, "e": 3}
    flat, mapping = tp.flatten_state_dict(nested)
    assert mapping == {"a.b": ("a", "b"), "a.c.0": ("a", "c", 0), "a.c.1.d": ("a", "c", 1, "d"), "e": ("e",)}
    assert list(flat) == list(mapping)
    again = tp.unflatten_state_dict(flat, mapping)
    assert again["a"]["c"][1] == {"d": 1} and torch.equal(again["a"]["b"], torch.ones(2))
    # A load planner's public mappings are those paths, which tsckpt follows and fills itself.
    planner = DefaultLoadPlanner()
    planner.set_up_planner(nested, None, True)
    assert planner.mappings == mapping
    for key, path in planner.mappings.items():
        assert tp.get_element(nested, path) is flat[key]
    rebuilt: dict = {}
    for key, path in mapping.items():
        tp.set_element(rebuilt, path, flat[key])
    assert rebuilt["a"]["c"][1] == {"d": 1} and rebuilt["a"]["c"][0] is flat["a.c.0"] and rebuilt["e"] == 3


def test_fake_tensors_have_shapes_and_no_storage_for_a_files_skeleton():
    assert "materialize_fake_tensors" in _params(torch.serialization.skip_data)
    with tp.FakeTensorMode():
        fake = torch.empty(3, 5, dtype=torch.bfloat16)
    assert fake.shape == (3, 5) and fake.dtype == torch.bfloat16
    buf = io.BytesIO()
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save({"w": fake}, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["w"].shape == (3, 5)


class _CacheProbe(DefaultSavePlanner):
    """A planner class of this test's own: DCP keys its plan cache by class name."""


def _plan_once(state: dict) -> tuple[DefaultSavePlanner, object, list, object]:
    planner = _CacheProbe(enable_plan_caching=True)
    planner.set_up_planner(state, None, True)
    local = planner.create_local_plan()
    plans, _ = planner.create_global_plan([local])
    return planner, local, plans, planner.finish_plan(plans[0])


def test_dcps_plan_cache_behaves_as_tsckpts_planner_expects():
    assert "enable_plan_caching" in _params(DefaultSavePlanner.__init__)
    assert tp.plan_caching_asked(enable_plan_caching=True) and tp.plan_caching_asked(True, True, None, False, True)
    assert not tp.plan_caching_asked() and not tp.plan_caching_asked(flatten_state_dict=False)
    state = {"w": torch.ones(4)}
    first, local, plans, finished = _plan_once(state)
    assert local.usable and plans[0].usable
    second, local, plans, again = _plan_once(state)
    assert not local.usable and local.items == []  # unchanged: the rank sends nothing
    assert not plans[0].usable  # and gets nothing back
    assert again is finished  # finish_plan hands back the plan it finished last time
    assert [p.items for p in second.global_plan] == [p.items for p in first.global_plan]  # every rank's full plan


def _rebuilt_sharded_tensor(rank: int, world: int) -> bool:
    st = zoo.sharded_tensor(torch.arange(12.0).reshape(6, 2), [3, 3], world)
    shards = [tp.LocalShard(s.tensor.clone(), s.metadata) for s in st.local_shards()]
    copy = tp.sharded_tensor_like(shards, st)
    return (isinstance(copy, tp.ShardedTensor) and copy.metadata() == st.metadata()
            and copy._process_group is st._process_group
            and all(torch.equal(a.tensor, b.tensor) for a, b in zip(copy.local_shards(), st.local_shards()))
            and describe(copy)["kind"] == "sharded_tensor")


def test_a_sharded_tensor_is_rebuilt_around_copied_shards():
    assert _params(tp.ShardedTensor._init_from_local_shards_and_global_metadata)[:3] == [
        "local_shards", "sharded_tensor_metadata", "process_group"]
    assert run_ranks(2, _rebuilt_sharded_tensor) == [True, True]
