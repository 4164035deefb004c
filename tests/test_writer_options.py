"""Writer options that change the codecs: checksums off, compression, and the GC pause."""

from __future__ import annotations

import gc
import json

import numpy as np
import pytest
import torch
import zarr

import tsckpt
from damage import edit_key, flip_byte, read_key
from tsckpt.dcp.collector import held_off
from tsckpt.read.verify import verify


def _state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(64, 48, generator=g),
        "b": torch.randn(64, 48, generator=g).to(torch.bfloat16),
        "mask": torch.rand(7, generator=g) > 0.5,
        "big": torch.zeros(256, 64),  # crosses inner_chunk_bytes below: sharding codec
    }


def _codec_names(codecs: list[dict]) -> list[str]:
    out = []
    for c in codecs:
        out.append(c["name"])
        if c["name"] == "sharding_indexed":
            out += _codec_names(c["configuration"]["codecs"])
    return out


@pytest.mark.parametrize("options", [
    {},
    {"crc32c_codec": True},
    {"checksums": False},
    {"compression": "zstd"},
    {"compression": "blosc"},
    {"compression": "zstd", "crc32c_codec": True},
])
def test_options_round_trip_and_zarr_python_reads_them(tmp_path, options):
    sd = _state_dict()
    tsckpt.save(sd, tmp_path / "c", inner_chunk_bytes=16 << 10, **options)
    doc = json.loads(read_key(tmp_path / "c", "big/zarr.json"))
    names = _codec_names(doc["codecs"])
    assert names[0] == "sharding_indexed"
    # Every chunk carries its crc32c whenever checksums are on (crc32c_codec=True asks for nothing more).
    assert ("crc32c" in names) == (options.get("checksums", True) or options.get("crc32c_codec", False))
    root = json.loads((tmp_path / "c" / "zarr.json").read_text())["attributes"]["tsckpt"]
    assert "checksums" not in root["tensors"]["big"]  # no table in the root document: beside each chunk
    # Each rank's chunk table: where its values are (packed) and their content hashes (with checksums).
    tables = [r["table"] for r in root["data_files"]["ranks"]]
    assert all(t is not None for t in tables) == (options.get("checksums", True) or root["layout"] == "packed")
    if "compression" in options:
        assert options["compression"] in names
    back = {k: torch.empty_like(v) for k, v in sd.items()}
    tsckpt.load(back, tmp_path / "c")
    for k, v in sd.items():
        assert torch.equal(back[k], v), k
    np.testing.assert_array_equal(zarr.open_array(tsckpt.zarr_store(tmp_path / "c"), path="w", mode="r")[...],
                                  sd["w"].numpy())
    report = verify(tmp_path / "c")
    assert report.ok, report


def test_zeros_compress_and_the_default_stays_uncompressed(tmp_path):
    sd = {"z": torch.zeros(512, 512)}
    # The plain layout: its chunk files are measured.
    tsckpt.save(sd, tmp_path / "plain", layout="plain")
    tsckpt.save(sd, tmp_path / "zstd", compression="zstd", layout="plain")
    size = {name: sum(f.stat().st_size for f in (tmp_path / name / "z").glob("c*")) for name in ("plain", "zstd")}
    assert size["plain"] >= 512 * 512 * 4 and size["zstd"] < size["plain"] // 100


def test_without_checksums_corruption_is_not_detected_but_with_them_it_is(tmp_path):
    sd = {"w": torch.arange(1024.0)}
    for name, checksums in (("off", False), ("on", True)):
        tsckpt.save(sd, tmp_path / name, checksums=checksums)
        edit_key(tmp_path / name, "w/c.0", lambda data: flip_byte(data, 8))
    back = {"w": torch.empty(1024)}
    tsckpt.load(back, tmp_path / "off")
    assert not torch.equal(back["w"], sd["w"])  # the price of turning checksums off
    with pytest.raises(tsckpt.TsckptError, match="'w'"):
        tsckpt.load(back, tmp_path / "on")


@pytest.mark.parametrize("bad, message", [
    ({"compression": "gzip9"}, "unknown compression 'gzip9'"),
    ({"checksums": "yes"}, "checksums must be True or False"),
])
def test_bad_writer_options_are_refused_before_writing(tmp_path, bad, message):
    with pytest.raises(tsckpt.TsckptError, match=message):
        tsckpt.save({"w": torch.ones(2)}, tmp_path / "c", **bad)
    assert not (tmp_path / "c").exists()


def test_gc_is_paused_during_the_call_and_restored_after():
    assert gc.isenabled()
    with held_off():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with held_off():
            pass
        assert not gc.isenabled()  # a caller who had it off keeps it off
    finally:
        gc.enable()


# --- ranks whose writers were given different options -------------------------------------------

_RANK_OPTIONS = [
    {"checksums": True, "layout": "plain", "inner_chunk_bytes": 16 << 10},  # the coordinator's: what counts
    {"checksums": False, "layout": "packed", "compression": "zstd", "crc32c_codec": True, "inner_chunk_bytes": 0},
]


def _mixed_sd(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _state_dict().items() if k != "mask"}


def save_with_rank_options(rank, world, path):
    import torch.distributed.checkpoint as dcp

    dcp.save(_mixed_sd(rank, world), storage_writer=tsckpt.TensorStoreWriter(path, **_RANK_OPTIONS[rank]))


def test_every_rank_writes_with_the_coordinators_options(tmp_path):
    """Each rank's own writer options would give chunks the metadata does not describe: the plan overrides them."""
    from dist import run_ranks

    path = str(tmp_path / "c")
    run_ranks(2, save_with_rank_options, path)
    root = json.loads((tmp_path / "c" / "zarr.json").read_text())["attributes"]["tsckpt"]
    assert root["layout"] == "plain" and root["array_options"] == {"crc32c_codec": True, "compression": None}
    assert all(r["table"] is not None for r in root["data_files"]["ranks"])
    assert _codec_names(json.loads(read_key(tmp_path / "c", "big/zarr.json"))["codecs"])[0] == "sharding_indexed"
    sd = {k: v for k, v in _state_dict().items() if k != "mask"}
    back = {k: torch.empty_like(v) for k, v in sd.items()}
    tsckpt.load(back, path)
    for k, v in sd.items():
        assert torch.equal(back[k], v), k
    np.testing.assert_array_equal(zarr.open_array(tsckpt.zarr_store(path), path="w", mode="r")[...], sd["w"].numpy())
    report = verify(path)
    assert report.ok, report
