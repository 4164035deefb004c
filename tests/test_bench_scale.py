"""The scale benchmark's synthetic world is the plans DCP would hand the writer, and the benchmark runs end to end."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.planner import SavePlan

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from scale_world import World, as_sent, sent_plan  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _every_ranks_plan(world: World) -> list[SavePlan]:
    return [SavePlan(as_sent(world.items(r)), planner_data=world.mappings) for r in range(world.ranks)]


def test_gathered_plans_are_what_dcps_dedup_makes_of_every_ranks_plan():
    world = World(ranks=7, tensors=5, rows=10, cols=4)  # 2 rows a rank: ranks 5 and 6 hold empty shards
    assert world.regions == 5
    expected = dedup_save_plans(_every_ranks_plan(world))
    for shared in (True, False):
        got = world.gathered(with_notes=False, shared=shared)
        assert [[i.index for i in p.items] for p in got] == [[i.index for i in p.items] for p in expected]
        assert [[i.tensor_data.chunk for i in p.items] for p in got] == \
            [[i.tensor_data.chunk for i in p.items] for p in expected]


def test_a_rank_is_sent_the_bytes_of_its_own_objects_however_the_coordinator_holds_them():
    world = World(ranks=3, tensors=4, rows=6, cols=2)
    own = _every_ranks_plan(world)
    for shared in (True, False):
        gathered = world.gathered(with_notes=False, shared=shared)
        for r in range(world.ranks):
            plan = SavePlan(gathered[r].items, storage_data="orders", planner_data=world.mappings)
            sent = sent_plan(plan, gathered[r], as_sent(gathered[r].items))
            real = SavePlan(own[r].items, storage_data="orders", planner_data=world.mappings)
            assert pickle.dumps(sent) == pickle.dumps(real)
    # a rank's items share their write data when held shared: pickled as they are, they would be too small
    shared = world.gathered(with_notes=False, shared=True)[0]
    assert len(pickle.dumps(shared)) < len(pickle.dumps(own[0]))


def test_the_benchmark_runs_every_phase_at_a_tiny_size(tmp_path):
    out = tmp_path / "figures.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "benchmarks")])}
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_scale.py"), "--ranks", "6", "--tensors",
                    "3", "--rows", "10", "--cols", "8", "--dcp-finish-ranks", "4", "--own-items-up-to", "10",
                    "--dir", str(tmp_path), "--json", str(out)], check=True, env=env, capture_output=True, timeout=600)
    figures = json.loads(out.read_text())
    assert set(figures["phases"]) == {"plan", "plan: tsckpt's planner", "plan, caching on: first save",
                                      "plan, cached: DCP's planner", "plan, cached: tsckpt's planner", "finish",
                                      "notes"}
    assert figures["items_share_write_data"] and figures["regions_per_tensor"] == 5
    assert figures["dcp_metadata_bytes"] > 0 and figures["root_document_bytes"] > 0
    assert os.listdir(tmp_path) == ["figures.json"]  # the checkpoints are gone
