"""Checkpoint locations: URL and spec parsing, validation, contexts, memory:// round trips."""

from __future__ import annotations

import os
import pickle

import pytest
import tensorstore as ts
import torch

import tsckpt
from tsckpt.storage.location import Location, parse_location
from tsckpt.storage.context import context_spec, make_context, open_kvstore
from tsckpt import TensorStoreReader, TensorStoreWriter


@pytest.fixture(autouse=True)
def no_aws_environment(monkeypatch):
    for key in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID"):
        monkeypatch.delenv(key, raising=False)


# --- parsing ----------------------------------------------------------------


def test_plain_path_and_file_url_give_the_same_absolute_file_spec(tmp_path):
    relative = os.path.relpath(tmp_path / "ck")
    for given in (str(tmp_path / "ck"), f"file://{tmp_path}/ck", relative, tmp_path / "ck"):
        loc = parse_location(given)
        assert loc.spec == {"driver": "file", "path": f"{tmp_path}/ck/"}
        assert loc.url == f"{tmp_path}/ck"


def test_s3_url():
    loc = parse_location("s3://my-bucket/runs/step-100")
    assert loc.spec == {"driver": "s3", "bucket": "my-bucket", "path": "runs/step-100/"}
    assert loc.url == "s3://my-bucket/runs/step-100"
    assert loc.child("model/w") == {"driver": "s3", "bucket": "my-bucket", "path": "runs/step-100/model/w/"}


def test_s3_bucket_root_has_an_empty_prefix():
    loc = parse_location("s3://my-bucket")
    assert loc.spec["path"] == "" and loc.child("w")["path"] == "w/"
    assert loc.url == "s3://my-bucket"


def test_gs_url_becomes_a_gcs_spec_that_tensorstore_accepts():
    loc = parse_location("gs://my_bucket.example/ckpt/7")
    assert loc.spec == {"driver": "gcs", "bucket": "my_bucket.example", "path": "ckpt/7/"}
    assert loc.url == "gs://my_bucket.example/ckpt/7"
    parsed = ts.KvStore.Spec(loc.child("model/w")).to_json()
    assert parsed["driver"] == "gcs" and parsed["bucket"] == "my_bucket.example"
    assert parsed["path"] == "ckpt/7/model/w/"
    spec = context_spec(16, loc)
    assert spec["gcs_request_concurrency"] == {"limit": 16}
    ts.Context(spec)  # TensorStore knows every resource named


def test_memory_url():
    loc = parse_location("memory://scratch/a")
    assert loc.spec == {"driver": "memory", "path": "scratch/a/"}
    assert loc.url == "memory://scratch/a"


def test_url_dict_adds_spec_members_and_defaults_the_region_for_custom_endpoints():
    loc = parse_location({"url": "s3://bkt/p", "endpoint": "http://127.0.0.1:9000"})
    assert loc.spec == {"driver": "s3", "bucket": "bkt", "path": "p/",
                        "endpoint": "http://127.0.0.1:9000", "aws_region": "us-east-1"}
    loc = parse_location({"url": "s3://bkt/p", "endpoint": "https://s3.example", "aws_region": "eu-west-3"})
    assert loc.spec["aws_region"] == "eu-west-3"
    ts.KvStore.Spec(loc.child("w"))


def test_full_spec_dict_keeps_its_members_and_moves_context_out():
    given = {"driver": "s3", "bucket": "bkt", "path": "a/b", "requester_pays": True,
             "context": {"s3_request_concurrency": {"limit": 4}}}
    loc = parse_location(given)
    assert loc.spec == {"driver": "s3", "bucket": "bkt", "path": "a/b/", "requester_pays": True}
    assert loc.context == {"s3_request_concurrency": {"limit": 4}}
    assert "context" in given  # the caller's dict is not modified
    assert parse_location(loc.to_dict()) == loc
    assert Location.from_dict(loc.to_dict()) == loc
    assert parse_location(loc) is loc


def test_location_context_overrides_defaults_and_is_used_by_the_writer():
    loc = parse_location({"url": "s3://bkt/p", "context": {"s3_request_concurrency": {"limit": 3}}})
    spec = context_spec(64, loc)
    assert spec["s3_request_concurrency"] == {"limit": 3}
    assert spec["file_io_concurrency"] == {"limit": 64}
    writer = TensorStoreWriter({"url": "s3://bkt/p", "context": {"s3_request_concurrency": {"limit": 3}}})
    # Resolved through the layout's child context, if it adds one.
    assert writer.context["s3_request_concurrency"].to_json() == {"limit": 3}


def test_s3_url_reads_endpoint_and_region_from_the_environment(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:2")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "ap-south-1")
    assert parse_location("s3://bkt/x").spec["endpoint"] == "http://127.0.0.1:2"   # the S3-specific one wins
    assert parse_location("s3://bkt/x").spec["aws_region"] == "ap-south-1"
    explicit = parse_location({"url": "s3://bkt/x", "endpoint": "http://127.0.0.1:3", "aws_region": "us-west-2"})
    assert explicit.spec["endpoint"] == "http://127.0.0.1:3" and explicit.spec["aws_region"] == "us-west-2"
    assert "endpoint" not in parse_location("gs://bkt/x").spec


def test_one_credentials_source_is_named_and_a_locations_own_wins(monkeypatch, tmp_path):
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    assert context_spec(8, parse_location("s3://bkt/x"))["aws_credentials"] == {"type": "anonymous"}
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    assert context_spec(8, parse_location("s3://bkt/x"))["aws_credentials"] == {"type": "environment"}
    assert "aws_credentials" not in context_spec(8, parse_location("gs://bkt/x"))
    profile = {"url": "s3://bkt/x", "context": {"aws_credentials": {"type": "profile", "profile": "train"}}}
    assert context_spec(8, parse_location(profile))["aws_credentials"]["profile"] == "train"


@pytest.mark.parametrize("bucket", [
    "ab", "a" * 64, "Upper-case", "under_score", "-leading", "trailing-", "two..dots", "dot.-dash",
    "192.168.1.10", "xn--punycode", "name-s3alias",
])
def test_invalid_s3_bucket_names_are_refused(bucket):
    with pytest.raises(tsckpt.TsckptError, match="not a valid s3 bucket name"):
        parse_location(f"s3://{bucket}/ckpt")
    with pytest.raises(tsckpt.TsckptError, match="not a valid s3 bucket name"):
        parse_location({"driver": "s3", "bucket": bucket, "path": "ckpt"})


@pytest.mark.parametrize("bucket", ["ab", "Caps", "-x-bucket", "a" * 64, "goog-bucket", "10.0.0.1"])
def test_invalid_gcs_bucket_names_are_refused(bucket):
    with pytest.raises(tsckpt.TsckptError, match="not a valid gs bucket name"):
        parse_location(f"gs://{bucket}/ckpt")


@pytest.mark.parametrize("bucket", ["abc", "my-bucket.v2", "a" * 63, "0-models"])
def test_valid_bucket_names_pass(bucket):
    assert parse_location(f"s3://{bucket}/x").spec["bucket"] == bucket
    assert parse_location(f"gs://{bucket}/x").spec["bucket"] == bucket


@pytest.mark.parametrize("given, message", [
    ("hdfs://cluster/ckpt", "scheme 'hdfs' is not one of file://, s3://, gs://, memory://"),
    ("", "empty"),
    ("s3://", "no bucket name"),
    ("s3:///prefix", "no bucket name"),
    ("gs://", "no bucket name"),
    ("memory://", "has no name"),
    ("file://", "has no path"),
    ({"path": "x"}, "neither 'driver' nor 'url'"),
    (42, "not a path, URL or kvstore spec"),
    (b"/tmp/x", "not a path, URL or kvstore spec"),
    ({"driver": "s3", "path": "x"}, "no bucket name"),
    ({"url": "s3://bkt/x", "driver": "s3"}, "either 'url' or 'driver'"),
    ({"url": "s3://bkt/x", "endpoint": "127.0.0.1:9000"}, "must be an http:// or https:// URL"),
    ({"url": "s3://bkt/x", "context": ["not", "a", "dict"]}, "'context' must be a dict"),
])
def test_bad_locations_fail_early_with_a_clear_error(given, message):
    with pytest.raises(tsckpt.TsckptError, match=message):
        parse_location(given)


def test_writer_and_reader_validate_before_any_io():
    assert not TensorStoreWriter.validate_checkpoint_id("ftp://host/x")
    assert not TensorStoreReader.validate_checkpoint_id("s3://No/x")
    assert TensorStoreWriter.validate_checkpoint_id("s3://bkt/x")
    assert TensorStoreReader.validate_checkpoint_id({"driver": "gcs", "bucket": "bkt"})
    with pytest.raises(tsckpt.TsckptError, match="scheme 'ftp'"):
        tsckpt.save({"w": torch.zeros(2)}, "ftp://host/x")
    with pytest.raises(tsckpt.TsckptError, match="not a valid s3 bucket name"):
        tsckpt.load({"w": torch.zeros(2)}, "s3://B/x")


def test_unknown_context_resource_is_a_tsckpt_error():
    loc = parse_location({"url": "memory://x", "context": {"no_such_resource": {}}})
    with pytest.raises(tsckpt.TsckptError, match="memory://x"):
        make_context(4, loc)


def test_locations_and_writers_pickle_for_process_based_async_save():
    loc = parse_location({"url": "s3://bkt/p", "endpoint": "http://127.0.0.1:9", "context": {"s3_request_retries": {"max_retries": 2}}})
    assert pickle.loads(pickle.dumps(loc)) == loc
    writer = TensorStoreWriter(loc.to_dict())
    _ = writer.context
    clone = pickle.loads(pickle.dumps(writer))
    assert clone.location == writer.location and clone._store is None


# --- memory:// round trips --------------------------------------------------


def state_dict() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {"w": torch.randn(6, 5, generator=g), "b16": torch.randn(9, generator=g).to(torch.bfloat16),
                  "f8": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn), "step": torch.tensor(12)},
        "extra": {"lr": 0.25, "name": "mem"},
    }


def zeros_like(sd: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "extra": {"lr": None, "name": None}}


def test_memory_round_trip_across_separate_writer_and_reader():
    sd = state_dict()
    tsckpt.save(sd, "memory://round-trip")
    out = zeros_like(sd)
    tsckpt.load(out, "memory://round-trip")
    for k, v in sd["model"].items():
        got = out["model"][k]
        assert got.dtype == v.dtype
        assert torch.equal(got.view(torch.uint8) if v.dtype.itemsize == 1 else got,
                           v.view(torch.uint8) if v.dtype.itemsize == 1 else v), k
    assert out["extra"] == {"lr": 0.25, "name": "mem"}


def test_memory_checkpoints_are_separate_by_name_and_follow_the_commit_protocol():
    tsckpt.save(state_dict(), "memory://named/a")
    with pytest.raises(tsckpt.CheckpointNotFoundError, match="memory://named/b"):
        tsckpt.load(zeros_like(state_dict()), "memory://named/b")
    with pytest.raises(tsckpt.CheckpointExistsError, match="memory://named/a"):
        tsckpt.save(state_dict(), "memory://named/a")
    loc = parse_location("memory://named/a")
    kv = open_kvstore(loc, make_context(4, loc))
    kv.delete_range(ts.KvStore.KeyRange("zarr.json", "zarr.json\0")).result()
    assert kv.list().result()  # array data is still there
    with pytest.raises(tsckpt.IncompleteCheckpointError, match="memory://named/a"):
        tsckpt.load(zeros_like(state_dict()), "memory://named/a")


def test_memory_spec_dict_with_dcp_checkpoint_id():
    import torch.distributed.checkpoint as dcp

    sd = {"w": torch.arange(10.0)}
    dcp.save(sd, checkpoint_id={"driver": "memory", "path": "dcp-id"}, storage_writer=TensorStoreWriter())
    out = {"w": torch.zeros(10)}
    dcp.load(out, checkpoint_id={"driver": "memory", "path": "dcp-id"}, storage_reader=TensorStoreReader())
    assert torch.equal(out["w"], sd["w"])
