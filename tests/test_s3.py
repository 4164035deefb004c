"""Checkpoints on object storage: a real moto S3 server on 127.0.0.1, real gloo ranks."""

from __future__ import annotations

import numpy as np
import pytest
import tensorstore as ts
import torch
import zarr
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import tsckpt
from tsckpt.commit.states import CLAIM
import zoo
from cli_run import one_line_error, run_cli
from zoo import same_bits
from dist import run_ranks
from tsckpt.errors import MetadataError, StorageError
from tsckpt.commit import protocol as commit
from tsckpt.storage.context import make_context, open_kvstore
from tsckpt.storage.location import parse_location

BUCKET = "tsckpt-test"  # this module's bucket on the run's moto server (the s3 fixture, conftest.py)
# The zoo's own bucket: what it holds is what that one save wrote, in whatever order the tests run.
ZOO_BUCKET = "tsckpt-test-zoo"


@pytest.fixture(scope="module")
def zoo_s3(s3):
    """The 4-rank zoo saved to s3://tsckpt-test-zoo/runs/zoo4 by gloo ranks, in the default layout."""
    s3.create_bucket(ZOO_BUCKET)
    location = s3.location(ZOO_BUCKET, "runs/zoo4")
    run_ranks(4, zoo.save_zoo, location)
    return location


def bucket_keys(s3, prefix: str = "", bucket: str = BUCKET) -> list[str]:
    """Every key in ``bucket`` that starts with ``prefix``, as full object names."""
    return s3.keys(bucket, prefix)




def test_4_rank_save_to_s3_loads_back_bit_exactly(zoo_s3):
    sd = zoo.empty_like_expected()
    tsckpt.load(sd, zoo_s3)
    zoo.assert_zoo_tensors(sd)
    assert sd["extra"]["name"] == "run-1" and sd["extra"]["groups"][0]["betas"] == (0.9, 0.99)


def test_s3_save_stays_under_its_prefix_and_has_a_root_document(s3, zoo_s3):
    keys = bucket_keys(s3, bucket=ZOO_BUCKET)
    assert keys and all(k.startswith("runs/zoo4/") for k in keys)
    assert "runs/zoo4/zarr.json" in keys
    if tsckpt.open(zoo_s3).metadata.layout == "plain":
        assert "runs/zoo4/model/even/zarr.json" in keys
        assert any(k.startswith("runs/zoo4/model/even/c.") for k in keys)
    else:  # the manifest, the index and one data file per rank (in one part each: a few hundred KB)
        save_id = tsckpt.open(zoo_s3).metadata.extra["save_id"]
        assert sorted(keys) == sorted(["runs/zoo4/zarr.json", "runs/zoo4/manifest.ocdbt",
                                       f"runs/zoo4/d/{save_id}.index",
                                       *(f"runs/zoo4/d/{save_id}-{r}.0" for r in range(4))])


def save_and_load_large_shards(rank, world, location):
    """Save two row-sharded 20 MB tensors (10 MB a rank each) packed with dcp.save, load them back column-sharded."""
    import torch.distributed.checkpoint as dcp

    mesh = init_device_mesh("cpu", (world,))
    full = {k: torch.arange(2048 * 2560, dtype=torch.float32).reshape(2048, 2560) * (i + 1)
            for i, k in enumerate(("w1", "w2"))}
    sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    dcp.save(sd, storage_writer=tsckpt.TensorStoreWriter(location, layout="packed"))  # whatever the run's default
    dest = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(1)], src_data_rank=None) for k, v in full.items()}
    dcp.load(dest, storage_reader=tsckpt.TensorStoreReader(location))
    return [k for k, v in dest.items() if not same_bits(v.full_tensor(), full[k])]


def test_a_rank_s_large_data_file_is_uploaded_in_two_halves_and_loads_exactly(s3):
    # 20 MB a rank: the first half goes out while the second is encoded, as a second object of the rank's.
    location = s3.location(BUCKET, "runs/halves")
    assert run_ranks(2, save_and_load_large_shards, location) == [[], []]
    save_id = tsckpt.open(location).metadata.extra["save_id"]
    data = {k: n for k, n in s3.sizes(BUCKET, "runs/halves/d/").items() if not k.endswith(".index")}
    assert sorted(data) == [f"runs/halves/d/{save_id}-{r}.{p}" for r in range(2) for p in range(2)]
    assert all(9e6 < n < 12e6 for n in data.values()), data
    w2 = zarr.open_array(store=tsckpt.zarr_store(location), path="w2", mode="r")
    assert np.array_equal(w2[1500:1502, 7:9], (np.arange(2048 * 2560, dtype=np.float32).reshape(2048, 2560) * 2)[1500:1502, 7:9])


def load_resharded(rank, world, location):
    """Load the 4-rank zoo into different placements on `world` ranks; return mismatching keys."""
    mesh = init_device_mesh("cpu", (world,))
    e = zoo.expected_all()
    targets = {
        "even": [Shard(1)],      # saved row-sharded on 4 ranks
        "uneven": [Shard(0)],
        "mesh2d": [Shard(1)],    # saved on a (2, 2) mesh
        "nested": [Replicate()],
        "repl": [Shard(0)],
        "st": [Shard(0)],        # saved as a ShardedTensor
    }
    model = {k: distribute_tensor(torch.zeros_like(e[k]), mesh, p, src_data_rank=None) for k, p in targets.items()}
    sd = {"model": model, "dtypes": {"bfloat16": distribute_tensor(
        torch.zeros(8, 3, dtype=torch.bfloat16), mesh, [Shard(1)], src_data_rank=None)}}
    tsckpt.load(sd, location, allow_partial_load=True)
    bad = [k for k, v in sd["model"].items() if not same_bits(v.full_tensor(), e[k])]
    if not same_bits(sd["dtypes"]["bfloat16"].full_tensor(), e["dtypes.bfloat16"]):
        bad.append("dtypes.bfloat16")
    return bad


def test_resharded_load_from_s3_on_2_ranks(zoo_s3):
    assert run_ranks(2, load_resharded, zoo_s3) == [[], []]


def test_zarr_python_reads_float32_over_s3(s3, zoo_s3):
    if tsckpt.open(zoo_s3).metadata.layout == "plain":  # zarr-python alone, through fsspec
        store = zarr.storage.FsspecStore.from_url(
            f"s3://{ZOO_BUCKET}/runs/zoo4", storage_options=s3.storage_options(), read_only=True)
    else:  # the joined OCDBT database needs TensorStore's kvstore
        store = tsckpt.zarr_store(zoo_s3)
    group = zarr.open_group(store, mode="r")
    expected = zoo.expected_all()
    for name in ("even", "mesh2d", "st"):
        np.testing.assert_array_equal(group["model"][name][...], expected[name].numpy())
    assert group["model"]["even"].attrs["tsckpt"]["key"] == "model.even"
    assert group.attrs["tsckpt"]["world_size"] == 4


def delete(kv: ts.KvStore, key: str) -> None:
    kv.delete_range(ts.KvStore.KeyRange(key, key + "\0")).result()


def small_state_dict() -> dict:
    return {"w": torch.arange(24, dtype=torch.float32).reshape(4, 6), "b": torch.ones(3, dtype=torch.bfloat16),
            "step": 7}


def test_prefix_with_array_data_but_no_root_metadata_is_refused(s3):
    location = s3.location(BUCKET, "runs/crashed")
    tsckpt.save(small_state_dict(), location, layout="plain")  # its chunk and node objects are edited below
    # What a save that died before its commit leaves: chunk data, no zarr.json anywhere.
    kv = open_kvstore(parse_location(location), make_context())
    for key in kv.list().result():
        if key.decode().endswith("zarr.json") or key.decode().startswith("d/"):  # d/: the ranks' digest tables
            delete(kv, key.decode())
    left = bucket_keys(s3, "runs/crashed")
    assert left and any(k.startswith("runs/crashed/w/c.") for k in left)
    # Without its save's claim nothing marks these objects as a save's: they could be anyone's.
    with pytest.raises(tsckpt.NotACheckpointError, match="runs/crashed.*tsckpt did not write"):
        tsckpt.load(small_state_dict(), location)
    kv.write(CLAIM, b'{"save_id": "0123"}').result()  # a save that died keeps its claim down
    with pytest.raises(tsckpt.IncompleteCheckpointError, match="runs/crashed"):
        tsckpt.load(small_state_dict(), location)
    # The root document alone decides: array nodes without it are still incomplete. (A plain save's claim is
    # never taken over by overwrite=True: its writes could still be on their way; clean --force removes it.)
    tsckpt.clean(location, force=True)
    tsckpt.save(small_state_dict(), location, overwrite=True, layout="plain")
    delete(kv, "zarr.json")
    assert "runs/crashed/w/zarr.json" in bucket_keys(s3, "runs/crashed")
    with pytest.raises(tsckpt.IncompleteCheckpointError):
        tsckpt.load(small_state_dict(), location)


def test_empty_s3_prefix_is_not_found(s3):
    with pytest.raises(tsckpt.CheckpointNotFoundError, match="s3://tsckpt-test/runs/never"):
        tsckpt.load(small_state_dict(), s3.location(BUCKET, "runs/never"))


def test_s3_overwrite_is_refused_then_replaces_everything(s3):
    location = s3.location(BUCKET, "runs/overwrite")
    tsckpt.save({"old": torch.ones(2, 2), "w": torch.zeros(3)}, location)
    with pytest.raises(tsckpt.CheckpointExistsError, match="runs/overwrite"):
        tsckpt.save({"w": torch.ones(3)}, location)
    tsckpt.save({"w": torch.full((3,), 5.0)}, location, overwrite=True)
    keys = bucket_keys(s3, "runs/overwrite")
    assert not any(k.startswith("runs/overwrite/old/") for k in keys)
    out = {"w": torch.zeros(3)}
    tsckpt.load(out, location)
    assert torch.equal(out["w"], torch.full((3,), 5.0))


def test_s3_url_with_endpoint_from_environment(s3, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.endpoint)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    tsckpt.save(small_state_dict(), f"s3://{BUCKET}/runs/env")
    out = {"w": torch.zeros(4, 6), "b": torch.zeros(3, dtype=torch.bfloat16), "step": None}
    tsckpt.load(out, f"s3://{BUCKET}/runs/env")
    assert torch.equal(out["w"], small_state_dict()["w"]) and out["step"] == 7


def test_s3_context_options_reach_tensorstore(s3):
    location = {**s3.location(BUCKET, "runs/ctx"),
                "context": {"s3_request_concurrency": {"limit": 2}, "s3_request_retries": {"max_retries": 3}}}
    writer = tsckpt.TensorStoreWriter(location, io_concurrency=8)
    spec = writer.context  # resolved through the layout's child context, if it adds one
    assert spec["s3_request_concurrency"].to_json() == {"limit": 2}     # the location's own setting wins
    assert spec["s3_request_retries"].to_json()["max_retries"] == 3
    assert spec["aws_credentials"].to_json() == {"type": "environment"}
    tsckpt.save(small_state_dict(), location)
    out = {"w": torch.zeros(4, 6), "b": torch.zeros(3, dtype=torch.bfloat16), "step": None}
    tsckpt.load(out, location)
    assert torch.equal(out["b"], torch.ones(3, dtype=torch.bfloat16))


def test_a_json_location_on_the_command_line(s3):
    import json

    location = s3.location(BUCKET, "runs/json")
    tsckpt.save(small_state_dict(), location)
    text = json.dumps(location)  # {"url": "s3://...", "endpoint": ..., "aws_region": ...}
    listed = run_cli("ls", text)
    assert listed.returncode == 0, listed.stderr
    assert "2 tensors" in listed.stdout and "1 value;" in listed.stdout
    assert run_cli("verify", text).returncode == 0
    assert tsckpt.open(text).metadata.world_size == 1  # the library takes the same text
    line = one_line_error(run_cli("ls", '{"url": "s3://bucket/x", "endpoint": '))
    assert "starts with '{' but is not valid JSON" in line


def test_missing_bucket_fails_with_the_location_in_the_message(s3):
    with pytest.raises(tsckpt.TsckptError, match="no-such-bucket"):
        tsckpt.save(small_state_dict(), s3.location("no-such-bucket", "x"))


def test_missing_bucket_is_one_clear_line_on_every_read_path(s3):
    location = s3.location("no-such-bucket", "x")
    message = "s3://no-such-bucket/x: the bucket does not exist"
    with pytest.raises(StorageError, match=message):
        tsckpt.open(location)
    with pytest.raises(StorageError, match=message):
        tsckpt.load(small_state_dict(), location)
    for command in ("ls", "verify"):
        assert message in one_line_error(run_cli(command, "s3://no-such-bucket/x",
                                                 env={"AWS_ENDPOINT_URL": s3.endpoint}))


def test_root_document_size_cap_is_exact_on_s3(s3, monkeypatch):
    location = s3.location(BUCKET, "runs/capped")
    tsckpt.save(small_state_dict(), location)
    kv = open_kvstore(parse_location(location), make_context())
    size = len(kv.read("zarr.json").result().value)
    # The cap is probed with a one-byte ranged read: a document of exactly the cap reads, one byte more does not.
    monkeypatch.setattr(commit, "MAX_DOCUMENT_BYTES", size)
    assert tsckpt.open(location).metadata.world_size == 1
    monkeypatch.setattr(commit, "MAX_DOCUMENT_BYTES", size - 1)
    with pytest.raises(MetadataError, match=f"zarr.json is larger than {size - 1} bytes"):
        tsckpt.open(location)


def test_tensorstore_reads_a_hyperslab_straight_from_s3(zoo_s3):
    loc = parse_location(zoo_s3)
    if tsckpt.open(zoo_s3).metadata.layout == "plain":
        kvstore = loc.child("model/mesh2d")
    else:  # docs/format.md: the array's path inside the OCDBT database at the checkpoint's root
        kvstore = {"driver": "ocdbt", "base": dict(loc.spec), "path": "model/mesh2d/"}
    arr = ts.open({"driver": "zarr3", "kvstore": kvstore}, context=make_context(8, loc)).result()
    np.testing.assert_array_equal(arr[1:5, 2:7].read().result(), zoo.expected_all()["mesh2d"][1:5, 2:7].numpy())
