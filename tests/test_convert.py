"""Conversions between DCP, torch.save, safetensors and tsckpt, on files written by the real tools."""

from __future__ import annotations

import json
import os
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from huggingface_hub import save_torch_state_dict
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from typer.testing import CliRunner

import tsckpt
import tsckpt.cli.convert  # noqa: F401  (registers the commands)
import zoo
from dist import run_ranks
from tsckpt.commit import protocol as commit
from tsckpt.conversion.builder import CheckpointBuilder
from tsckpt.cli import app
from tsckpt.conversion.convert import ConversionWarning, convert
from tsckpt.errors import CheckpointExistsError, CheckpointNotFoundError, PlanError, UnsafeObjectError
from tsckpt.conversion.sources import detect_format
from tsckpt.storage.context import make_context, open_kvstore
from tsckpt.storage.location import parse_location

DTYPES = [torch.bfloat16, torch.float16, torch.int8, torch.bool, torch.float8_e4m3fn, torch.uint16]
EXTRA = {"lr": 0.1, "groups": [{"betas": (0.9, 0.99), "params": [0, 1]}]}


def expected_flat() -> dict[str, torch.Tensor]:
    e = zoo.expected_all()
    out = {f"model.{k}": e[k] for k in ("even", "uneven", "cols", "repl", "plain", "scalar")}
    return out | {f"dtypes.{zoo.dtype_key(d)}": e[f"dtypes.{zoo.dtype_key(d)}"] for d in DTYPES}


def sharded_state_dict(world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    e = zoo.expected_all()

    def dt(name, placements):
        return distribute_tensor(e[name], mesh, placements, src_data_rank=None)

    model = {"even": dt("even", [Shard(0)]), "uneven": dt("uneven", [Shard(0)]), "cols": dt("cols", [Shard(1)]),
             "repl": dt("repl", [Replicate()]), "plain": e["plain"].clone(), "scalar": e["scalar"].clone()}
    dtypes = {zoo.dtype_key(d): dt(f"dtypes.{zoo.dtype_key(d)}", [Shard(0)]) for d in DTYPES}
    return {"model": model, "dtypes": dtypes, "extra": EXTRA}


def save_dcp(rank, world, path):
    dcp.save(sharded_state_dict(world), storage_writer=dcp.FileSystemWriter(path))


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory):
    """A DCP FileSystemWriter checkpoint of sharded DTensors, written by 2 gloo ranks."""
    path = str(tmp_path_factory.mktemp("dcp") / "ckpt")
    run_ranks(2, save_dcp, path)
    return path


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def flatten(sd: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out |= flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def assert_tensors(actual: dict, expected: dict) -> None:
    assert sorted(k for k, v in actual.items() if isinstance(v, torch.Tensor)) == sorted(expected)
    for key, value in expected.items():
        assert same_bits(actual[key], value), key


def empty_nested() -> dict:
    flat = expected_flat()
    return {"model": {k.split(".", 1)[1]: torch.zeros_like(v) for k, v in flat.items() if k.startswith("model.")},
            "dtypes": {k.split(".", 1)[1]: torch.zeros_like(v) for k, v in flat.items() if k.startswith("dtypes.")},
            "extra": {"lr": None, "groups": [{"betas": None, "params": None}]}}


def test_dcp_source_needs_trust_pickle(dcp_dir, tmp_path):
    assert detect_format(dcp_dir) == "dcp"
    with pytest.raises(UnsafeObjectError, match=r"\.metadata.*trust_pickle"):
        convert(dcp_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_dcp_to_tsckpt_is_bit_exact_and_keeps_nesting_and_values(dcp_dir, tmp_path):
    out = tmp_path / "ts"
    result = convert(dcp_dir, out, trust_pickle=True)
    assert (result.source_format, result.target_format, result.tensors) == ("dcp", "tsckpt", len(expected_flat()))
    sd = empty_nested()
    tsckpt.load(sd, str(out))
    assert_tensors(flatten({"model": sd["model"], "dtypes": sd["dtypes"]}), expected_flat())
    assert sd["extra"] == EXTRA
    # Back to DCP from tsckpt: DCP's own loader reads it.
    convert(out, tmp_path / "dcp2", to="dcp")
    back = _load_state_dict_from_keys(checkpoint_id=str(tmp_path / "dcp2"))
    assert_tensors(flatten({"model": back["model"], "dtypes": back["dtypes"]}), expected_flat())
    assert back["extra"] == EXTRA


def test_dcp_to_safetensors_warns_about_values_and_flattens(dcp_dir, tmp_path):
    out = tmp_path / "m.safetensors"
    with pytest.warns(ConversionWarning, match=r"non-tensor values.*extra\.groups\.0\.betas.*extra\.lr"):
        result = convert(dcp_dir, out, to="safetensors", trust_pickle=True)
    assert any("dotted names" in w for w in result.warnings)
    assert_tensors(load_file(out), expected_flat())


def test_dcp_to_torch_save_and_torch_save_to_dcp(dcp_dir, tmp_path):
    pt = tmp_path / "m.pt"
    convert(dcp_dir, pt, to="torch", trust_pickle=True)
    assert zipfile.ZipFile(pt).testzip() is None  # every record's CRC is right
    loaded = torch.load(pt, weights_only=True)
    assert sorted(loaded) == ["dtypes", "extra", "model"]
    assert_tensors(flatten({"model": loaded["model"], "dtypes": loaded["dtypes"]}), expected_flat())
    assert loaded["extra"] == EXTRA
    convert(pt, tmp_path / "dcp", to="dcp")
    back = _load_state_dict_from_keys(checkpoint_id=str(tmp_path / "dcp"))
    assert_tensors(flatten({"model": back["model"], "dtypes": back["dtypes"]}), expected_flat())


def test_torch_save_nested_values_survive_tsckpt(tmp_path):
    sd = {
        "model": {"layers.0.weight": torch.nn.Parameter(torch.randn(4, 3).bfloat16()), "empty": torch.empty(0, 2)},
        "optim": {"state": [{"step": torch.tensor(7.0), "exp_avg": torch.randn(4, 3)}],
                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "name": "all"}]},
        "epoch": 3,
    }
    src = tmp_path / "src.pt"
    torch.save(sd, src)
    assert detect_format(str(src)) == "torch"
    convert(src, tmp_path / "ts")
    pt = tmp_path / "back.pt"
    convert(tmp_path / "ts", pt, to="torch")
    back = torch.load(pt, weights_only=True)
    assert back["epoch"] == 3 and back["optim"]["param_groups"] == sd["optim"]["param_groups"]
    assert same_bits(back["model"]["layers.0.weight"], sd["model"]["layers.0.weight"].detach())
    assert back["model"]["empty"].shape == (0, 2)
    assert same_bits(back["optim"]["state"][0]["exp_avg"], sd["optim"]["state"][0]["exp_avg"])
    assert same_bits(back["optim"]["state"][0]["step"], sd["optim"]["state"][0]["step"])
    md = commit.read_metadata(open_kvstore(parse_location(tmp_path / "ts"), make_context()), "ts")
    assert md.tensors["model.layers.0.weight"].key_path == ("model", "layers.0.weight")
    assert md.extra["converted_from"]["format"] == "torch"


def test_safetensors_roundtrip_keeps_bits_and_header(tmp_path):
    tensors = {f"t.{zoo.dtype_key(d)}": zoo.expected(zoo.dtype_key(d), (5, 3), d) for d in DTYPES}
    tensors["scalar"] = torch.tensor(2.5)
    src = tmp_path / "in.safetensors"
    save_file(tensors, src, metadata={"format": "pt", "note": "x"})
    convert(src, tmp_path / "ts")
    convert(tmp_path / "ts", tmp_path / "out.safetensors")
    assert_tensors(load_file(tmp_path / "out.safetensors"), tensors)
    with safe_open(tmp_path / "out.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt", "note": "x"}
    convert(src, tmp_path / "flat.pt")
    assert_tensors(torch.load(tmp_path / "flat.pt", weights_only=True), tensors)


def test_hf_sharded_directory_to_tsckpt_and_back_to_shards(tmp_path):
    tensors = {f"layers.{i}.weight": torch.randn(64, 32).bfloat16() for i in range(5)}
    (tmp_path / "hf").mkdir()
    save_torch_state_dict(tensors, tmp_path / "hf", max_shard_size=10_000)
    assert len([n for n in os.listdir(tmp_path / "hf") if n.endswith(".safetensors")]) > 1
    assert detect_format(str(tmp_path / "hf")) == "hf-sharded"
    convert(tmp_path / "hf", tmp_path / "ts")
    convert(tmp_path / "ts", tmp_path / "out", to="safetensors", max_shard_size=9_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 3 and index["metadata"]["total_size"] == 5 * 64 * 32 * 2  # 2+2+1 tensors of 4 KiB
    loaded = {}
    for name in files:
        loaded |= load_file(tmp_path / "out" / name)
    assert_tensors(loaded, tensors)


def test_builder_writes_what_a_single_process_save_writes(tmp_path):
    sd = {"model": {"w": torch.randn(64, 48).bfloat16(), "b": torch.arange(5), "s": torch.tensor(3.0),
                    "z": torch.empty(0, 3)},
          "opt": {"lr": 0.1, "betas": (0.9, 0.99), "od": {1: "int key"}}, "flat.key": torch.ones(2)}
    # Plain: its files are compared byte for byte (packed data files have random names).
    tsckpt.save(sd, str(tmp_path / "a"), inner_chunk_bytes=1024, layout="plain")  # 64x48 bf16 gets inner chunks
    with CheckpointBuilder(tmp_path / "b", inner_chunk_bytes=1024, layout="plain") as b:
        for k, v in sd["model"].items():
            b.add_tensor(("model", k), v)
        b.add_object(("opt", "lr"), 0.1)
        b.add_object(("opt", "betas"), (0.9, 0.99))
        b.add_object(("opt", "od", "1"), "int key")
        b.add_tensor("flat.key", sd["flat.key"])

    def files(root):
        return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
                for d, _, fs in os.walk(root) for f in fs}

    def named(found, root):  # the rank's digest table is named after its save: rename it after the rank
        save_id = json.loads(found["zarr.json"])["attributes"]["tsckpt"]["extra"]["save_id"]
        return {k.replace(save_id, "SAVE"): v for k, v in found.items()}

    a, b_ = named(files(tmp_path / "a"), "a"), named(files(tmp_path / "b"), "b")
    assert sorted(a) == sorted(b_)
    assert any("model/w/c." in k for k in a)
    assert {k: v for k, v in a.items() if k != "zarr.json"} == {k: v for k, v in b_.items() if k != "zarr.json"}
    ma, mb = (json.loads(x["zarr.json"])["attributes"]["tsckpt"] for x in (a, b_))
    for volatile in ("created", "extra", "world_size", "data_files"):  # data_files: named after the save
        ma.pop(volatile), mb.pop(volatile)
    assert ma == mb


def test_builder_refuses_collisions_and_commits_only_on_success(tmp_path):
    b = CheckpointBuilder(tmp_path / "c")
    b.add_tensor(("a",), torch.ones(2))
    with pytest.raises(PlanError, match="collides"):
        b.add_tensor(("a", "b"), torch.ones(2))
    with pytest.raises(PlanError, match="twice"):
        b.add_object("a", 1)
    with pytest.raises(RuntimeError):
        with CheckpointBuilder(tmp_path / "d") as b2:
            b2.add_tensor("x", torch.ones(3))
            raise RuntimeError("producer failed")
    # The failed builder's staging directory is gone and the target was never created.
    with pytest.raises(CheckpointNotFoundError):
        commit.read_metadata(open_kvstore(parse_location(tmp_path / "d"), make_context()), "d")
    assert [n for n in os.listdir(tmp_path) if n == "d" or n.startswith(".d.")] == []


def test_existing_targets_are_refused_without_overwrite(tmp_path):
    src = tmp_path / "in.safetensors"
    save_file({"a": torch.ones(2)}, src)
    for to, dst in (("tsckpt", "ts"), ("torch", "x.pt"), ("safetensors", "x.safetensors"), ("dcp", "d")):
        convert(src, tmp_path / dst, to=to)
        with pytest.raises(CheckpointExistsError):
            convert(src, tmp_path / dst, to=to)
        convert(src, tmp_path / dst, to=to, overwrite=True)


def test_cli_convert(dcp_dir, tmp_path):
    runner = CliRunner()
    denied = runner.invoke(app, ["convert", dcp_dir, str(tmp_path / "ts"), "-q"])
    assert denied.exit_code == 2 and "--trust-pickle" in denied.output
    ok = runner.invoke(app, ["convert", dcp_dir, str(tmp_path / "m.safetensors"), "--trust-pickle", "-q"])
    assert ok.exit_code == 0, ok.output
    assert "warning:" in ok.output and "extra.lr" in ok.output
    assert_tensors(load_file(tmp_path / "m.safetensors"), expected_flat())
    sharded = runner.invoke(app, ["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "hf"),
                                  "--max-shard-size", "1KB", "-q"])
    assert sharded.exit_code == 0, sharded.output
    assert detect_format(str(tmp_path / "hf")) == "hf-sharded"
